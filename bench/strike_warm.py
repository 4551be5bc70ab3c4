"""A real tuning job whose warm process is killed under a running rank: the launch must be recorded
lost and run again, never counted as the config's crash.

    .venv/bin/python bench/strike_warm.py examples/cfg.json --num_gpus 1 [--after 1.0] [--work DIR]

It narrows the config to a short list job (micro-batch [2, 8], ZeRO stage [1]), runs
`python -m scheduler.autotune` on it (an embedded cluster, the real script, real DeepSpeed), and
while it runs watches the process table for a rank forked from a warm process: a process titled as
a rank (`workers.process.process_identity.titled_ranks`), leading its own group, whose parent shows
the warm process's line (`bench.chaos_strikes.read_warm`, the soak's `kill_warm` match). Once such
a rank of an experiment (not the profile run) has run `--after` seconds, it SIGKILLs that warm
process, once, and writes what it struck to `struck.json`. When the job has ended it checks:

1. something was struck;
2. the struck experiment's record (`result.json`) is `ok` or `oom`: never `crashed`, nor `lost`;
3. it was launched again: the struck launch left its own files (`ds_config.<launch>.json`), whose
   stderr says the launch was recorded lost (`workers.warm.rank_start.recorded_lost`), and another
   launch's are the counted ones (the plain `stderr.log` is not the struck launch's,
   `workers.process.launch_files`);
4. the command exited 0.

Why `--after` 1 s by default: a rank must have said it is ready (0.15 s after the fork) for the
strike to hit a running rank rather than a start the warm path refuses, and a rank of this job
runs only 1.5-8 s on CPU (0.4-5.5 s to the engine, then two steps and its exit: a wait of "a couple
of seconds" misses most of them) and about 2 s on an H200 (1.1 s to the engine). bench/gpu_smoke.sh's `warm_kill` extra
runs this script on GPUs; its exit status is the command's when that failed, else 1 when a check
failed, else 0.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (workers, scheduler)
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench.chaos_checks import Seen  # noqa: E402
from bench.chaos_strikes import Struck, read_warm  # noqa: E402
from scheduler.errors import OneLineArgumentParser, UsageError, one_line  # noqa: E402
from scheduler.search.space import PROFILE  # noqa: E402
from workers.files.layout import launch_file, rank_log  # noqa: E402
from workers.process.process_identity import titled_ranks  # noqa: E402

POLL_S = 0.1  #: how often the process table is read while the job runs
LOST_NOTE = "the launch is recorded lost"  #: what a lost warm rank's stderr ends with (rank_start)
STRUCK = "struck.json"


def narrowed(config: dict[str, Any], config_dir: Path) -> dict[str, Any]:
    """`config` as the short list job struck here: micro-batch [2, 8], ZeRO stage [1] (the rest of
    its ZeRO section kept), its script's path made absolute against the config's folder."""
    found = json.loads(json.dumps(config))
    found["train_micro_batch_size_per_gpu"] = [2, 8]
    found["zero_optimization"] = {**found.get("zero_optimization", {}), "stage": [1]}
    tuning = found.setdefault("autotuning", {})
    tuning["user_script"] = str((config_dir / tuning.get("user_script", "train.py")).resolve())
    return found


def ripe(found: Iterable[Struck], ages: Mapping[int, float], min_age_s: float) -> Struck | None:
    """The warm process to strike: the parent of the oldest warm-forked rank of an experiment (not
    the profile run) that has run `min_age_s` (`ages`: rank pid -> seconds it has run); None yet."""
    ready = [target for target in found if ages.get(target.rank_pid, 0.0) >= min_age_s
             and target.seen.experiment.rsplit("/", 1)[-1] != PROFILE]
    return max(ready, key=lambda target: ages[target.rank_pid], default=None)


def live_ranks() -> tuple[dict[int, Seen], dict[int, float]]:
    """The running ranks (each leads its own group: not what a rank forked) as `Seen`, and how long
    each has run, in seconds."""
    live, ages, now = {}, {}, time.time()
    for pid, identity in titled_ranks().items():
        try:
            proc = psutil.Process(pid)
            if os.getpgid(pid) != pid or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            ages[pid] = now - proc.create_time()
        except (ProcessLookupError, psutil.Error):
            continue
        live[pid] = Seen(identity.slot, identity.launch, f"{identity.job}/{identity.experiment}", str(identity.rank))
    return live, ages


def watch(min_age_s: float, done: Callable[[], bool]) -> dict[str, Any] | None:
    """Strike once (SIGKILL) the warm process of the first rank `ripe` names while `done()` is
    false; what was struck, or None when the job ended first."""
    while not done():
        live, ages = live_ranks()
        target = ripe(read_warm(live), ages, min_age_s)
        if target is not None:
            try:
                os.kill(target.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it ended meanwhile: look again
            job, _, experiment = target.seen.experiment.partition("/")
            return {"experiment": experiment, "job": job, "slot": target.seen.slot, "launch": target.seen.launch,
                    "rank": target.seen.rank, "rank_pid": target.rank_pid, "rank_age_s": round(ages[target.rank_pid], 2),
                    "warm_pid": target.pid, "warm_shown": " ".join(target.shown.split()), "struck_at": time.time()}
        time.sleep(POLL_S)
    return None


def problems(results: Path, struck: Mapping[str, Any] | None, code: int) -> list[str]:
    """What the job's results say against a lost, relaunched launch (the module docstring's checks)."""
    if code != 0:
        return [f"the command exited {code}"]
    if not struck:
        return ["nothing struck: no warm-forked rank of an experiment ran long enough (see --after)"]
    folder = results / struck["experiment"]
    try:
        record = json.loads((folder / "result.json").read_text())
    except (OSError, ValueError):
        return [f"{struck['experiment']}: no readable result.json"]
    found = []
    if record.get("status") not in ("ok", "oom"):
        found.append(f"{struck['experiment']}: recorded {record.get('status')} ({record.get('cause')}), "
                     "not ok or oom after a lost launch")
    launch = struck["launch"]
    launches = sorted(path.name for path in folder.glob("ds_config.*.json"))
    if launch_file("ds_config.json", launch) not in launches or len(launches) < 2:
        found.append(f"{struck['experiment']}: launches {launches}: the struck one ({launch}) and another expected")
    stderr = folder / rank_log(int(struck["rank"]), "stderr", launch)
    if LOST_NOTE not in (stderr.read_text(errors="replace") if stderr.is_file() else ""):
        found.append(f"{stderr.name}: does not say {LOST_NOTE!r}")
    plain = folder / rank_log(int(struck["rank"]), "stderr")
    if stderr.is_file() and plain.is_file() and os.path.samefile(stderr, plain):
        found.append(f"{struck['experiment']}: the counted launch is the struck one ({launch})")
    return found


def run_job(config: Path, num_gpus: int, work: Path, min_age_s: float, timeout_s: float
            ) -> tuple[int, dict[str, Any] | None]:
    """Run the autotuner on `config` in `work` (tune.log, tune.err), striking as `watch` does; its
    exit status (124 past `timeout_s`) and what was struck."""
    with open(work / "tune.log", "wb") as out, open(work / "tune.err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler.autotune", str(config), "--num_gpus", str(num_gpus)],
                                cwd=work, stdout=out, stderr=err, start_new_session=True)
    struck: list[dict[str, Any] | None] = [None]
    watcher = threading.Thread(target=lambda: struck.__setitem__(0, watch(min_age_s, lambda: proc.poll() is not None)),
                               daemon=True, name="warm striker")
    watcher.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = 124
    finally:
        if proc.poll() is None:  # its own SIGTERM handler stops the embedded cluster it started
            proc.terminate()
            proc.wait()
    watcher.join()
    return code, struck[0]


def parse_args(argv: list[str]) -> Any:
    """The flags, checked: a bad one is a UsageError (one `error:` line, exit status 2)."""
    parser = OneLineArgumentParser(prog="bench/strike_warm.py", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="the DeepSpeed config to narrow (examples/cfg.json)")
    parser.add_argument("--num_gpus", type=int, default=1, help="ranks per experiment (default 1)")
    parser.add_argument("--after", type=float, default=1.0, help="seconds a rank runs before the strike (default 1)")
    parser.add_argument("--work", type=Path, default=None, help="where the job runs (default a fresh temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the job may take (default 1800)")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        raise UsageError(f"{args.config}: no such config")
    if args.num_gpus < 1 or args.after < 0 or args.timeout <= 0:
        raise UsageError("--num_gpus must be 1 or more, --after 0 or more, --timeout above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="strike_warm-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "strike_warm.json"
    config.write_text(json.dumps(narrowed(json.loads(args.config.read_text()), args.config.resolve().parent)))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the job stopped on the way out
    code, struck = run_job(config, args.num_gpus, work, args.after, args.timeout)
    (work / STRUCK).write_text(json.dumps(struck, indent=1))
    found = problems(work / "autotuning_results", struck, code)
    if struck:
        folder = work / "autotuning_results" / struck["experiment"]
        record = json.loads((folder / "result.json").read_text()) if (folder / "result.json").is_file() else {}
        print(f"strike_warm: killed warm process {struck['warm_pid']} under rank {struck['rank']} of "
              f"{struck['experiment']} (pid {struck['rank_pid']}, launch {struck['launch']}, "
              f"{struck['rank_age_s']} s in); its launches: "
              f"{', '.join(sorted(p.name for p in folder.glob('ds_config.*.json')))}; recorded {record.get('status')}")
    for line in found:
        print(f"strike_warm: FAILED: {line}")
    print(f"strike_warm: {'failed' if found else 'passed'}, command exit {code} (folder {work})")
    return code if code else (1 if found else 0)


if __name__ == "__main__":
    sys.exit(main())
