"""A rank's memory as the slot's cap counts it, read ten times a second without costing a core.

Why: the cap is checked against the proportional set size (PSS) of the rank's whole process tree
(`tree_pss`: each page shared with a forked child counted once). The kernel computes PSS by walking
every page of the process (/proc/<pid>/smaps_rollup): about 10 ms of CPU for one rank that imported
torch and DeepSpeed, on the 2-core machine. Read ten times a second, and with psutil's `children`
scanning all of /proc each time, the watching slot worker took an eighth of a core from the training
it measures, for every rank. The resident set size (RSS) is one small file per process and is never
below PSS, so a tree whose RSS is within the cap is within it by PSS too: `TreeMemory` reads RSS at
every poll and PSS only when RSS could be over the cap, when RSS has grown or the tree changed since
the last PSS reading (so a peak is not missed), and at least once a second.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil

FULL_EVERY_S = 1.0  #: PSS is read at least this often, whatever RSS says
GROWTH_BYTES = 4 << 20  #: RSS grown this much since the last PSS reading: read PSS again


#: Whether this kernel lists each task's children (CONFIG_PROC_CHILDREN); without it, psutil's scan.
CHILDREN_LISTED = Path(f"/proc/self/task/{os.getpid()}/children").exists()


def tree_processes(root: psutil.Process) -> list[psutil.Process]:
    """The root and its descendants, found from each process's own list of children
    (/proc/<pid>/task/<tid>/children) rather than a scan of every process on the machine. A process
    that ended meanwhile is left out; the rest of the tree is still walked."""
    if not CHILDREN_LISTED:
        try:
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return [root]
    found, todo = [root], [root.pid]
    while todo:
        try:
            tasks = list(Path(f"/proc/{todo.pop()}/task").iterdir())
        except OSError:  # ended meanwhile
            continue
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in children:
                try:
                    process = psutil.Process(int(child))
                except psutil.Error:
                    continue
                found.append(process)
                todo.append(process.pid)
    return found


def tree_pss(processes: list[psutil.Process], forked_root: bool = False) -> int:
    """Memory of the processes in bytes, each page counted once: PSS, not RSS (a child forked but not
    yet exec'd, as DeepSpeed spawns numactl and compilers, shares all its parent's pages, and summing
    RSS would count them twice, turning a healthy run into a false OOM). RSS where PSS cannot be read.
    `forked_root`: the first process was forked, without exec, from a warm process
    (`workers.warm.warm_start`), and what it still shares with it counts as its own (`inherited`), taken
    from the same reading of its smaps_rollup as its PSS (each reading is the kernel walking every
    page: ~6 ms of CPU for a rank that imported torch and DeepSpeed)."""
    total = 0
    for index, proc in enumerate(processes):
        if index == 0 and forked_root:
            fields = smaps_rollup(proc.pid)
            if "Pss" in fields:
                total += fields["Pss"] + inherited(fields)
                continue
        try:
            total += proc.memory_full_info().pss
        except (psutil.Error, AttributeError):
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
    return total


def smaps_rollup(pid: int) -> dict[str, int]:
    """The fields of /proc/<pid>/smaps_rollup in bytes; {} when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.replace("_", "").isalpha():
            try:
                fields[name] = int(value.split()[0]) * 1024
            except (ValueError, IndexError):
                continue
    return fields


def inherited(fields: dict[str, int]) -> int:
    """The memory a forked process still shares with the process it was forked from: counted half
    in its PSS, but a cold process would own it (its anonymous memory in full, less its proportional
    share). A script that never imports a preloaded module (torch._dynamo, which every torch
    optimizer imports) is charged for it all the same: its figure is that much above a cold run's. Pure."""
    if "Anonymous" not in fields or "Pss_Anon" not in fields:
        return 0
    return max(0, fields["Anonymous"] - fields["Pss_Anon"])


def tree_rss(processes: list[psutil.Process]) -> int:
    """The processes' resident sets summed: never below their PSS, and cheap to read."""
    total = 0
    for proc in processes:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


class TreeMemory:
    """The figure of one rank's tree against its cap (`read`), PSS plus what a rank forked from a warm
    process shares with it (`forked_root`, `inherited`), taken from RSS whenever RSS proves it unchanged."""

    def __init__(self, root: psutil.Process, forked_root: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._root, self._forked_root, self._clock = root, forked_root, clock
        self._figure = 0
        self._rss_at_full = -1
        self._pids_at_full: frozenset[int] = frozenset()
        self._full_at = float("-inf")
        self.full_reads = 0  #: how often PSS was read (what the cheap path saves)

    def read(self, cap_bytes: int | None = None) -> int:
        """The tree's figure now (bytes). With a cap, exact whenever it could be over the cap."""
        processes = tree_processes(self._root)
        rss = tree_rss(processes)
        pids = frozenset(proc.pid for proc in processes)
        now = self._clock()
        if ((cap_bytes is not None and rss > cap_bytes) or rss > self._rss_at_full + GROWTH_BYTES
                or pids != self._pids_at_full or now - self._full_at >= FULL_EVERY_S):
            self._figure = tree_pss(processes, self._forked_root)
            self._rss_at_full, self._pids_at_full, self._full_at = rss, pids, now
            self.full_reads += 1
        return self._figure
