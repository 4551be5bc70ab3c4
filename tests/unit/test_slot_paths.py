"""Slots (`workers.device.slot`) and results paths that cannot escape (`workers.files.paths`)."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import workers.device.slot as slot_module
from workers.files.paths import read_json, safe_child, write_atomic, write_json
from workers.device.gpus import Gpu, GpuListingError
from workers.device.slot import Slot, address_towards, describe_local_slot, node_name, parse_queue, parse_size, slot_queue

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4

# ---------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3GiB", 3 * GiB),
        ("512MiB", 512 * MiB),
        ("2G", 2_000_000_000),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 1_610_612_736),
        ("0.5MiB", 524_288),
        ("1500000000", 1_500_000_000),
        ("0", 0),
        ("100B", 100),
        ("7b", 7),
        ("4KiB", 4 * KiB),
        ("4k", 4000),
        ("1TiB", TiB),
        ("2T", 2 * 10**12),
        ("3gib", 3 * GiB),
        ("3 GiB", 3 * GiB),
        ("  64MiB  ", 64 * MiB),
        ("1.5", 1),
        (1024, 1024),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    value = parse_size(text)
    assert value == expected
    assert isinstance(value, int)


@pytest.mark.parametrize(
    "text",
    ["", "   ", "GiB", "abc", "-1", "-1GiB", "3XiB", "3P", "3PiB", "3iB", "3GiBs", "1e9", "3 G i B", "1,5GiB",
     "3GiB3", "0x10", "3Gib extra"],
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size(text)


# ---------------------------------------------------------------- queues


@pytest.mark.parametrize(
    ("queue", "expected"),
    [
        ("node.gpu0", ("node", 0)),
        ("node2.gpu7", ("node2", 7)),
        ("gpu3", (None, 3)),
        ("gpu12", (None, 12)),
        ("host-1.example.com.gpu12", ("host-1.example.com", 12)),
        ("worker_0.gpu1", ("worker_0", 1)),
        ("node.gpu007", ("node", 7)),
        ("control", None),
        ("celery", None),
        ("", None),
        ("gpu", None),
        ("node.gpu", None),
        ("node.gpux", None),
        ("node.gpu-1", None),
        ("node.cpu0", None),
        ("node.GPU0", None),
        (".gpu0", None),
        ("node gpu0", None),
        ("a b.gpu0", None),
        ("node@x.gpu0", None),
        ("node.gpu0.extra", None),
        ("xgpu0", None),
    ],
)
def test_parse_queue(queue: str, expected: tuple[str | None, int] | None) -> None:
    assert parse_queue(queue) == expected


@pytest.mark.parametrize(("node", "device"), [("n", 0), ("node-7.lan", 15)])
def test_slot_queue_round_trip(node: str, device: int) -> None:
    assert slot_queue(node, device) == f"{node}.gpu{device}"
    assert parse_queue(slot_queue(node, device)) == (node, device)


# ---------------------------------------------------------------- Slot

CPU_SLOT = Slot("n1", 2, "cpu", 3 * GiB, "10.0.0.5", 4, (4, 5, 6, 7), "w2@n1")
CUDA_SLOT = Slot("gpu-host", 1, "cuda", 80 * GiB, "10.0.0.9", 8, (), "w1@gpu-host", cuda_index=3,
                 host="m1", gpu_uuid="GPU-3333")


def test_to_redis_strings() -> None:
    assert CPU_SLOT.to_redis() == {
        "node": "n1", "device": "2", "kind": "cpu", "memory_bytes": str(3 * GiB), "address": "10.0.0.5",
        "threads": "4", "cpus": "4,5,6,7", "worker": "w2@n1", "instance": "", "cuda_index": "-1", "host": "",
        "gpu_uuid": "", "numa_node": "-1", "links": "",
    }
    assert CUDA_SLOT.to_redis()["cpus"] == ""
    linked = replace(CUDA_SLOT, links=((0, "NV12"), (3, "SYS")))
    assert linked.to_redis()["links"] == "0:NV12,3:SYS" and Slot.from_redis(linked.to_redis()) == linked
    assert linked.link_to(replace(CUDA_SLOT, cuda_index=3)) == "SYS" and linked.link_to(replace(CUDA_SLOT, cuda_index=5)) == ""


@pytest.mark.parametrize("slot", [CPU_SLOT, CUDA_SLOT, Slot("x", 0, "cpu", 1, "127.0.0.1", 1, (0,))],
                         ids=["cpu", "cuda", "single-cpu-no-worker"])
def test_redis_round_trip(slot: Slot) -> None:
    fields = slot.to_redis()
    assert all(isinstance(v, str) for v in fields.values())
    assert Slot.from_redis(fields) == slot


def test_from_redis_defaults_for_missing_optional_fields() -> None:
    fields = {"node": "n", "device": "3", "kind": "cpu", "memory_bytes": "100", "address": "a", "threads": "2"}
    assert Slot.from_redis(fields) == Slot("n", 3, "cpu", 100, "a", 2, (), "")


def test_queue_property() -> None:
    assert CPU_SLOT.queue == "n1.gpu2"
    assert CUDA_SLOT.queue == "gpu-host.gpu1"


def test_child_env_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert CPU_SLOT.child_env() == {
        "AUTOTUNE_SLOT": "n1.gpu2", "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4",
        "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu",
    }


def test_child_env_cpu_keeps_chosen_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    assert CPU_SLOT.child_env()["DS_ACCELERATOR"] == "xpu"


def test_child_env_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert CUDA_SLOT.child_env() == {
        "AUTOTUNE_SLOT": "gpu-host.gpu1", "OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8",
        "CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


@pytest.mark.parametrize(
    ("slot", "slot_memory", "host_cap", "cap"),
    [
        (CPU_SLOT, None, None, 3 * GiB),
        (CPU_SLOT, "1GiB", None, 3 * GiB),  # the slot's registered memory, not the worker's variable
        (CPU_SLOT, None, "1GiB", 3 * GiB),  # a GPU-rank setting: CPU slots keep their slot memory
        (CUDA_SLOT, None, None, None),
        (CUDA_SLOT, "1.25GiB", None, None),  # the README's first command on a GPU box: no host cap
        (CUDA_SLOT, "1.25GiB", "2GiB", 2 * GiB),
        (CUDA_SLOT, None, "2GiB", 2 * GiB),
    ],
    ids=["cpu", "cpu-slot-memory", "cpu-host-cap", "cuda", "cuda-slot-memory", "cuda-both", "cuda-host-cap"],
)
def test_host_memory_cap(monkeypatch: pytest.MonkeyPatch, slot: Slot, slot_memory: str | None,
                         host_cap: str | None, cap: int | None) -> None:
    """AUTOTUNE_SLOT_MEMORY (--slot-memory) never caps a CUDA rank's host memory;
    only AUTOTUNE_HOST_MEMORY_CAP (--host-memory-cap) does."""
    for name, value in (("AUTOTUNE_SLOT_MEMORY", slot_memory), ("AUTOTUNE_HOST_MEMORY_CAP", host_cap)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert slot.host_memory_cap == cap


# ---------------------------------------------------------------- describe_local_slot


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("AUTOTUNE_SLOTS_PER_NODE", "AUTOTUNE_SLOT_MEMORY", "AUTOTUNE_HOST_MEMORY_CAP", "AUTOTUNE_NODE",
                 "AUTOTUNE_ADDRESS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(slot_module, "machine_id", lambda: "machine-1")
    monkeypatch.setattr(slot_module, "gpu_bus_ids", lambda: {})  # no NUMA facts unless a test gives them
    return monkeypatch


def no_gpu(monkeypatch: pytest.MonkeyPatch, cores: int | None, ram: int = 16 * GiB) -> None:
    monkeypatch.setattr(slot_module, "local_gpus", lambda: None)
    if cores is not None:
        monkeypatch.setattr(slot_module.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(slot_module.psutil, "virtual_memory", lambda: SimpleNamespace(total=ram))


@pytest.mark.parametrize(
    ("cores", "slots_env", "memory_env", "device", "threads", "cpus", "memory"),
    [
        (8, "4", "3GiB", 1, 2, (2, 3), 3 * GiB),
        (8, "4", "3GiB", 3, 2, (6, 7), 3 * GiB),
        (8, None, None, 3, 1, (3,), 2 * GiB),  # slots default to cores; RAM (16GiB) / 8
        (8, "2", None, 1, 4, (4, 5, 6, 7), 8 * GiB),
        (8, "1", "512MiB", 0, 8, tuple(range(8)), 512 * MiB),
        (8, "3", None, 2, 2, (4, 5), 16 * GiB // 3),
        (2, "4", "1G", 3, 1, (1,), 10**9),  # more slots than cores: one thread each, wrapped
        (6, "4", None, 0, 1, (0,), 4 * GiB),
        (4, "2", None, 2, 2, (0, 1), 8 * GiB),  # device beyond the slot count wraps around
    ],
)
def test_describe_local_cpu_slot(clean_env: pytest.MonkeyPatch, cores: int, slots_env: str | None,
                                 memory_env: str | None, device: int, threads: int, cpus: tuple[int, ...],
                                 memory: int) -> None:
    no_gpu(clean_env, cores)
    if slots_env is not None:
        clean_env.setenv("AUTOTUNE_SLOTS_PER_NODE", slots_env)
    if memory_env is not None:
        clean_env.setenv("AUTOTUNE_SLOT_MEMORY", memory_env)
    slot = describe_local_slot("n1", device, "10.1.1.1", "w@n1")
    assert slot == Slot("n1", device, "cpu", memory, "10.1.1.1", threads, cpus, "w@n1", host="machine-1")


@pytest.mark.parametrize(("cores", "slots"), [(4, 1), (4, 2), (4, 4), (8, 3), (16, 4), (16, 16), (12, 5)])
def test_cpu_slots_pin_distinct_cores(clean_env: pytest.MonkeyPatch, cores: int, slots: int) -> None:
    no_gpu(clean_env, cores)
    clean_env.setenv("AUTOTUNE_SLOTS_PER_NODE", str(slots))
    described = [describe_local_slot("n", d, "a") for d in range(slots)]
    pinned = [set(s.cpus) for s in described]
    assert all(len(p) == cores // slots for p in pinned)
    assert all(p <= set(range(cores)) for p in pinned)
    assert len(set().union(*pinned)) == (cores // slots) * slots  # no core shared between slots
    assert {s.threads for s in described} == {cores // slots}


@pytest.mark.parametrize(("chosen", "threads"), [("3", 3), ("0", 4), ("two", 4), ("", 4)])
def test_the_users_omp_num_threads_is_kept(clean_env: pytest.MonkeyPatch, chosen: str, threads: int) -> None:
    """A worker whose user set OMP_NUM_THREADS tunes with it (and cmd_optimal.txt writes it): the
    slot's ranks get that many threads, pinned to the slot's share of cores all the same; a value
    that is no positive count is ignored (cores // slots)."""
    no_gpu(clean_env, 8)
    clean_env.setenv("AUTOTUNE_SLOTS_PER_NODE", "2")
    clean_env.setenv("OMP_NUM_THREADS", chosen)
    slot = describe_local_slot("n", 1, "a")
    assert slot.threads == threads and slot.cpus == (4, 5, 6, 7)
    assert slot.child_env()["OMP_NUM_THREADS"] == slot.child_env()["MKL_NUM_THREADS"] == str(threads)


def test_describe_local_slot_on_this_machine(clean_env: pytest.MonkeyPatch) -> None:
    no_gpu(clean_env, cores=None)
    clean_env.setenv("AUTOTUNE_SLOTS_PER_NODE", "1")
    clean_env.setenv("AUTOTUNE_SLOT_MEMORY", "512MiB")
    cores = os.cpu_count() or 1
    slot = describe_local_slot("here", 0, "127.0.0.1")
    assert slot.kind == "cpu"
    assert slot.memory_bytes == 512 * MiB
    assert slot.threads == cores
    assert slot.cpus == tuple(range(cores))
    assert slot.worker == ""
    assert slot.child_env()["CUDA_VISIBLE_DEVICES"] == ""
    assert slot.child_env()["OMP_NUM_THREADS"] == str(cores)


@pytest.mark.parametrize(
    ("slots_env", "threads"),
    [("4", 4), (None, 5), ("16", 1), ("32", 1)],  # default: one slot per usable GPU (3), 16 // 3 threads
)
def test_describe_local_cuda_slot(clean_env: pytest.MonkeyPatch, slots_env: str | None, threads: int) -> None:
    # the worker inherited CUDA_VISIBLE_DEVICES=5,2,7: its gpu1 is the physical GPU 2 (80 GiB)
    usable = [Gpu(5, "GPU-e", 40 * GiB), Gpu(2, "GPU-b", 80 * GiB), Gpu(7, "GPU-h", 24 * GiB)]
    clean_env.setattr(slot_module, "local_gpus", lambda: usable)
    clean_env.setattr(slot_module.os, "cpu_count", lambda: 16)
    clean_env.setenv("AUTOTUNE_SLOT_MEMORY", "3GiB")  # a CPU slot's memory: changes neither capacity nor host cap
    if slots_env is not None:
        clean_env.setenv("AUTOTUNE_SLOTS_PER_NODE", slots_env)
    slot = describe_local_slot("g", 1, "10.0.0.2", "w1@g")
    assert slot == Slot("g", 1, "cuda", 80 * GiB, "10.0.0.2", threads, (), "w1@g", cuda_index=2, host="machine-1",
                        gpu_uuid="GPU-b")
    assert slot.child_env()["CUDA_VISIBLE_DEVICES"] == "2"  # the physical GPU, in PCI bus order
    assert slot.child_env()["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert slot.child_env(["7", "2"])["CUDA_VISIBLE_DEVICES"] == "7,2"
    assert slot.host_memory_cap is None
    assert Slot.from_redis(slot.to_redis()) == slot


def test_a_cuda_slot_knows_its_numa_node_and_pins_to_its_cores(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """GPU 2 sits on NUMA node 1 (cores 8-15 of 16; the worker may use 0-11): the slot says node 1 and
    pins its ranks to 8-11, the node's cores it is allowed."""
    from workers.device import topology

    device = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    node = tmp_path / "devices" / "system" / "node" / "node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("8-15\n")
    clean_env.setattr(topology, "SYS", tmp_path)
    clean_env.setattr(slot_module, "gpu_bus_ids", lambda: {2: "0000:3b:00.0"})
    clean_env.setattr(slot_module, "local_gpus", lambda: [Gpu(2, "GPU-b", 80 * GiB)])
    clean_env.setattr(slot_module.os, "sched_getaffinity", lambda pid: set(range(12)))
    slot = describe_local_slot("g", 0, "10.0.0.2", "w@g")
    assert (slot.numa_node, slot.cpus) == (1, (8, 9, 10, 11))
    assert Slot.from_redis(slot.to_redis()) == slot


def test_a_device_beyond_the_gpus_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(slot_module, "local_gpus", lambda: [Gpu(0, "GPU-a", GiB), Gpu(1, "GPU-b", GiB)])
    with pytest.raises(GpuListingError, match=r"gpu2: this node offers 2 GPU\(s\).*gpu0..gpu1"):
        describe_local_slot("g", 2, "10.0.0.2")


@pytest.mark.parametrize(
    ("env", "worker", "expected"),
    [("envnode", "w@hostnode", "envnode"), (None, "w@hostnode", "hostnode"), (None, "w@a@b", "a@b")],
)
def test_node_name(clean_env: pytest.MonkeyPatch, env: str | None, worker: str, expected: str) -> None:
    if env is not None:
        clean_env.setenv("AUTOTUNE_NODE", env)
    assert node_name(worker) == expected


@pytest.mark.parametrize("worker", [None, "", "no-at-sign"])
def test_node_name_falls_back_to_host_name(clean_env: pytest.MonkeyPatch, worker: str | None) -> None:
    clean_env.setattr(slot_module.socket, "gethostname", lambda: "the-host")
    assert node_name(worker) == "the-host"


def test_address_towards_from_env(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AUTOTUNE_ADDRESS", "192.168.7.7")
    assert address_towards("redis.invalid", 6379) == "192.168.7.7"


# ---------------------------------------------------------------- safe_child


@pytest.mark.parametrize(
    "name",
    ["z0_gas1_tmbspg4", "z3_gas16_tmbspg128.json", "A", "9", "a-b+c=d.e_f", "a" * 200, "x.", "a.b.c"],
)
def test_safe_child_accepts(tmp_path: Path, name: str) -> None:
    child = safe_child(tmp_path, name)
    assert child == tmp_path.resolve() / name
    assert child.parent == tmp_path.resolve()


def test_safe_child_accepts_str_root(tmp_path: Path) -> None:
    assert safe_child(str(tmp_path), "exp") == tmp_path.resolve() / "exp"


@pytest.mark.parametrize(
    "name",
    ["..", "../x", "a/../../etc", "x..y", "a/b", "/abs", "/etc/passwd", "", ".", ".hidden", ".x.json", "a\\b",
     "a b", "a" * 201, "-x", "_x", "a\x00b", "é", "a:b", "~", "*"],
)
def test_safe_child_rejects(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        safe_child(tmp_path, name)


def test_safe_child_rejects_symlink_out_of_root(tmp_path: Path) -> None:
    root = tmp_path / "results"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="escapes"):
        safe_child(root, "link")


@pytest.mark.parametrize("name", ["abc\n", "z0_gas1_tmbspg1\n"])
def test_safe_child_rejects_trailing_newline(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        safe_child(tmp_path, name)


# ---------------------------------------------------------------- JSON files


@pytest.mark.parametrize(
    "data",
    [{"a": 1, "b": [1, 2.5, None, True], "c": {"d": "é"}}, [1, 2, 3], "text", 0, None, {}],
    ids=["object", "list", "string", "zero", "null", "empty"],
)
def test_write_read_json_round_trip(tmp_path: Path, data: object) -> None:
    path = tmp_path / "sub" / "dir" / "data.json"
    write_json(path, data)
    assert read_json(path) == data
    assert path.read_text().endswith("\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["data.json"]  # no temporary file left


@pytest.mark.parametrize(("indent", "text"), [(2, '{\n  "a": 1\n}\n'), (None, '{"a": 1}\n')])
def test_write_json_indent(tmp_path: Path, indent: int | None, text: str) -> None:
    path = tmp_path / "x.json"
    write_json(path, {"a": 1}, indent=indent)
    assert path.read_text() == text


def test_write_atomic_replaces(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    write_atomic(path, "old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_write_atomic_failure_leaves_no_temp_file(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "f.txt", b"bytes are not text")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content",
    [None, "", "{not json", '{"a": 1', "nan-ish", b"\xff\xfe\xfd"],
    ids=["missing", "empty", "garbage", "truncated", "words", "binary"],
)
def test_read_json_missing_or_invalid(tmp_path: Path, content: str | bytes | None) -> None:
    path = tmp_path / "r.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert read_json(path) is None


def test_read_json_directory(tmp_path: Path) -> None:
    assert read_json(tmp_path) is None


def test_machine_id_names_this_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_open = open
    ids = {"/etc/machine-id": tmp_path / "etc-id", "/var/lib/dbus/machine-id": tmp_path / "dbus-id"}
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(ids.get(path, path), *a, **k))
    monkeypatch.setattr(slot_module.socket, "gethostname", lambda: "the-host")
    assert slot_module.machine_id() == "the-host"  # neither file
    (tmp_path / "dbus-id").write_text("dbus123\n")
    assert slot_module.machine_id() == "dbus123"
    (tmp_path / "etc-id").write_text("etc456\n")
    assert slot_module.machine_id() == "etc456"
