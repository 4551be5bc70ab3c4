"""The CUDA path on a machine without a GPU: a fake nvidia-smi (tests/fake_gpu) lists GPUs, the real
embedded cluster, real Celery workers and real rank processes run a stand-in CUDA script
(scripts/cuda_rank_probe.py) that checks what a CUDA rank is given and fails as a real one would.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from integration_helpers import ROOT, SCRIPTS, run_autotune, stop_group, wait_for, write_config
from scheduler.embedded.worker_command import worker_argv

pytestmark = pytest.mark.integration
FAKE_GPU_DIR = ROOT / "tests" / "fake_gpu"
PROBE = SCRIPTS / "cuda_rank_probe.py"
#: CPU threads per rank on a node of 3 fake GPUs (one slot per GPU), as cmd_optimal.txt gives them
THREADS = max(1, (os.cpu_count() or 1) // 3)
GiB = 2**30


def gpu_env(**extra: str) -> dict[str, str]:
    """A machine with three 16 GiB GPUs as far as every process we start can tell (CUDA is not asked
    which GPU it opens: on a machine with real GPUs it would open a real one, workers.device.cuda_binding)."""
    return {"PATH": f"{FAKE_GPU_DIR}{os.pathsep}{os.environ['PATH']}", "AUTOTUNE_CUDA_BINDING_CHECK": "off", **extra}


def probe_config(path: Path, sizes: list[int]) -> Path:
    return write_config(path, train_micro_batch_size_per_gpu=sizes, autotuning={
        "enabled": True, "metric": "throughput", "user_script": str(PROBE),
        "user_args": ["--expect-cuda-index", "0,1,2"],
        "model_info": {"num_params": 1000, "trainable_num_params": 1000, "activation_mem_per_gpu": GiB}})


def test_three_fake_gpus_give_three_cuda_slots_and_each_rank_its_own_device(tmp_path: Path) -> None:
    """Also (workers.state.slot_health): another process holds 20 GiB of GPU 2
    at the start. The first launch's rank 2 waits AUTOTUNE_GPU_WAIT_S for it, does not start, and
    the launch is queued again with GPU 2's slot out of tuning; the autotuner says so, the test
    then frees GPU 2, and the launch runs once the slot's worker has read it free: no record
    was measured beside the 20 GiB. The mbs-2 experiment's rank 1 leaves 8 GiB on GPU 1 as it exits:
    its rank waits for it, then records it, and its slot leaves tuning. GPUs 0 and 1 are NVLinked
    and GPU 2 hangs off the host bridge (`nvidia-smi topo -m`): each record names the gang's
    slowest link, PHB."""
    cfg = probe_config(tmp_path / "cfg.json", [1, 2])
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] += ["--leave-used", "1,2,8192"]
    cfg.write_text(json.dumps(data))
    used = tmp_path / "used.csv"
    used.write_text("0, 2\n1, 0\n2, 20480\n")
    topology = tmp_path / "topo.csv"
    topology.write_text("0, 1, NV12\n")
    env = {key: value for key, value in os.environ.items() if key != "AUTOTUNE_REDIS_URL"}
    env.update(gpu_env(FAKE_NVIDIA_SMI_USED_FILE=str(used), AUTOTUNE_GPU_WAIT_S="3",
                       FAKE_NVIDIA_SMI_TOPO_FILE=str(topology)))
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(cfg), "--num_gpus", "3"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "not started: other processes hold memory on" in line:
                used.write_text("0, 2\n1, 0\n2, 0\n")  # the holder of GPU 2 went
            elif "z0_gas1_tmbspg2" in line and " ok " in line:
                used.write_text("0, 2\n1, 0\n2, 0\n")  # and so did what the rank left on GPU 1
        proc.wait(timeout=300)
    finally:
        stop_group(proc)
    stdout = "".join(lines)
    assert proc.returncode == 0, stdout + stderr.read_text()
    assert "redis-server and 3 slot workers" in stdout  # one per GPU on a 2-core machine
    # under the record line of the mbs-2 experiment, and of its confirmation (scheduler.search.repeats.confirm),
    # which leaves the same 8 GiB
    left = [(lines[i - 1].split()[0], line.strip()) for i, line in enumerate(lines)
            if "still used a wait after the run" in line]
    assert [name for name, _ in left] == ["z0_gas1_tmbspg2", "z0_gas1_tmbspg2_r2"], stdout
    assert all(line.startswith("still used a wait after the run: ")
               and line.endswith(".gpu1 (8.0 GiB); out of tuning until it frees") for _, line in left), stdout
    busy = [line for line in lines if "not started" in line]
    assert len(busy) == 1 and busy[0].split()[0] == "z0_gas2_tmbspg1", stdout
    assert busy[0].rstrip().endswith(".gpu2 (20.0 GiB used by other processes); out of tuning until it frees, "
                                     "queued again"), busy
    results = tmp_path / "autotuning_results"
    # the confirmation too started only once GPU 1 was free again (no foreign bytes in its record)
    for name, mbs in (("z0_gas2_tmbspg1", 1), ("z0_gas1_tmbspg2", 2), ("z0_gas1_tmbspg2_r2", 2)):
        record = json.loads((results / name / "result.json").read_text())
        assert record["status"] == "ok", record
        assert record["peak_device_bytes"] == (2 + mbs) * GiB  # measured inside the ranks, busiest rank
        assert record["device_foreign_bytes"] == 0  # never started beside the 20 GiB
        assert record["gpu_link"] == "PHB"
        ranks = {r["rank"]: r for r in record["ranks"]}
        # each rank found its GPU free when its wait ended (how long a reading takes is the load's)
        assert all(r["device_foreign_bytes"] == 0 and "device_wait_s" in r for r in ranks.values()), ranks
        left = {rank: r.get("device_foreign_after_bytes") for rank, r in ranks.items()}
        assert left == ({0: None, 1: 8 * GiB, 2: None} if mbs == 2 else {0: None, 1: None, 2: None})
        probes = [json.loads((results / name / f"probe.rank{rank}.json").read_text()) for rank in range(3)]
        for rank, probe in enumerate(probes):
            assert probe["cuda_visible_devices"] == "0,1,2"  # nvidia-smi's indices: what DeepSpeed can read
            assert probe["cuda_indices"] == "0,1,2" and probe["local_rank"] == rank
            assert probe["slot"].endswith(f".gpu{rank}")
            assert probe["local_rank_arg"] == rank  # --local_rank=N, as the final deepspeed command gives it
            assert probe["cuda_device_order"] == "PCI_BUS_ID" and not probe["redis_url_leaked"]
            assert probe["nccl_socket_ifname"] is None  # one node: NCCL's own choice, as in the final run
    command = shlex.split((results / "cmd_optimal.txt").read_text())
    assert command[:3] == [f"OMP_NUM_THREADS={THREADS}", f"MKL_NUM_THREADS={THREADS}", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    assert command[3:6] == ["deepspeed", "--include", "localhost:0,1,2"] and "--no_local_rank" not in command


def test_inherited_visible_devices_are_honoured(tmp_path: Path) -> None:
    """The autotuner runs with CUDA_VISIBLE_DEVICES=2,0: two slots, gpu0 is GPU 2 and gpu1 is GPU 0,
    and a 2-rank experiment's ranks see "2,0", so LOCAL_RANK 0 picks GPU 2.

    Given the README's first command's `--slot-memory 1.25GiB`, the GPU slots keep
    their GPU's 16 GiB and no rank's host memory is capped: the command says so in a note."""
    cfg = probe_config(tmp_path / "cfg.json", [1])
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] = ["--expect-cuda-index", "2,0"]
    cfg.write_text(json.dumps(data))
    done = run_autotune([str(cfg), "--no_local_rank", "--slot-memory", "1.25GiB"], cwd=tmp_path,
                        env_extra=gpu_env(CUDA_VISIBLE_DEVICES="2,0"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "slot memory 16.0 GiB" in done.stdout and "--slot-memory 1.25GiB sizes CPU slots only" in done.stdout
    results = tmp_path / "autotuning_results"
    ranks = json.loads((results / "z0_gas1_tmbspg1" / "result.json").read_text())["ranks"]
    assert [r["memory_cap_bytes"] for r in ranks] == [None, None]
    probes = [json.loads((results / "z0_gas1_tmbspg1" / f"probe.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [p["cuda_indices"] for p in probes] == ["2,0", "2,0"]
    assert [p["cuda_visible_devices"] for p in probes] == ["2,0"] * 2  # as cmd_optimal.txt's --include
    assert [p["local_rank_arg"] for p in probes] == [None, None]
    command = shlex.split((results / "cmd_optimal.txt").read_text())
    assert command[2:7] == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--include", "localhost:2,0", "--no_local_rank"]


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--slots", "4"], {}, "--slots 4: this machine has 3 usable GPU(s)"),
        ([], {"FAKE_NVIDIA_SMI_OUTPUT": "0, GPU-a, 16384, Enabled"}, "GPU 0 has MIG enabled"),
        ([], {"FAKE_NVIDIA_SMI_OUTPUT": "0, GPU-a, N/A, Disabled"}, "memory as 'N/A'"),
        ([], {"FAKE_NVIDIA_SMI_OUTPUT": "garbage"}, "cannot read"),
        ([], {"CUDA_VISIBLE_DEVICES": "MIG-4f1e"}, "MIG instance"),
        ([], {"CUDA_VISIBLE_DEVICES": "7"}, "not a GPU of this node"),
    ],
)
def test_unusable_gpus_are_refused_in_one_line(tmp_path: Path, args: list[str], env: dict[str, str],
                                               says: str) -> None:
    cfg = probe_config(tmp_path / "cfg.json", [1])
    done = run_autotune([str(cfg), *args], cwd=tmp_path, env_extra=gpu_env(**env), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "autotuning_results" / "cluster").exists()  # refused before anything started


def test_a_worker_refuses_an_unusable_listing_with_exit_2(tmp_path: Path, redis_url: str) -> None:
    """A slot worker started by hand on a node whose GPU has MIG enabled, or for a GPU it lacks."""
    for queue, output in (("gpu0", "0, GPU-a, 16384, Enabled"), ("gpu3", None)):
        env = {**os.environ, **gpu_env(AUTOTUNE_REDIS_URL=redis_url)}
        if output is not None:
            env["FAKE_NVIDIA_SMI_OUTPUT"] = output
        proc = subprocess.Popen(worker_argv(queue, f"{queue}@fakegpu", 1),
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            stop_group(proc, grace_s=5)
        assert proc.returncode == 2, out + err
        assert ("MIG enabled" if output else "gpu3: this node offers 3 GPU(s)") in err
        assert "Traceback" not in err


def test_a_second_worker_for_the_same_gpu_is_refused(tmp_path: Path, redis_url: str) -> None:
    """Two slot workers of one machine under different node names serving one GPU
    would run two experiments on it at once; the second one to start refuses, naming the first."""
    env = {**os.environ, **gpu_env(AUTOTUNE_REDIS_URL=redis_url)}

    def worker(node: str, log: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "celery", "-A", "tasks", "worker", "-Q", "gpu0", "-n",
                                 f"gpu0@{node}", "-c", "1", "--without-gossip", "--without-mingle"],
                                cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    first = worker("fakegpu", tmp_path / "first.log")
    try:
        wait_for(lambda: "slot fakegpu.gpu0 registered" in (tmp_path / "first.log").read_text(), 60,
                 "the first worker's registration")
        second = worker("alias", tmp_path / "second.log")
        try:
            second.wait(timeout=60)
        finally:
            stop_group(second, grace_s=5)
        said = (tmp_path / "second.log").read_text()
        assert second.returncode == 2, said
        assert "is already served by slot fakegpu.gpu0 (worker gpu0@fakegpu)" in said and "Traceback" not in said
        assert first.poll() is None  # the first goes on serving it
    finally:
        stop_group(first, grace_s=10)


def test_cmd_optimal_launches_what_was_tuned(tmp_path: Path) -> None:
    """cmd_optimal.txt, run as written by DeepSpeed's real launcher (DS_ACCELERATOR=cpu, three local
    "devices"), starts the winner's ranks on the winner's devices with the tuned arguments.

    The tuning ranks' host memory is capped where the user asked by name (`--host-memory-cap 3GiB`),
    at that, whatever `--slot-memory` says."""
    cfg = probe_config(tmp_path / "cfg.json", [1])
    data = json.loads(cfg.read_text())
    data["autotuning"]["user_args"] = ["--expect-cuda-index", "1,2"]
    cfg.write_text(json.dumps(data))
    done = run_autotune([str(cfg), "--slot-memory", "1.25GiB", "--host-memory-cap", "3GiB"], cwd=tmp_path,
                        env_extra=gpu_env(CUDA_VISIBLE_DEVICES="1,2"))
    assert done.returncode == 0, done.stdout + done.stderr
    results = tmp_path / "autotuning_results"
    ranks = json.loads((results / "z0_gas1_tmbspg1" / "result.json").read_text())["ranks"]
    assert [r["memory_cap_bytes"] for r in ranks] == [3 * GiB, 3 * GiB]
    command = (results / "cmd_optimal.txt").read_text()
    assert shlex.split(command)[2:6] == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "deepspeed", "--include", "localhost:1,2"]
    final = tmp_path / "final"
    final.mkdir()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "3", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env.pop("AUTOTUNE_REDIS_URL", None)
    ran = subprocess.run(["bash", "-c", command], cwd=final, env=env, capture_output=True, text=True, timeout=300)
    config_dir = Path(shlex.split(command)[shlex.split(command).index("--deepspeed_config") + 1]).parent
    probes = sorted(config_dir.glob("probe.rank*.json"))
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    facts = [json.loads(p.read_text()) for p in probes]
    assert [(f["rank"], f["local_rank"], f["local_rank_arg"], f["cuda_visible_devices"]) for f in facts] == \
        [(0, 0, 0, "1,2"), (1, 1, 1, "1,2")]
