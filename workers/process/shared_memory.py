"""The shared-memory segment DeepSpeed's CPU all-reduce leaves behind, removed when its rank ends.

Why: DeepSpeed's CPU communication op (`deepspeed_shm_comm`, used with DS_ACCELERATOR=cpu when every
rank of a job is on one node) creates one POSIX shared-memory segment per rank, about 66 MiB, named
`deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`, and unlinks it only when the
buffer is closed, which an experiment ending through the engine's profiling exit never does. Every
experiment therefore leaked its ranks' segments, and with a fresh master port per experiment no
later run reused them: on a 24 GiB machine a morning of tuning filled /dev/shm, the RAM behind it
ran out, and experiments hung until their time limits. The name is exact (this user, this
experiment's rendezvous address and port, this rank), so a slot removes only its own rank's
segment, after the rank's process group has ended.
"""
from __future__ import annotations

import os
from pathlib import Path

#: Where Linux keeps POSIX shared-memory objects (shm_open names).
SHM_DIR = Path("/dev/shm")
#: DeepSpeed's SHM_BUFFER_NAME (deepspeed/ops/csrc/cpu/comm/shm.cpp).
BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def segment_name(master_addr: str, master_port: int, rank: int, uid: int | None = None) -> str:
    """The name DeepSpeed's CPU all-reduce gives the segment of `rank` in the job meeting at
    master_addr:master_port."""
    return f"{BUFFER_PREFIX}_{os.getuid() if uid is None else uid}_{master_addr}_{master_port}_{rank}"


def remove_rank_segment(master_addr: str, master_port: int, rank: int, shm_dir: Path = SHM_DIR) -> bool:
    """Remove the rank's segment if it is there; True when one was removed."""
    name = segment_name(master_addr, master_port, rank)
    if "/" in name:  # an address can never hold one; never unlink outside shm_dir
        return False
    try:
        (shm_dir / name).unlink()
    except FileNotFoundError:
        return False
    return True
