"""The same experiment started cold and warm, alternated: does a warm start change what is measured?

One rank of examples/train_gpt.py (the README example's script) with one config (ZeRO 1,
micro-batch 2 by default, start/end_profile_step 1/1 as examples/cfg.json sets them), launched the
way a slot launches it (`workers.process.launch.run_watched`, through `workers.warm.warm_start` with the switch
on or off), `--pairs` times each, cold and warm alternated (the order swapped every pair, so a
trend in the machine's load falls on both). Per path it prints the mean and spread of the
measured step latency (the profiled window, `workers.in_rank.step_clock`), of the seconds from launch to
engine ready and of the wall; and whether the latency means differ by more than the noise
(twice the standard error of their difference).

    .venv/bin/python bench/warm_vs_cold.py --pairs 5
    .venv/bin/python bench/warm_vs_cold.py --pairs 5 --stage 0 --micro-batch 8
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.slot.build_locks import default_extensions_dir  # noqa: E402
from workers.in_rank.device_memory import EXIT_REPORT_ENV, read_exit_report  # noqa: E402
from workers.process.launch import run_watched  # noqa: E402
from workers.state.rendezvous import free_port  # noqa: E402
from workers.in_rank.step_clock import window_seconds  # noqa: E402
from workers.slot.timeline import rank_timeline  # noqa: E402
from workers.warm.warm_plan import SWITCH_ENV  # noqa: E402
from workers.warm.rank_start import Start  # noqa: E402
from workers.warm.warm_start import WARM  # noqa: E402


def one_launch(folder: Path, config: dict, warm: bool) -> dict[str, float | str]:
    (folder / "metrics.json").unlink(missing_ok=True)
    config = json.loads(json.dumps(config))
    config["autotuning"]["metric_path"] = str(folder / "metrics.json")
    (folder / "ds_config.json").write_text(json.dumps(config))
    report = folder / "exit.json"
    report.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("AUTOTUNE_")}
    env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
                "AUTOTUNE_SLOT": "bench.gpu0", "TORCH_EXTENSIONS_DIR": default_extensions_dir(),
                "PYTHONPATH": str(ROOT), EXIT_REPORT_ENV: str(report), **({} if warm else {SWITCH_ENV: "0"})})
    script_argv = [str(ROOT / "examples" / "train_gpt.py"), "--local_rank=0", "--deepspeed_config",
                   str(folder / "ds_config.json")]
    command = [sys.executable, "-m", "workers.in_rank.entry", *script_argv]
    start = Start()
    result = run_watched(command, env=env, cwd=str(ROOT / "examples"), stdout_path=folder / "out.log",
                         stderr_path=folder / "err.log", timeout_s=600, memory_cap_bytes=None,
                         spawn=WARM.spawn_for(script_argv, env, "cpu", (), start))
    exit_report = read_exit_report(report)
    WARM.learn(script_argv, exit_report.get("imported"))  # as a slot does after every rank (workers.slot.rank)
    steps = window_seconds(exit_report.get("step_ends", []), 1, 1)
    if result.exit_code != 0 or not steps or start.path != ("warm" if warm else "cold"):
        sys.exit(f"error: a {'warm' if warm else 'cold'} launch failed ({result.exit_code}, {start}): "
                 f"{(folder / 'err.log').read_text()[-2000:]}")
    timeline = rank_timeline(result.started_at, result.ended_at, exit_report.get("moments", {}),
                             exit_report.get("step_ends", []), 1, 1)
    return {"path": start.path, "latency_s": statistics.mean(steps), "startup_s": timeline.get("engine", math.nan),
            "wall_s": result.wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    config = json.loads((ROOT / "examples" / "cfg.json").read_text())
    config.update(train_micro_batch_size_per_gpu=args.micro_batch, zero_optimization={"stage": args.stage})
    config["autotuning"] = {"enabled": True, "metric": "throughput", "start_profile_step": 1, "end_profile_step": 1}
    readings: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="warm_vs_cold.") as scratch:
        for _ in range(2):  # start the warm process, then again with what the first rank imported: not readings
            one_launch(Path(scratch), config, warm=True)
        for pair in range(args.pairs):
            for warm in ((False, True) if pair % 2 == 0 else (True, False)):
                reading = one_launch(Path(scratch), config, warm)
                readings[reading["path"]].append(reading)
                print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in reading.items()}),
                      flush=True)
    for path, rows in readings.items():
        figures = {key: (statistics.mean(r[key] for r in rows), statistics.stdev(r[key] for r in rows))
                   for key in ("latency_s", "startup_s", "wall_s")}
        print(f"{path}: " + ", ".join(f"{key} {mean:.3f} ± {sd:.3f}" for key, (mean, sd) in figures.items()))
    cold = [r["latency_s"] for r in readings["cold"]]
    warm = [r["latency_s"] for r in readings["warm"]]
    difference = statistics.mean(warm) - statistics.mean(cold)
    noise = 2 * math.sqrt(statistics.variance(cold) / len(cold) + statistics.variance(warm) / len(warm))
    print(f"latency warm - cold: {difference:+.3f} s; noise (2 standard errors): {noise:.3f} s; "
          f"{'within' if abs(difference) <= noise else 'OUTSIDE'} the noise")


if __name__ == "__main__":
    main()
