"""Where a GPU sits (workers.topology): nvidia-smi's bus ids, sysfs's NUMA node and cpulist, read
from a sysfs tree made in the test."""
from __future__ import annotations

from pathlib import Path

import pytest

from workers.topology import node_cpus, normalized_bus_id, numa_node_of, parse_bus_ids, parse_cpulist


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
