"""Where a GPU sits (workers.device.topology): nvidia-smi's bus ids, sysfs's NUMA node and cpulist, read
from a sysfs tree made in the test."""
from __future__ import annotations

from pathlib import Path

import pytest

from workers.device.topology import (
    link_rank, node_cpus, normalized_bus_id, numa_node_of, parse_bus_ids, parse_cpulist, parse_topology, worst_link,
)


def test_bus_ids_as_sysfs_names_them() -> None:
    assert normalized_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert parse_bus_ids("0, 00000000:3B:00.0\n1, 00000000:86:00.0\nbad line\n2, N/A\n") == {
        0: "0000:3b:00.0", 1: "0000:86:00.0"}
    # another query's answer (the test's fake nvidia-smi answers every query with its GPU listing)
    assert parse_bus_ids("0, GPU-00000000-0000-0000-0000-000000000000, 16384, Disabled") == {}


@pytest.mark.parametrize(("text", "cores"), [("0-3,8,10-11\n", (0, 1, 2, 3, 8, 10, 11)), ("5", (5,)), ("", ()),
                                             ("0-x", ())])
def test_parse_cpulist(text: str, cores: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == cores


def test_numa_node_and_its_cores_from_sysfs(tmp_path: Path) -> None:
    for bus, numa in (("0000:3b:00.0", "1"), ("0000:86:00.0", "-1")):
        (tmp_path / "bus" / "pci" / "devices" / bus).mkdir(parents=True)
        (tmp_path / "bus" / "pci" / "devices" / bus / "numa_node").write_text(numa + "\n")
    (tmp_path / "devices" / "system" / "node" / "node1").mkdir(parents=True)
    (tmp_path / "devices" / "system" / "node" / "node1" / "cpulist").write_text("16-31\n")
    assert numa_node_of("0000:3b:00.0", tmp_path) == 1
    assert numa_node_of("0000:86:00.0", tmp_path) == -1  # a host without NUMA says -1
    assert numa_node_of("0000:00:00.0", tmp_path) == -1 and numa_node_of(None, tmp_path) == -1
    assert node_cpus(1, tmp_path) == tuple(range(16, 32))
    assert node_cpus(0, tmp_path) == () and node_cpus(-1, tmp_path) == ()


#: `nvidia-smi topo -m` of a PCIe node with one NVLink pair and a NIC, as the real one prints it
#: (underlined header, tab-separated, affinity columns, the legend).
TOPO = ("\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV4\tPIX\tSYS\tPIX\t0-15\t0\t\tN/A\n"
        "GPU1\tNV4\t X \tPXB\tSYS\tPXB\t0-15\t0\t\tN/A\n"
        "GPU2\tPIX\tPXB\t X \tSYS\tNODE\t0-15\t0\t\tN/A\n"
        "GPU3\tSYS\tSYS\tSYS\t X \tSYS\t16-31\t1\t\tN/A\n"
        "NIC0\tPIX\tPXB\tNODE\tSYS\t X \n\nLegend:\n\n  X    = Self\n"
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
        "  NV#  = Connection traversing a bonded set of # NVLinks\n\nNIC Legend:\n\n  NIC0: mlx5_0\n")


def test_the_link_matrix_as_nvidia_smi_prints_it() -> None:
    links = parse_topology(TOPO)
    assert links == {0: {1: "NV4", 2: "PIX", 3: "SYS"}, 1: {0: "NV4", 2: "PXB", 3: "SYS"},
                     2: {0: "PIX", 1: "PXB", 3: "SYS"}, 3: {0: "SYS", 1: "SYS", 2: "SYS"}}
    assert parse_topology("") == {} and parse_topology("No devices were found") == {}


@pytest.mark.parametrize(
    ("links", "worst"),
    [(["NV12", "NV4"], "NV4"), (["NV4", "PIX"], "PIX"), (["PIX", "PXB", "PHB"], "PHB"), (["NODE", "SYS"], "SYS"),
     ([], ""), (["NV12", "N/A"], "")],
)
def test_the_slowest_link(links: list[str], worst: str) -> None:
    assert worst_link(links) == worst


def test_links_rank_from_the_sockets_interconnect_to_nvlink() -> None:
    order = ["SYS", "NODE", "PHB", "PXB", "PIX", "NV1", "NV4", "NV18"]
    assert sorted(order, key=link_rank) == order and link_rank("N/A") == -1
