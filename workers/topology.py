"""Where a GPU sits in its host: its NUMA node, and the CPU cores of that node.

Why: on a two-socket GPU node, a gang of GPUs split across the sockets talks through the CPUs'
interconnect (no PCIe peer-to-peer), and a rank whose threads run on the other socket feeds its GPU
across it too: the experiment measures the placement, not the config (issue 21 item 16). The worker
never opens CUDA, so it reads what the kernel says: nvidia-smi's PCI bus id for each GPU, then
`/sys/bus/pci/devices/<bus id>/numa_node` and `/sys/devices/system/node/node<N>/cpulist`. A slot
records its GPU's NUMA node (`Slot.numa_node`, placement keeps a gang on one node when it can) and
pins its ranks to that node's cores (`Slot.cpus`). Anything unreadable (no NUMA, a container without
/sys, a fake nvidia-smi) is simply unknown: -1 and no pinning, as before.
"""
from __future__ import annotations

from pathlib import Path

from workers.gpus import query

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
