"""`celery-autotune`: DeepSpeed's launcher command line, tuned and launched on Celery slots.

Why: a DeepSpeed user starts autotuning as DeepSpeed's docs teach it,
`deepspeed --autotuning tune [launcher flags] train.py --deepspeed_config ds_config.json`. This
command (pyproject's [project.scripts]) takes that line with `deepspeed` replaced, and our own
options beside DeepSpeed's:

- `--autotuning tune|run`: tune (with `run`, then train with the optimum) as `python -m
  scheduler.autotune` does, the config being the one the script's own `--deepspeed_config X` /
  `--deepspeed X.json` argument names, found as DeepSpeed's autotuner finds it
  (`scheduler.inputs.arguments.config_argument`). `--hostfile`/`--include`/`--exclude` bound the
  slots experiments may reserve and `--num_nodes`/`--num_gpus` size each experiment, as in
  DeepSpeed's autotuner (`scheduler.launch.pool`).
- without `--autotuning`: launch the script like `deepspeed` (`python -m scheduler.run`, the same flags).
- `--status`: the cluster at AUTOTUNE_REDIS_URL (as `python -m scheduler.autotune --status`).

The flags are read by one parser that knows both commands' flags, so a flag's value is never
taken for the script; then the line goes to the command that does the work, which checks it.
With `--autotuning`, DeepSpeed's launch flags that tuning on slots does not use (`--master_port`,
`--master_addr`, `--launcher`, `--launcher_args`, `--no_ssh_check`) are accepted with a note: the
experiments' ranks run on the slot workers and meet at a free port of their first node.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from scheduler import autotune
from scheduler import run as launch_run
from scheduler.errors import OneLineArgumentParser, UsageError, one_line
from scheduler.inputs.arguments import config_argument
from scheduler.launch.launchers import LAUNCHERS

#: DeepSpeed launch flags a tuning accepts and does not use (module docstring).
UNUSED_WHEN_TUNING = ("master_port", "master_addr", "launcher", "launcher_args", "no_ssh_check")
#: `python -m scheduler.run` flags that mean nothing for a tuning.
LAUNCH_ONLY = ("timeout", "log_dir", "elastic_training", "min_elastic_nodes", "max_elastic_nodes", "dry_run")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of both commands (`scheduler.autotune`'s options, `scheduler.run`'s launcher flags)."""
    parser = OneLineArgumentParser(
        prog="celery-autotune", allow_abbrev=False,
        description="DeepSpeed's launcher on Celery slots: --autotuning tune|run tunes the script's "
        "--deepspeed_config; without it the script is launched like `deepspeed`.")
    add = parser.add_argument
    add("--autotuning", choices=("tune", "run"), help="tune the config the script's --deepspeed_config "
        "(or --deepspeed X.json) names; run: then train with the optimum (DeepSpeed's --autotuning)")
    autotune.add_tuning_options(parser)
    add("--launcher", type=str.lower, choices=("celery", *LAUNCHERS), help="launching: celery (default) or "
        "DeepSpeed's backends (python -m scheduler.run)")
    add("--launcher_args", default="", help="launching: extra arguments for pdsh/mpirun/srun")
    add("--master_addr", default="", help="launching, non-celery launchers")
    add("--master_port", type=int, help="launching, non-celery launchers")
    add("--no_ssh_check", action="store_true", help="launching: skip the passwordless ssh check")
    add("--timeout", type=float, help="launching: seconds (default: a week)")
    add("--log_dir", help="launching: where ranks log")
    add("--elastic_training", action="store_true", help="launching: torchrun with --min/--max_elastic_nodes")
    add("--min_elastic_nodes", type=int)
    add("--max_elastic_nodes", type=int)
    add("--dry_run", action="store_true", help="launching: print the command as JSON and run nothing")
    add("user_script", nargs="?", help="the training script")
    add("user_args", nargs=argparse.REMAINDER, help="its arguments, passed unchanged")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if args.autotuning is None and not args.status:
        return launch_run.main(argv)
    return autotune.guarded(lambda: tune(args))


def tune(args: argparse.Namespace) -> int:
    """`--autotuning tune|run` (or `--status`): the tuning command on the script's own config."""
    if args.status:
        return autotune.show_status()
    given = [f"--{name}" for name in LAUNCH_ONLY if getattr(args, name) not in (None, False)]
    if given:
        raise UsageError(f"{', '.join(given)}: only for launching (without --autotuning); drop it")
    if args.user_script is None:
        raise UsageError("--autotuning needs the training script and its arguments: celery-autotune "
                         "--autotuning tune train.py --deepspeed_config ds_config.json")
    config = config_argument(args.user_args)
    if config is None:
        raise UsageError(f"{args.user_script}'s arguments name no DeepSpeed config: pass --deepspeed_config "
                         "ds_config.json (or --deepspeed ds_config.json) with an \"autotuning\" section, as "
                         "for `deepspeed --autotuning`")
    unused = [f"--{name}" for name in UNUSED_WHEN_TUNING if getattr(args, name) not in (None, False, "")]
    if unused:
        print(f"note: {', '.join(unused)} not used: the experiments run on the slot workers, their ranks "
              "meet at a free port of their first node", file=sys.stderr)
    args.config = config
    args.run = args.run or args.autotuning == "run"
    if not Path(args.user_script).is_file():
        raise UsageError(f"training script {args.user_script} not found; check the path")
    return autotune.run(args, [args.user_script, *args.user_args])


if __name__ == "__main__":
    sys.exit(main())
