"""Real traces: examples/train_gpt.py measured on this machine over the whole space both searches
choose from, so that bench/trace_replay.py can replay them on real shapes and real noise.

Why: the synthetic surfaces (bench/surfaces.py) are a model we wrote; a search tuned on them can
still lose on a real script (issue 20: a lucky ZeRO-0 reading beat a steadier config that trains
2.6x faster). A trace is what the script really did, in seconds, reading by reading.

The space is DeepSpeed's fast-mode space without max_train_batch_size for the vs_deepspeed config
(bench/vs_deepspeed.py): per ZeRO stage (default 0 1), every micro-batch m in 1..M (default 16) with
gas 1 and with gas M // m (DeepSpeed's rule: the stage's top size times the user's gas 1; nothing
runs out of memory below M on this machine, so the top is M). Each config is launched L times
(default 1) with 2 ranks by DeepSpeed's launcher, each rank through `workers.in_rank.entry` (which notes when
every optimizer step ends); a launch trains 2 warm-up steps and then W windows of 3 steps (default
6). Per window the trace keeps the step times and two readings: the window's mean step time as
throughput (what celery-autotune ranks by) and the last step alone (what DeepSpeed's engine metric
times). The windows after the first are warmer than a tuning run's only window; the launches carry
the run-to-run part of the noise. Each rank runs with OMP/MKL_NUM_THREADS = cores // 2 (--threads),
as a slot of the embedded cluster runs it (on this machine DeepSpeed's launcher otherwise lets each
rank's torch take every core, and ZeRO-0 then slows 2-3x: bench/README.md). The model-info profile run is recorded once, with the largest
resident set of any rank of each launch (host memory, as a CPU slot's cap sees it).

    .venv/bin/python bench/collect_traces.py [--script gpt|hf] [--stages 0 1] [--max-mbs 16] [--launches 1]
        [--windows 6] [--model "--n-layers 4 --seq-len 256"] [--checkpointing] [--every-gas]
        [--out bench/traces/train_gpt.json]

`--add-to TRACE --within F --launches N` tops an existing trace up instead: N more launches of each
config whose mean throughput is within F (e.g. 0.10) of the trace's best, in round-robin order, with
the trace's own script, model, windows and threads; the others keep theirs. It first launches the
trace's best config once and refuses (exit 2, nothing written) when that reads more than MAX_DRIFT
away from the trace's mean: only some configs get the new launches, so a slower or faster machine
would move exactly those (seen: a later machine read every topped-up config at 0.5x). Where it matters, a
config is then measured as often as issue 20 asks (>= 5 launches), so the trace's optimum is known
better than the 3 % a replay is judged by; far from the best a few launches already place a config.

`--checkpointing` traces every config a second time with the script's activation checkpointing
switch (its arg_mappings flag), the config listing it (`"strategy"`), so that a replay under a
memory cap (`trace_replay.py --capacity-gib`) can tell what the recompute costs and the memory it
frees buys. `--every-gas` traces every accumulation up to `--max-mbs` samples a step: under a cap
the stage's top, and DeepSpeed's rule for the step with it, is what fits there, not `--max-mbs`.

`--script hf` traces examples/train_hf.py instead (the Hugging Face Trainer: the sizes also go as its
`--per_device_train_batch_size` / `--gradient_accumulation_steps` flags, as examples/cfg_hf.json maps
them). `--model` passes model-size flags to the script: another workload, with its own shape, for a
trace the search was not developed on.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.process.shared_memory import remove_rank_segment
from workers.in_rank.step_clock import window_seconds

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Script:
    """A traced script and how one launch hands it its config, micro-batch and accumulation."""

    path: str  #: relative to the repository
    extra_args: tuple[str, ...]  #: every launch's (enough steps for the windows)
    batch_flags: bool  #: the sizes also go as the HF Trainer's flags (examples/cfg_hf.json's arg_mappings)

    checkpointing_flag: str  #: the script's switch for activation checkpointing (its arg_mappings entry)

    def argv(self, ds_config: Path, mbs: int, gas: int, model: list[str], checkpointing: bool = False) -> list[str]:
        flag = [self.checkpointing_flag] if checkpointing else []
        if self.batch_flags:
            return [str(ROOT / self.path), "--deepspeed", str(ds_config), "--per_device_train_batch_size", str(mbs),
                    "--gradient_accumulation_steps", str(gas), *self.extra_args, *model, *flag]
        return [str(ROOT / self.path), "--deepspeed_config", str(ds_config), *self.extra_args, *model, *flag]


SCRIPTS = {"gpt": Script("examples/train_gpt.py", ("--steps", "50"), batch_flags=False,
                          checkpointing_flag="--activation_checkpointing"),
           "hf": Script("examples/train_hf.py", ("--max_steps", "50"), batch_flags=True,
                         checkpointing_flag="--gradient_checkpointing")}
#: How a traced config with activation checkpointing lists it (`"strategy"`; none: an empty list).
CHECKPOINTING = "activation_checkpointing"
WARMUP_STEPS = 2
WINDOW_STEPS = 3
WORLD = 2
#: A top-up's machine may read the trace's best config this much faster or slower than the trace did.
MAX_DRIFT = 0.15


def base_config(stage: int, mbs: int, gas: int) -> dict[str, Any]:
    """The config of one traced experiment (bench/vs_deepspeed.py's keys)."""
    return {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "Adam", "params": {"lr": 0.0003, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def space(stages: list[int], max_mbs: int, checkpointing: bool = False,
          every_gas: bool = False) -> list[tuple[int, int, int, bool]]:
    """(stage, mbs, gas, checkpointed) of every config traced: each also checkpointed with
    `checkpointing`. The gas of each size is 1 and what fills max_mbs samples, or with `every_gas`
    every gas filling at most that many (the spaces of every stage top a memory cap may set)."""
    if every_gas:
        shapes = {(m, g) for m in range(1, max_mbs + 1) for g in range(1, max_mbs // m + 1)}
    else:
        shapes = {(m, 1) for m in range(1, max_mbs + 1)} | {(m, max(1, max_mbs // m)) for m in range(1, max_mbs + 1)}
    return [(stage, mbs, gas, checkpointed) for checkpointed in ((False, True) if checkpointing else (False,))
            for stage in stages for mbs, gas in sorted(shapes)]


def config_name(stage: int, mbs: int, gas: int, checkpointed: bool) -> str:
    return f"z{stage}_gas{gas}_tmbspg{mbs}" + ("_ac" if checkpointed else "")


_MEASURE = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def launch(work: Path, ds_config: dict[str, Any], port: int, threads: int,
           script_argv: list[str]) -> tuple[int, dict[str, Any], int]:
    """One 2-rank launch of `script_argv` (`Script.argv`), `threads` OMP/MKL threads per rank: (exit
    status, rank 0's exit report, largest resident set in bytes)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds_config.json").write_text(json.dumps(ds_config))
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_REDIS_URL"}
    env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(WORLD), PATH=f"{VENV_BIN}:{env.get('PATH', '')}",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".venv" / "torch_extensions"), PYTHONPATH=str(ROOT),
               AUTOTUNE_EXIT_REPORT=str(work / "exit{rank}.json"), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    argv = [sys.executable, "-c", _MEASURE, str(VENV_BIN / "deepspeed"), "--num_gpus", str(WORLD), "--master_port",
            str(port), "--no_local_rank", "--module", "workers.in_rank.entry", *script_argv]
    proc = subprocess.run(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=(work / "stderr.log").open("w"),
                          text=True, check=False)
    for rank in range(WORLD):  # DeepSpeed's CPU all-reduce never unlinks them (workers/process/shared_memory.py)
        remove_rank_segment("127.0.0.1", port, rank)
    report_path = work / "exit0.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    lines = proc.stdout.strip().splitlines()
    max_rss = int(lines[-1]) * 1024 if lines and lines[-1].isdigit() else 0
    return proc.returncode, report, max_rss


def trace_config(work: Path, stage: int, mbs: int, gas: int, windows: int, port: int, threads: int,
                 script: Script, model: list[str], checkpointing: bool = False) -> dict[str, Any]:
    """One launch of one config (`checkpointing`: with the script's switch): its windows' step times
    and readings."""
    end = WARMUP_STEPS + WINDOW_STEPS * windows - 1
    config = base_config(stage, mbs, gas)
    config["autotuning"] = {"enabled": True, "metric": "throughput", "start_profile_step": WARMUP_STEPS,
                            "end_profile_step": end, "metric_path": str(work / "metrics.json")}
    rc, report, max_rss = launch(work, config, port, threads,
                                 script.argv(work / "ds_config.json", mbs, gas, model, checkpointing))
    steps = window_seconds(report.get("step_ends") or [], WARMUP_STEPS, end)
    samples = mbs * gas * WORLD
    if rc != 0 or len(steps) != WINDOW_STEPS * windows:
        return {"status": "failed", "exit_code": rc, "peak_rss_bytes": max_rss, "stderr_tail": _tail(work)}
    readings = []
    for w in range(windows):
        window = steps[w * WINDOW_STEPS:(w + 1) * WINDOW_STEPS]
        readings.append({"step_seconds": [round(s, 4) for s in window],
                         "throughput": samples * len(window) / sum(window),
                         "engine_throughput": samples / window[-1]})
    return {"status": "ok", "peak_rss_bytes": max_rss, "readings": readings}


def profile(work: Path, port: int, threads: int, script: Script, model: list[str]) -> dict[str, Any]:
    """The model-info profile run celery-autotune and DeepSpeed both start with (z0, mbs 1)."""
    config = base_config(0, 1, 1)
    config["autotuning"] = {"enabled": True, "model_info": {"profile": True},
                            "model_info_path": str(work / "model_info.json")}
    rc, _, max_rss = launch(work, config, port, threads, script.argv(work / "ds_config.json", 1, 1, model))
    info_path = work / "model_info.json"
    if not info_path.exists():
        raise SystemExit(f"the profile run wrote no model info (exit {rc}): {_tail(work)}")
    return {"model_info": json.loads(info_path.read_text()), "peak_rss_bytes": max_rss}


def _tail(work: Path) -> str:
    path = work / "stderr.log"
    return path.read_text()[-400:] if path.exists() else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-mbs", type=int, default=16)
    parser.add_argument("--launches", type=int, default=1, help="launches per config (default 1)")
    parser.add_argument("--windows", type=int, default=6, help="3-step windows per launch (default 6)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // WORLD),
                        help="OMP/MKL threads per rank (default: cores // 2, as a slot of the embedded cluster)")
    parser.add_argument("--script", choices=sorted(SCRIPTS), default="gpt",
                        help="examples/train_gpt.py (default) or examples/train_hf.py (the HF Trainer)")
    parser.add_argument("--model", default="", help="model-size flags for the script, e.g. \"--n-layers 4\"")
    parser.add_argument("--out", type=Path, help="default bench/traces/train_<script>.json")
    parser.add_argument("--checkpointing", action="store_true",
                        help="every config also with the script's activation checkpointing switch")
    parser.add_argument("--every-gas", action="store_true",
                        help="every gas with at most --max-mbs samples per step (a replay under a memory cap)")
    parser.add_argument("--add-to", type=Path, metavar="TRACE", help="top up this trace (module docstring)")
    parser.add_argument("--within", type=float, default=0.10, help="with --add-to: configs within this of the best")
    args = parser.parse_args()
    if args.add_to:
        return top_up(args.add_to, args.within, args.launches)
    script, model = SCRIPTS[args.script], args.model.split()  # every launch of this trace trains this model
    out: Path = args.out or ROOT / "bench" / "traces" / f"train_{args.script}.json"
    if args.launches < 1 or args.windows < 1 or args.max_mbs < 1 or args.threads < 1 or any(s not in (0, 1, 2, 3) for s in args.stages):
        print("error: --launches/--windows/--max-mbs/--threads >= 1, stages within 0-3", file=sys.stderr)
        return 2
    if not (VENV_BIN / "deepspeed").exists():
        print("error: needs DeepSpeed in this venv (bash deploy/setup.sh)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="traces_"))
    started = time.monotonic()
    trace: dict[str, Any] = {
        "script": script.path, "script_args": [*script.extra_args, *model], "world": WORLD, "max_mbs": args.max_mbs,
        "stages": args.stages, "strategies": [CHECKPOINTING] if args.checkpointing else [], "threads_per_rank": args.threads, "warmup_steps": WARMUP_STEPS, "window_steps": WINDOW_STEPS,
        "machine": f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 30} GiB",
        "collected": time.strftime("%Y-%m-%d"), "profile": profile(root / "profile", 29900, args.threads, script, model), "configs": []}
    configs = space(args.stages, args.max_mbs, args.checkpointing, args.every_gas)
    for launch_no in range(args.launches):  # round-robin: drift of the machine hits every config alike
        for index, (stage, mbs, gas, checkpointed) in enumerate(configs):
            name = config_name(stage, mbs, gas, checkpointed)
            print(f"[{time.monotonic() - started:6.0f}s] {name} launch {launch_no + 1}/{args.launches}", flush=True)
            result = trace_config(root / f"{name}_{launch_no}", stage, mbs, gas, args.windows, 29901 + index % 50,
                                  args.threads, script, model, checkpointed)
            if launch_no == 0:
                trace["configs"].append({"stage": stage, "mbs": mbs, "gas": gas,
                                         "strategy": [CHECKPOINTING] if checkpointed else [], "launches": []})
            trace["configs"][index]["launches"].append(result)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(trace, indent=1) + "\n")  # every launch kept if stopped
    print(f"{len(configs)} configs x {args.launches} launches in {time.monotonic() - started:.0f} s -> {out}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def mean_throughput(config: dict[str, Any]) -> float | None:
    """A traced config's mean window throughput over every launch that ran (None: none did)."""
    values = [r["throughput"] for launch in config["launches"] if launch["status"] == "ok" for r in launch["readings"]]
    return sum(values) / len(values) if values else None


def top_up(path: Path, within: float, launches: int) -> int:
    """`--add-to`: more launches of the configs within `within` of the trace's best (module docstring)."""
    if not path.is_file() or launches < 1 or not 0 < within < 1:
        print(f"error: --add-to {path}: needs an existing trace, --launches >= 1 and 0 < --within < 1", file=sys.stderr)
        return 2
    trace = json.loads(path.read_text())
    script = next(s for s in SCRIPTS.values() if s.path == trace["script"])
    model = trace["script_args"][len(script.extra_args):]
    windows = len(next(l["readings"] for c in trace["configs"] for l in c["launches"] if l["status"] == "ok"))
    means = {index: mean_throughput(config) for index, config in enumerate(trace["configs"])}
    best = max(m for m in means.values() if m is not None)
    chosen = [index for index, m in means.items() if m is not None and m >= (1 - within) * best]
    root = Path(tempfile.mkdtemp(prefix="traces_"))
    started = time.monotonic()
    top = max(chosen, key=lambda index: means[index])
    config = trace["configs"][top]
    check = trace_config(root / "speed_check", config["stage"], config["mbs"], config["gas"], windows, 29900,
                         trace["threads_per_rank"], script, model, CHECKPOINTING in config.get("strategy", []))
    ratio = mean_throughput({"launches": [check]}) or 0.0
    ratio /= means[top]
    if not 1 - MAX_DRIFT <= ratio <= 1 + MAX_DRIFT:
        shutil.rmtree(root, ignore_errors=True)
        print(f"error: --add-to {path}: this machine trains the trace's best config at {ratio:.2f}x the trace's "
              f"speed (more than {MAX_DRIFT:.0%} off): launches from a machine this different would bias the configs "
              "topped up against the others; top up where the trace was collected, or collect it anew", file=sys.stderr)
        return 2
    print(f"[{time.monotonic() - started:6.0f}s] speed check: the trace's best config at {ratio:.2f}x its recorded speed")
    for launch_no in range(launches):
        for index in chosen:
            config = trace["configs"][index]
            checkpointed = CHECKPOINTING in config.get("strategy", [])
            name = config_name(config["stage"], config["mbs"], config["gas"], checkpointed)
            print(f"[{time.monotonic() - started:6.0f}s] {name} extra launch {launch_no + 1}/{launches}", flush=True)
            config["launches"].append(trace_config(root / f"{name}_{launch_no}", config["stage"], config["mbs"],
                                                   config["gas"], windows, 29901 + index % 50,
                                                   trace["threads_per_rank"], script, model, checkpointed))
            path.write_text(json.dumps(trace, indent=1) + "\n")
    trace.setdefault("top_ups", []).append({"within": within, "launches": launches, "configs": len(chosen),
                                            "collected": time.strftime("%Y-%m-%d")})
    path.write_text(json.dumps(trace, indent=1) + "\n")
    print(f"{len(chosen)} configs x {launches} more launches in {time.monotonic() - started:.0f} s -> {path}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
