"""Elastic flags -> torchrun: the range rules, the exact flags, and torchrun's own parser accepting them."""
from __future__ import annotations

import pytest

from scheduler.launch.elastic import (
    DEFAULT_RUN_ID,
    ElasticSettings,
    check_elastic_launch,
    node_environment,
    rendezvous_args,
    rendezvous_endpoint,
    resolve_elastic,
    shared_device_ids,
    torchrun_command,
)
from scheduler.errors import UsageError
from scheduler.resources import Resources


@pytest.mark.parametrize(
    ("min_nodes", "max_nodes", "num_hosts", "expected"),
    [
        (1, 2, 2, (1, 2)),
        (2, 2, 2, (2, 2)),
        (2, None, 3, (2, 3)),
        (None, 4, 2, (1, 4)),
        (1, 8, 2, (1, 8)),
    ],
)
def test_range_resolution(min_nodes, max_nodes, num_hosts, expected) -> None:
    settings = resolve_elastic(elastic_training=True, min_nodes=min_nodes, max_nodes=max_nodes, num_hosts=num_hosts)
    assert settings is not None
    assert (settings.min_nodes, settings.max_nodes) == expected
    assert settings.nnodes == f"{expected[0]}:{expected[1]}"


@pytest.mark.parametrize(
    ("elastic_training", "min_nodes", "max_nodes", "num_hosts", "message"),
    [
        (True, None, None, 2, "needs a node range"),
        (True, 3, 2, 4, "larger than --max_elastic_nodes 2"),
        (True, 0, 2, 2, "--min_elastic_nodes must be at least 1, got 0"),
        (True, 1, -1, 2, "--max_elastic_nodes must be at least 1, got -1"),
        (True, 3, 4, 2, "only 2 hosts are selected"),
        (False, 1, None, 2, "--min_elastic_nodes only apply with --elastic_training"),
        (False, None, 2, 2, "--max_elastic_nodes only apply with --elastic_training"),
        (False, 1, 2, 2, "--min_elastic_nodes and --max_elastic_nodes only apply"),
    ],
)
def test_range_errors(elastic_training, min_nodes, max_nodes, num_hosts, message) -> None:
    with pytest.raises(UsageError, match=message):
        resolve_elastic(
            elastic_training=elastic_training, min_nodes=min_nodes, max_nodes=max_nodes, num_hosts=num_hosts
        )


def test_elastic_off_without_range_is_none() -> None:
    assert resolve_elastic(elastic_training=False, min_nodes=None, max_nodes=None, num_hosts=2) is None


@pytest.mark.parametrize(
    ("explicit", "environ", "expected"),
    [
        (None, {}, DEFAULT_RUN_ID),
        (None, {"ELASTIC_RUN_ID": "job-7"}, "job-7"),
        ("mine", {"ELASTIC_RUN_ID": "job-7"}, "mine"),
    ],
)
def test_run_id_precedence(explicit, environ, expected) -> None:
    settings = resolve_elastic(
        elastic_training=True, min_nodes=1, max_nodes=2, num_hosts=2, run_id=explicit, environ=environ
    )
    assert settings is not None and settings.run_id == expected


@pytest.mark.parametrize("bad", ["", "  ", "two words"])
def test_run_id_must_be_one_word(bad: str) -> None:
    with pytest.raises(UsageError, match="run id"):
        resolve_elastic(elastic_training=True, min_nodes=1, max_nodes=2, num_hosts=2, run_id=bad)


def test_rendezvous_args_exact() -> None:
    settings = ElasticSettings(min_nodes=1, max_nodes=2, run_id="job-7")
    assert rendezvous_args(settings, "10.0.0.1", 29500) == [
        "--nnodes=1:2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:29500",
        "--rdzv_id=job-7",
        "--max_restarts=100",
        "--monitor_interval=5",
    ]


@pytest.mark.parametrize(
    ("addr", "expected"),
    [("10.0.0.1", "10.0.0.1:29600"), ("worker-0", "worker-0:29600"), ("fe80::1", "[fe80::1]:29600"),
     ("[fe80::1]", "[fe80::1]:29600")],
)
def test_endpoint_forms(addr: str, expected: str) -> None:
    assert rendezvous_endpoint(addr, 29600) == expected


@pytest.mark.parametrize(("addr", "port", "message"), [("", 29500, "needs --master_addr"), ("h", 0, "not a TCP port")])
def test_endpoint_errors(addr: str, port: int, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        rendezvous_endpoint(addr, port)


def test_torchrun_command_exact_and_accepted_by_torchrun() -> None:
    settings = ElasticSettings(min_nodes=1, max_nodes=2)
    argv = torchrun_command(
        settings, python="/usr/bin/python3", master_addr="10.0.0.1", master_port=29500, nproc_per_node=4,
        user_script="train.py", user_args=["--name", "a b"],
    )
    assert argv == [
        "/usr/bin/python3", "-u", "-m", "torch.distributed.run",
        "--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.1:29500", f"--rdzv_id={DEFAULT_RUN_ID}",
        "--max_restarts=100", "--monitor_interval=5", "--nproc_per_node=4",
        "train.py", "--name", "a b",
    ]
    run = pytest.importorskip("torch.distributed.run")
    parsed = run.get_args_parser().parse_args(argv[4:])
    assert run.parse_min_max_nnodes(parsed.nnodes) == (1, 2)
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id) == ("c10d", "10.0.0.1:29500", DEFAULT_RUN_ID)
    assert (parsed.max_restarts, parsed.nproc_per_node) == (100, "4")
    assert (parsed.training_script, parsed.training_script_args) == ("train.py", ["--name", "a b"])


@pytest.mark.parametrize(("module", "no_python", "flag"), [(True, False, "--module"), (False, True, "--no_python")])
def test_torchrun_module_and_no_python(module: bool, no_python: bool, flag: str) -> None:
    argv = torchrun_command(
        ElasticSettings(1, 2), python="py", master_addr="h", master_port=1, nproc_per_node=1,
        user_script="s", module=module, no_python=no_python,
    )
    assert argv[-2:] == [flag, "s"]


def test_torchrun_module_with_no_python_is_an_error() -> None:
    with pytest.raises(UsageError, match="--module and --no_python"):
        torchrun_command(ElasticSettings(1, 2), python="py", master_addr="h", master_port=1, nproc_per_node=1,
                         user_script="s", module=True, no_python=True)


def test_shared_device_ids_keeps_real_ids() -> None:
    resources = Resources.from_mapping({"a": [2, 3], "b": [2, 3]})
    assert shared_device_ids(resources) == (2, 3)
    assert node_environment((2, 3)) == {"CUDA_VISIBLE_DEVICES": "2,3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_shared_device_ids_rejects_different_hosts() -> None:
    with pytest.raises(UsageError, match="same device ids on every host, got a:0,1, b:0"):
        shared_device_ids(Resources.from_mapping({"a": [0, 1], "b": [0]}))


@pytest.mark.parametrize("launcher", ["local", "pdsh"])
def test_per_node_launchers_accept_elastic(launcher: str) -> None:
    check_elastic_launch(launcher)


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "impi", "mvapich", "slurm"])
def test_rank_launchers_refuse_elastic(launcher: str) -> None:
    with pytest.raises(UsageError, match=f"not supported with --launcher {launcher}"):
        check_elastic_launch(launcher)


def test_launch_only_flags_refused() -> None:
    with pytest.raises(UsageError, match="--save_pid, --bind_core_list cannot be combined"):
        check_elastic_launch("pdsh", ["--save_pid", "--bind_core_list"])
