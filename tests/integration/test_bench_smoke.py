"""Every bench/ script run as bench/README.md runs it, at a smoke size: it must still print its figures.

Why: a bench that stops working says so only when someone next needs its numbers, and a move of
modules breaks the hooks benches use silently: a timing hook that replaces a name the code no
longer calls lets a bench print its first figures and then end in a traceback (so bench/scale.py
passes its timed policies through `scheduler.cluster.dispatch.dispatch`'s own seam).
So each script runs here with tiny inputs (seconds) and its key figure lines are matched.

The benches that need minutes of real DeepSpeed training, a GPU or mutmut (vs_deepspeed.py,
collect_traces.py, chaos.py, strike_warm.py, oom_probes.py on a run's results, gpu_smoke.sh,
mutation.sh, mutation_scores.py) cannot run at a smoke size; for them the test checks that they
still import and refuse a bad flag with one `error:` line, exit 2, which a broken import or argument
parser fails.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from integration_helpers import ROOT

pytestmark = pytest.mark.integration

SMOKE = [
    (["bench/search_quality.py", "--surfaces", "2", "--family", "cliff"],
     [r"cliff\s+ours\s+\d\.\d{3}", r"cliff\s+DeepSpeed\s+\d\.\d{3}", r"pooled launches ours / DeepSpeed .*: \d"]),
    (["bench/search_quality.py", "--surfaces", "1", "--family", "monotone", "--classic", "--buckets"],
     [r"monotone\s+ours\s+\d\.\d{3}"]),
    (["bench/trace_replay.py", "bench/traces/train_hf.json", "--replays", "2"],
     [r"celery-autotune: right \(within 3 % of the best's mean or inside its 95 % interval\) in \d",
      r"deepspeed: right \(within 3 % of the best's mean or inside its 95 % interval\) in \d"]),
    (["bench/scale.py", "--nodes", "2", "--gpus", "2", "--per-job", "8", "--passes", "3"],
     [r"queueing 32 experiments .*: \d", r"dispatch pass after a node's 8 slots free: p50 \d",
      r"placement decision .*: p50 \d+\.\d\d ms", r"Redis memory: \d+ B per registered slot"]),
    (["bench/backfill.py", "--experiments", "8", "--seeds", "2"],
     [r"EASY backfill \(ours\)", r"backfill / FIFO", r"over 2 seeds \(backfill / FIFO\)"]),
    (["bench/dispatch_overhead.py", "--experiments", "4", "--slots", "1", "--round-trips", "3"],
     [r"4 trivial experiments on 1 slots in \d", r"median gap / median bare round trip: \d"]),
    (["bench/lua_mutants.py", "--list"], [r"\S+\s+workers/state/gang\.py\s+\S"]),
]

HEAVY = [
    ["bench/vs_deepspeed.py", "--repeats", "0"],
    ["bench/collect_traces.py", "--launches", "0"],
    ["bench/chaos.py", "--seconds", "-1"],
    ["bench/strike_warm.py", "examples/cfg.json", "--after", "-1"],
    ["bench/oom_probes.py", str(ROOT / "no_such_results_folder"), "--config", "examples/cfg.json"],
]


@pytest.mark.parametrize("argv, figures", SMOKE, ids=[" ".join(argv) for argv, _ in SMOKE])
def test_the_bench_prints_its_figures(argv: list[str], figures: list[str]) -> None:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for figure in figures:
        assert re.search(figure, done.stdout), f"{figure!r} not in:\n{done.stdout[-3000:]}"


@pytest.mark.parametrize("argv", HEAVY, ids=[" ".join(argv) for argv in HEAVY])
def test_a_long_bench_still_starts_and_refuses_bad_input_in_one_line(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), done.stderr[-3000:]


def test_gpu_smoke_parses_and_refuses_a_machine_or_rank_count_it_cannot_check(tmp_path) -> None:
    """bench/gpu_smoke.sh runs only on a GPU machine; here: its bash parses, it refuses a machine
    without nvidia-smi and a GPU_SMOKE_RANKS the (fake) node's GPUs cannot hold, each in one line."""
    script = str(ROOT / "bench" / "gpu_smoke.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    no_gpu = {"PATH": "/usr/bin:/bin"}
    fake_gpus = {"PATH": f"{ROOT / 'tests' / 'fake_gpu'}:/usr/bin:/bin", "GPU_SMOKE_RANKS": "4"}  # three fake GPUs
    for env, says in ((no_gpu, "no nvidia-smi"), (fake_gpus, "GPU_SMOKE_RANKS=4: give a whole number from 1 to 3")):
        done = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr


def test_gpu_offline_refuses_a_step_it_cannot_take_in_one_line(tmp_path) -> None:
    """bench/gpu_offline.sh carries our packages to a GPU machine without PyPI; its `install` runs
    only there. Here: its bash parses, and an unknown step, and `install` with nothing bundled,
    are refused in one line (exit 2) before anything is made."""
    script = ROOT / "bench" / "gpu_offline.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    (tmp_path / "bench").mkdir()
    copy = tmp_path / "bench" / "gpu_offline.sh"
    copy.write_text(script.read_text())
    for step, says in (([], "usage: bash bench/gpu_offline.sh bundle|install"),
                       (["install"], "no .gpu/whl; run 'bash bench/gpu_offline.sh bundle' first")):
        done = subprocess.run(["bash", str(copy), *step], capture_output=True, text=True, timeout=60)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench"]  # no .venv, no .gpu
