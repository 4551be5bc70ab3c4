"""Where a GPU sits in its host: its NUMA node, and the CPU cores of that node.

Why: on a two-socket GPU node, a gang of GPUs split across the sockets talks through the CPUs'
interconnect (no PCIe peer-to-peer), and a rank whose threads run on the other socket feeds its GPU
across it too: the experiment measures the placement, not the config. The worker
never opens CUDA, so it reads what the kernel says: nvidia-smi's PCI bus id for each GPU, then
`/sys/bus/pci/devices/<bus id>/numa_node` and `/sys/devices/system/node/node<N>/cpulist`. A slot
records its GPU's NUMA node (`Slot.numa_node`, placement keeps a gang on one node when it can) and
pins its ranks to that node's cores (`Slot.cpus`). Anything unreadable (no NUMA, a container without
/sys, a fake nvidia-smi) is simply unknown: -1 and no pinning, as before.

And how each GPU reaches the others of its node: `nvidia-smi topo -m`'s matrix (`gpu_links`), from
NVLink (`NV#`, # bonded links) down through one PCIe bridge (`PIX`), several (`PXB`), the host
bridge (`PHB`), the host bridges of one NUMA node (`NODE`) to the sockets' interconnect (`SYS`).
A slot records its GPU's links (`Slot.links`); placement takes, among a NUMA node's free GPUs, the
set whose slowest link is fastest, and each record names its gang's slowest link (`worst_link`), so
two experiments are not compared across an NVLink pair and a PCIe pair without it showing.
"""
from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from workers.device.gpus import query

#: Link classes from slowest to fastest; `NV#` ranks above all, more bonded links faster.
LINK_ORDER = ("SYS", "NODE", "PHB", "PXB", "PIX")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

SYS = Path("/sys")


def normalized_bus_id(bus_id: str) -> str:
    """nvidia-smi's `00000000:3B:00.0` as sysfs names it: `0000:3b:00.0`."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}" if rest else bus_id.strip().lower()


def parse_bus_ids(text: str) -> dict[int, str]:
    """GPU index -> sysfs bus id from `nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader`
    output (lines that are not `index, bus id` are skipped)."""
    found = {}
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].count(":") == 2:
            found[int(fields[0])] = normalized_bus_id(fields[1])
    return found


def gpu_bus_ids() -> dict[int, str]:
    """GPU index -> bus id as nvidia-smi lists them ({} when it cannot tell)."""
    text = query("index,pci.bus_id")
    return {} if text is None else parse_bus_ids(text)


def numa_node_of(bus_id: str | None, sys_root: Path | None = None) -> int:
    """The NUMA node of the PCI device `bus_id` (-1: unknown, or a host without NUMA)."""
    if not bus_id:
        return -1
    try:
        value = int(((sys_root or SYS) / "bus" / "pci" / "devices" / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1
    return value if value >= 0 else -1


def parse_cpulist(text: str) -> tuple[int, ...]:
    """`0-3,8,10-11` -> (0, 1, 2, 3, 8, 10, 11); () for anything unreadable."""
    cores: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.strip().split(","))):
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        return ()
    return tuple(sorted(cores))


def node_cpus(numa_node: int, sys_root: Path | None = None) -> tuple[int, ...]:
    """The cores of NUMA node `numa_node` (() when unknown)."""
    if numa_node < 0:
        return ()
    try:
        return parse_cpulist(((sys_root or SYS) / "devices" / "system" / "node" / f"node{numa_node}" / "cpulist").read_text())
    except OSError:
        return ()


def link_rank(link: str) -> int:
    """How fast a link class is (higher: faster); -1 for one nvidia-smi did not name."""
    if link.startswith("NV") and link[2:].isdigit():
        return len(LINK_ORDER) + int(link[2:])
    return LINK_ORDER.index(link) if link in LINK_ORDER else -1


def worst_link(links: Iterable[str]) -> str:
    """The slowest of `links` ("" for none, or when one is unknown)."""
    found = list(links)
    if not found or any(link_rank(link) < 0 for link in found):
        return ""
    return min(found, key=link_rank)


def parse_topology(text: str) -> dict[int, dict[int, str]]:
    """GPU index -> {other GPU index: link} from `nvidia-smi topo -m` (NIC columns, the affinity
    columns, the legend and terminal colours ignored; {} when there is no matrix)."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        return {}
    columns = [int(name[3:]) if name.startswith("GPU") and name[3:].isdigit() else None for name in header]
    links: dict[int, dict[int, str]] = {}
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("GPU") or not fields[0][3:].isdigit() or fields == header:
            continue
        row = int(fields[0][3:])
        for other, link in zip(columns, fields[1:]):
            if other is not None and other != row and link != "X":
                links.setdefault(row, {})[other] = link
    return links


def gpu_links() -> dict[int, dict[int, str]]:
    """`parse_topology` of this node's `nvidia-smi topo -m` ({} when it cannot tell)."""
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_topology(done.stdout) if done.returncode == 0 else {}
