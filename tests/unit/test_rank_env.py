"""What a rank process is given (`workers.slot.rank_spec.rank_env`, `script_command`): the environment torchrun
or DeepSpeed's launcher would set, bound to its slot and its gang's GPUs, without the worker's secrets."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workers.slot.rank_spec import RankSpec, rank_env, script_command
from workers.device.slot import Slot

GiB = 2**30


def spec(**overrides: object) -> RankSpec:
    fields = dict(job="j", name="z1_gas1_tmbspg4", attempt="a", results_root="/r", script_argv=["t.py", "--x"],
                  ds_config={}, rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, num_nodes=2,
                  timeout_s=60.0)
    return RankSpec(**{**fields, **overrides})


CUDA = Slot("n2", 1, "cuda", 80 * GiB, "127.0.0.1", 8, (), "w@n2", cuda_index=6, gpu_uuid="GPU-6a")
CPU = Slot("n2", 1, "cpu", 2 * GiB, "127.0.0.1", 1, (1,), "w@n2")


def test_a_cuda_rank_sees_its_gangs_gpus_and_its_local_rank_indexes_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_REDIS_URL", "redis://:secret@10.0.0.1:6379/0")
    monkeypatch.setenv("AUTOTUNE_SLOT_JSON", "{}")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = rank_env(spec(cuda_devices=["4", "6"]), CUDA, ("10.0.0.2", 29500), Path("/r/x/rank3.exit.json"))
    assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == "6"
    # nvidia-smi's indices in its (PCI bus) order, as DeepSpeed's launcher sets them: DeepSpeed int()s them
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("4,6", "PCI_BUS_ID")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("3", "4", "2", "1")
    assert (env["CROSS_RANK"], env["CROSS_SIZE"]) == ("1", "2")  # as DeepSpeed's launcher sets them
    # the interface holding the address; NCCL exactly that one ('=': a bare name is a prefix to NCCL)
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "=lo")
    assert env["AUTOTUNE_EXIT_REPORT"] == "/r/x/rank3.exit.json"
    assert "AUTOTUNE_REDIS_URL" not in env and "AUTOTUNE_SLOT_JSON" not in env


def test_a_single_gpu_rank_sees_its_own_index_whether_or_not_its_slot_knows_the_uuid() -> None:
    assert rank_env(spec(), CUDA, ("10.0.0.2", 29500))["CUDA_VISIBLE_DEVICES"] == "6"
    without = Slot("n2", 1, "cuda", 80 * GiB, "127.0.0.1", 8, (), "w@n2", cuda_index=6)  # registered before UUIDs
    assert rank_env(spec(), without, ("10.0.0.2", 29500))["CUDA_VISIBLE_DEVICES"] == "6"


def test_inside_one_node_nccl_picks_its_own_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL_SOCKET_IFNAME only across nodes: inside one, NCCL uses P2P/shared memory and its own
    bootstrap choice, as in the final run; gloo still gets the slot's interface."""
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = rank_env(spec(num_nodes=1, node_rank=0, rank=1), CUDA, ("127.0.0.1", 29500))
    assert "NCCL_SOCKET_IFNAME" not in env and env["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_chosen_socket_interface_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert rank_env(spec(), CUDA, ("10.0.0.2", 29500))["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_cpu_rank_sees_no_gpu() -> None:
    env = rank_env(spec(cuda_devices=[]), CPU, ("127.0.0.1", 29500))
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "CUDA_DEVICE_ORDER" not in env


@pytest.mark.parametrize(
    ("argv", "local_rank", "expected"),
    [
        (["t.py", "--x"], None, [sys.executable, "-m", "workers.in_rank.entry", "t.py", "--x"]),
        (["t.py", "--x"], 1, [sys.executable, "-m", "workers.in_rank.entry", "t.py", "--local_rank=1", "--x"]),
        (["./run.sh", "--x"], 0, ["./run.sh", "--local_rank=0", "--x"]),  # where DeepSpeed's launcher puts it
    ],
)
def test_script_command(argv: list[str], local_rank: int | None, expected: list[str]) -> None:
    assert script_command(argv, local_rank) == expected


def test_a_rank_gets_the_users_variables_and_none_of_the_clusters_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = {"AUTOTUNE_REDIS_URL": "redis://autotune:pw@10.0.0.1:6379/0", "FLOWER_BASIC_AUTH": "ops:flowerpw",
               "FLOWER_OAUTH2_SECRET": "oauth", "AUTOTUNE_REDIS_CA": "/etc/autotune/ca.crt",
               "AUTOTUNE_REDIS_CERT": "/etc/autotune/client.crt", "AUTOTUNE_REDIS_KEY": "/etc/autotune/client.key"}
    users = {"MLFLOW_TRACKING_PASSWORD": "mine", "HF_TOKEN": "hf", "MY_SETTING": "1"}
    for name, value in {**cluster, **users}.items():
        monkeypatch.setenv(name, value)
    env = rank_env(spec(), CPU, ("10.0.0.2", 29500))
    assert not set(cluster) & set(env)
    assert {name: env.get(name) for name in users} == users  # as deepspeed passes them on
