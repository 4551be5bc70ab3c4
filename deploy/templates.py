"""Render the deployment templates in deploy/templates/: systemd units and a Slurm batch script.

Why templates: on clusters where workers are not started over SSH (`python -m deploy up`), they are
started by the init system or the batch scheduler. The units and the script carry the paths of this
installation and nothing secret: the Redis URL stays in a 0600 EnvironmentFile (systemd) or is
generated per job (Slurm).

    python -m deploy.templates slot|control|slurm [--repo R] [--python P] [--user U] [--env-file F] ...
"""
from __future__ import annotations

import argparse
import getpass
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from scheduler.errors import OneLineArgumentParser, UsageError

FOLDER = Path(__file__).resolve().parent / "templates"
REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {"slot": "celery-autotune-slot@.service", "control": "celery-autotune-control.service",
             "slurm": "autotune.sbatch"}
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def defaults() -> dict[str, str]:
    return {"repo": str(REPO), "python": str(REPO / ".venv" / "bin" / "python"), "user": getpass.getuser(),
            "env_file": "/etc/celery-autotune/env", "stop_timeout": "3600", "nodes": "2",
            "gpus_per_node": "8", "time_limit": "04:00:00"}


def render(name: str, values: Mapping[str, str]) -> str:
    """The template `name` with every {{placeholder}} replaced; a missing or unsafe value is an error."""
    text = (FOLDER / TEMPLATES[name]).read_text()
    for key in set(_PLACEHOLDER.findall(text)):
        value = values.get(key)
        if value is None:
            raise UsageError(f"template {TEMPLATES[name]} needs a value for {key}")
        if not re.fullmatch(r"[\w@%+=:,./-]+", value):
            raise UsageError(f"--{key.replace('_', '-')} {value!r}: use a value without spaces, quotes or "
                             "shell characters")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m deploy.templates", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(TEMPLATES))
    for key, value in defaults().items():
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, default=value, help=f"default {value}")
    try:
        args = parser.parse_args(argv)
        sys.stdout.write(render(args.name, vars(args)))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
