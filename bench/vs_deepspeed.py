"""The same script and config tuned by DeepSpeed's own autotuner and by celery-autotune, side by side.

Why: DeepSpeed's `deepspeed --autotuning tune` is what users run today; this is the proof of what
changes when they switch. Both tools get examples/train_gpt.py and one fast-mode config (ZeRO stages
and micro-batch bounds from the command line), both run experiments of 2 ranks on this machine
(DeepSpeed: `--num_gpus 2` with LOCAL_SIZE=2, no hostfile; ours: the embedded cluster with 2 slots,
`--num_gpus 2`), alternately, N times each (DS, ours, DS, ours, ...), each run in fresh folders.

Printed per run: wall time of the whole command, experiments launched (total and per stage, the
model-info profile run counted apart), failed experiments, and the config each chose. Then every
distinct chosen config is re-measured by the same longer run (steps 4..S+1, more than either tuner
measured; each rank run through `workers.in_rank.entry`, which notes when every optimizer step ends), R times
each, in round-robin order so that drift of the shared cores hits every config alike; the table gives
the median and the range of the window's mean-step throughput, and beside it DeepSpeed's engine
metric, which times the last step only. Each config is re-measured under two thread settings:
DeepSpeed's launcher as is (each rank's torch takes every core: 2 ranks oversubscribe the 2 cores,
as DeepSpeed's own tuning runs did) and the threads a slot of the embedded cluster gives a rank
(OMP_NUM_THREADS = cores // slots, as celery-autotune's tuning runs did). The two tools tuned under
different settings, and which config is fastest depends on it. One tuning measurement
covers a few steps on 2 shared cores and varies by up to 2x, so the chosen configs are compared
only by this re-measurement, never by the value the tuner itself saw.

On a machine with NVIDIA GPUs, `--gpus N` runs the same comparison on the CUDA path: experiments of N
ranks on N GPUs (DeepSpeed: `--num_gpus N`; ours: one slot per GPU), re-measured under the launcher's
threads only. `--max-mbs 0` leaves out `max_train_micro_batch_size_per_gpu`, as most users' configs
do; `--model` passes model-size flags to the script (e.g. "--d-model 768 --n-layers 12").

    .venv/bin/python bench/vs_deepspeed.py [--repeats 2] [--remeasure 3] [--stages 0 1] [--max-mbs 16]
        [--gpus N] [--model "FLAGS"]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

from workers.process.shared_memory import BUFFER_PREFIX, SHM_DIR
from workers.in_rank.step_clock import wall_clock_metrics, window_seconds

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
VENV_BIN = Path(sys.executable).parent


def base_config(stages: list[int], max_mbs: int) -> dict[str, Any]:
    """The config both tools tune (DeepSpeed's keys only; ours adds user_script/user_args);
    max_mbs 0 leaves the micro-batch unbounded, as a user's config usually does."""
    autotuning = {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 2,
                  "end_profile_step": 4, "num_tuning_micro_batch_sizes": 3}
    if max_mbs:
        autotuning["max_train_micro_batch_size_per_gpu"] = max_mbs
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.0003, "torch_adam": True}},
        "zero_optimization": {"stage": stages},
        "autotuning": autotuning,
    }


#: Ranks per experiment, and whether they run on GPUs (--gpus N) or on this machine's cores.
WORLD = {"ranks": 2, "cuda": False}


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    env.update(PATH=f"{VENV_BIN}:{env.get('PATH', '')}", TORCH_EXTENSIONS_DIR=str(ROOT / ".venv" / "torch_extensions"))
    if not WORLD["cuda"]:
        env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(WORLD["ranks"]))
    return env


def without_mlflow(work: Path) -> Path:
    """A folder whose `mlflow` cannot be imported, for the front of DeepSpeed's PYTHONPATH. DeepSpeed
    0.19's autotuner logs to MLflow whenever `import mlflow` succeeds, and then reads
    os.environ['MLFLOW_RUN_ID'] unguarded (autotuner.py `tune`): with MLflow installed (our
    `[mlflow]` extra, in the test venv) and no run id, it dies at once with a KeyError."""
    shim = work / "no_mlflow" / "mlflow"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text("raise ImportError('hidden from DeepSpeed by bench/vs_deepspeed.py')\n")
    return shim.parent


def run_deepspeed(work: Path, config: dict[str, Any], port: int, script_args: list[str]) -> dict[str, Any]:
    """One `deepspeed --autotuning tune` run; what it launched is read from its results folder."""
    results, exps = work / "results", work / "exps"
    cfg = {**config, "autotuning": {**config["autotuning"], "results_dir": str(results), "exps_dir": str(exps)}}
    (work / "ds_config.json").write_text(json.dumps(cfg))
    argv = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(WORLD["ranks"]), "--master_port", str(port),
            "--autotuning", "tune",
            str(SCRIPT), "--deepspeed_config", str(work / "ds_config.json"), *script_args]
    env = environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(without_mlflow(work)), env.get("PYTHONPATH", "")]))
    started = time.monotonic()
    since = time.time()
    proc = subprocess.run(argv, cwd=work, env=env, stdout=(work / "stdout.log").open("w"),
                          stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    remove_leaked_segments(since)
    launched = {}
    for folder in sorted(p for p in results.glob("*") if p.is_dir() and (p / "cmd.txt").exists()):
        ok = (folder / "metrics.json").exists() or (folder / "model_info.json").exists()
        launched[folder.name] = "ok" if ok else "failed"
    return {"tool": "deepspeed", "wall_s": wall, "rc": proc.returncode, "launched": launched,
            "chosen": _read(results / "ds_config_optimal.json")}


def run_ours(work: Path, config: dict[str, Any], script_args: list[str]) -> dict[str, Any]:
    """One `python -m scheduler.autotune` run on its embedded cluster (2 slots, 2-rank experiments)."""
    results = work / "results"
    cfg = {**config, "autotuning": {**config["autotuning"], "results_dir": str(results), "exps_dir": str(work / "exps"),
                                    "user_script": str(SCRIPT), "user_args": script_args}}
    (work / "cfg.json").write_text(json.dumps(cfg))
    slots = [] if WORLD["cuda"] else ["--slots", str(WORLD["ranks"])]  # on GPUs: one slot per GPU
    argv = [sys.executable, "-m", "scheduler.autotune", str(work / "cfg.json"), *slots,
            "--num_gpus", str(WORLD["ranks"])]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, env=environment(), stdout=(work / "stdout.log").open("w"),
                          stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    launched = {}
    if (results / "results.jsonl").exists():
        for line in (results / "results.jsonl").read_text().splitlines():
            record = json.loads(line)
            launched[record["name"]] = "ok" if record["status"] == "ok" else record["status"]
    return {"tool": "celery-autotune", "wall_s": wall, "rc": proc.returncode, "launched": launched,
            "chosen": _read(results / "ds_config_optimal.json")}


def remove_leaked_segments(since: float) -> None:
    """DeepSpeed's CPU all-reduce never unlinks its /dev/shm segments (workers/process/shared_memory.py): the
    ones this user's runs created since `since` go, or a long bench fills the machine's memory."""
    for path in SHM_DIR.glob(f"{BUFFER_PREFIX}_{os.getuid()}_*"):
        try:
            if path.stat().st_mtime >= since:
                path.unlink()
        except FileNotFoundError:
            pass


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def key_of(config: dict[str, Any] | None) -> str:
    if config is None:
        return "none"
    return (f"z{(config.get('zero_optimization') or {}).get('stage', 0)} mbs {config['train_micro_batch_size_per_gpu']}"
            f" gas {config.get('gradient_accumulation_steps', 1)}")


def remeasure(work: Path, config: dict[str, Any], port: int, steps: int, script_args: list[str],
              threads: int | None = None) -> tuple[float, float]:
    """The chosen config trained by DeepSpeed's launcher (WORLD's ranks), each rank run through
    `workers.in_rank.entry` so that it notes when every optimizer step ended. Returns (window, engine):
    throughput from the mean wall time of steps 4..steps+1 (what celery-autotune ranks by) and
    DeepSpeed's engine metric (which times the last step only). `threads` sets each rank's
    OMP_NUM_THREADS/MKL_NUM_THREADS (None: DeepSpeed's launcher leaves torch its default, every core)."""
    work.mkdir(parents=True, exist_ok=True)
    metric_path = work / "metrics.json"
    reports = [work / f"exit{rank}.json" for rank in range(WORLD["ranks"])]
    for path in (metric_path, *reports):
        path.unlink(missing_ok=True)
    cfg = {**config, "autotuning": {"enabled": True, "metric": "throughput", "start_profile_step": 3,
                                    "end_profile_step": steps, "metric_path": str(metric_path)}}
    (work / "ds_config.json").write_text(json.dumps(cfg))
    argv = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(WORLD["ranks"]), "--master_port", str(port),
            "--no_local_rank",
            "--module", "workers.in_rank.entry", str(SCRIPT), "--deepspeed_config", str(work / "ds_config.json"), *script_args]
    env = {**environment(), "PYTHONPATH": str(ROOT), "AUTOTUNE_EXIT_REPORT": str(work / "exit{rank}.json")}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    since = time.time()
    subprocess.run(argv, cwd=work, env=env, stdout=(work / "stdout.log").open("a"),
                   stderr=subprocess.STDOUT, check=False)
    remove_leaked_segments(since)
    metrics = _read(metric_path)
    report = _read(reports[0]) or {}
    durations = window_seconds(report.get("step_ends") or [], 3, steps)
    if not metrics or not durations:
        raise SystemExit(f"re-measuring {key_of(config)} wrote no metrics or step times; see {work / 'stdout.log'}")
    return float(wall_clock_metrics(metrics, durations)["throughput"]), float(metrics["throughput"])


def per_stage(launched: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for name in launched:
        stage = "profile" if name == "profile_model_info" else name.split("_", 1)[0]
        counts[stage] = counts.get(stage, 0) + 1
    return " ".join(f"{stage}:{n}" for stage, n in sorted(counts.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="tuning runs per tool, alternated (default 2)")
    parser.add_argument("--remeasure", type=int, default=3, help="longer runs per chosen config (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="last profiled step of a re-measurement (default 10)")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1], help="ZeRO stages to tune (default 0 1)")
    parser.add_argument("--max-mbs", type=int, default=16,
                        help="largest micro-batch size to try (default 16; 0: no bound, as users' configs have)")
    parser.add_argument("--gpus", type=int, default=0,
                        help="run on N NVIDIA GPUs, N ranks per experiment (default 0: 2 ranks on this machine's cores)")
    parser.add_argument("--model", default="", help="model-size flags for the script, e.g. \"--n-layers 12\"")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    args = parser.parse_args()
    if args.repeats < 1 or args.remeasure < 1 or args.steps < 4 or args.max_mbs < 0 or args.gpus < 0 \
            or any(s not in (0, 1, 2, 3) for s in args.stages):
        print("error: --repeats/--remeasure >= 1, --steps >= 4, --max-mbs/--gpus >= 0, stages within 0-3",
              file=sys.stderr)
        return 2
    if args.gpus:
        WORLD.update(ranks=args.gpus, cuda=True)
    if shutil.which("redis-server") is None or not (VENV_BIN / "deepspeed").exists():
        print("error: needs redis-server on PATH and DeepSpeed in this venv (bash deploy/setup.sh)", file=sys.stderr)
        return 2
    script_args = ["--steps", "50", *args.model.split()]
    config = base_config(args.stages, args.max_mbs)
    root = Path(tempfile.mkdtemp(prefix="vs_deepspeed_"))
    started = time.monotonic()
    runs = []
    for repeat in range(args.repeats):
        for tool in ("deepspeed", "celery-autotune"):
            work = root / f"{tool}_{repeat + 1}"
            work.mkdir()
            print(f"[{time.monotonic() - started:6.0f}s] tuning run {repeat + 1} with {tool} ...", flush=True)
            run = run_deepspeed(work, config, 29700 + 10 * repeat, script_args) if tool == "deepspeed" \
                else run_ours(work, config, script_args)
            runs.append({**run, "repeat": repeat + 1})

    chosen = {key_of(r["chosen"]): r["chosen"] for r in runs if r["chosen"] is not None}
    slot_threads = max(1, (os.cpu_count() or 2) // WORLD["ranks"])
    # DeepSpeed's launcher as is; as a slot ran it (on GPUs a slot leaves the threads alone)
    settings = {"default": None} if WORLD["cuda"] else {"default": None, "slot": slot_threads}
    measured = {(setting, key): [] for setting in settings for key in chosen}
    engine: dict[str, list[float]] = {key: [] for key in chosen}
    for round_ in range(args.remeasure):
        for setting, threads in settings.items():
            for index, (key, cfg) in enumerate(chosen.items()):
                print(f"[{time.monotonic() - started:6.0f}s] re-measuring {key}, {setting} threads "
                      f"({round_ + 1}/{args.remeasure}) ...", flush=True)
                window, last_step = remeasure(root / "remeasure" / f"{setting}_{key.replace(' ', '_')}", cfg,
                                              29800 + index, args.steps, script_args, threads)
                measured[setting, key].append(window)
                if threads is None:
                    engine[key].append(last_step)

    def remeasured(values: list[float] | None) -> str:
        if not values:
            return "-"
        return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"

    rows = [[r["repeat"], r["tool"], f"{r['wall_s']:.0f}", len(r["launched"]), per_stage(r["launched"]),
             sum(s != "ok" for s in r["launched"].values()), key_of(r["chosen"]),
             remeasured(measured.get(("default", key_of(r["chosen"])))),
             remeasured(measured.get(("slot", key_of(r["chosen"])))), remeasured(engine.get(key_of(r["chosen"])))]
            for r in runs]
    print()
    where = f"{args.gpus} GPU(s)" if WORLD["cuda"] else f"this {os.cpu_count()}-core machine"
    print(f"examples/train_gpt.py {' '.join(script_args)}, ZeRO stages {args.stages}, micro-batch up to "
          f"{args.max_mbs or 'no bound'}, {WORLD['ranks']}-rank experiments on {where}; tuning runs alternated")
    print(tabulate(rows, headers=["run", "tool", "wall s", "launched", "per stage", "failed", "chosen config",
                                  f"re-measured samples/s, median [range] of {args.remeasure}: default threads",
                                  f"{slot_threads} thread(s) per rank", "engine metric, default"], tablefmt="pipe"))
    print("re-measured: the window's mean step time; 'default threads': DeepSpeed's launcher as is (torch "
          f"takes every core in each rank); '{slot_threads} thread(s) per rank': OMP/MKL_NUM_THREADS as a slot of "
          "the embedded cluster sets them; engine metric: DeepSpeed's own figure (the last step only)")
    print()
    for tool in ("deepspeed", "celery-autotune"):
        mine = [r for r in runs if r["tool"] == tool]
        print(f"{tool:>16}: mean wall {statistics.mean(r['wall_s'] for r in mine):.0f} s, mean launched "
              f"{statistics.mean(len(r['launched']) for r in mine):.1f}, failed "
              f"{sum(sum(s != 'ok' for s in r['launched'].values()) for r in mine)}, chosen "
              f"{', '.join(key_of(r['chosen']) for r in mine)}")
    ds_wall = statistics.mean(r["wall_s"] for r in runs if r["tool"] == "deepspeed")
    our_wall = statistics.mean(r["wall_s"] for r in runs if r["tool"] == "celery-autotune")
    print(f"wall time ratio deepspeed / celery-autotune: {ds_wall / our_wall:.2f}x")
    print(f"total bench time {time.monotonic() - started:.0f} s; work folder {root}"
          + ("" if args.keep else " (removed)"))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["chosen"] is not None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
