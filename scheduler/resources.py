"""`python -m scheduler.resources`: which hosts and devices a run would use, printed as JSON; runs nothing.

    python -m scheduler.resources --hostfile F [--include S | --exclude S] [--num_nodes N] [--num_gpus G]

The command over `scheduler.launch.resources` (the selection rules, pure, with DeepSpeed's semantics
and where they differ on purpose): this is the part that looks at the machine (its GPUs, else its
CPUs, when there is no hostfile) and speaks to the user (one `error:` line and exit 2 for bad input).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NoReturn

from scheduler.errors import UsageError
from scheduler.launch.hostfile import LOCAL_HOSTNAME, local_pool, read_hostfile
from scheduler.launch.resources import ResourceRequest, Resources, resolve_resources
from workers.device.gpus import GpuListingError, local_gpus, refuse_mig


def detect_local_devices() -> tuple[int, str]:
    """Count this machine's devices: its usable GPUs (`workers.device.gpus`, the same listing the slot
    workers use), else CPUs; says which."""
    try:
        gpus = local_gpus()
        if gpus:
            refuse_mig(gpus)  # the local pool is every visible GPU
    except GpuListingError as error:
        raise UsageError(str(error)) from None
    if gpus:
        return len(gpus), "nvidia-smi"
    return os.cpu_count() or 1, "os.cpu_count()"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the resolved selection as JSON; a usage error is one stderr line and exit 2."""
    args = _build_parser().parse_args(argv)
    try:
        resources = _resolve_from_args(args, os.environ)
    except UsageError as error:
        one_line = " ".join(str(error).splitlines())
        print(f"error: {one_line}", file=sys.stderr)
        return 2
    print(json.dumps({"hostfile": args.hostfile, **resources.to_json_dict()}, indent=2))
    return 0


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but its own errors are also a single `error: ...` line with exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="python -m scheduler.resources",
        description="Show which hosts and device ids a run would use; runs nothing.",
    )
    parser.add_argument("-H", "--hostfile", default=None, help="MPI-style hostfile: 'HOSTNAME slots=N' per line")
    parser.add_argument("-i", "--include", default="", help="NODE[:ID[,ID...]][@NODE...]: use only these")
    parser.add_argument("-e", "--exclude", default="", help="NODE[:ID[,ID...]][@NODE...]: use all but these")
    parser.add_argument("--num_nodes", type=int, default=None, help="use the first N hosts")
    parser.add_argument(
        "--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=None,
        help="use the first G devices of each host",
    )
    parser.add_argument(
        "--local_devices", type=int, default=None,
        help="without --hostfile: device count of this machine (default: the GPUs nvidia-smi lists, else CPU count)",
    )
    return parser


def _resolve_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Resources:
    request = ResourceRequest(
        include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_gpus=args.num_gpus
    )
    if args.hostfile is not None:
        if args.local_devices is not None:
            raise UsageError("--local_devices only applies without --hostfile; drop one of them")
        pool = read_hostfile(args.hostfile)
        return resolve_resources(pool, request, hostfile=args.hostfile, visible_devices=environ.get("CUDA_VISIBLE_DEVICES"))
    count, counted_by = _local_device_count(args.local_devices)
    resources = resolve_resources(
        local_pool(LOCAL_HOSTNAME, count), request, visible_devices=environ.get("CUDA_VISIBLE_DEVICES")
    )
    note = f"{LOCAL_HOSTNAME} has {count} devices according to {counted_by}"
    return replace(resources, notes=(note, *resources.notes))


def _local_device_count(given: int | None) -> tuple[int, str]:
    if given is not None:
        return given, "--local_devices"
    return detect_local_devices()


if __name__ == "__main__":
    sys.exit(main())
