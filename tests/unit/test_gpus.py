"""GPU listings (`workers.device.gpus`): nvidia-smi output read strictly, CUDA_VISIBLE_DEVICES honoured.

The listing is real nvidia-smi CSV; `local_gpus` runs the fake nvidia-smi in tests/fake_gpu as a
subprocess, so the parsing, exit-status and PATH handling are those of a real node.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.device.gpus import Gpu, GpuListingError, local_gpus, parse_listing, refuse_mig, visible

MiB, GiB = 1024**2, 1024**3
FAKE_GPU_DIR = Path(__file__).resolve().parents[1] / "fake_gpu"
A100 = "0, GPU-0a1b2c3d-0000-1111-2222-333344445555, 81920, Disabled"
A40 = "1, GPU-1f2e3d4c-0000-1111-2222-333344445555, 46068, [N/A]"
H100 = "2, GPU-2ffff000-0000-1111-2222-333344445555, 81559, Disabled"


def test_listing_parsed_in_index_order() -> None:
    gpus = parse_listing(f"{H100}\n{A100}\n\n{A40}\n")
    assert gpus == [Gpu(0, "GPU-0a1b2c3d-0000-1111-2222-333344445555", 81920 * MiB),
                    Gpu(1, "GPU-1f2e3d4c-0000-1111-2222-333344445555", 46068 * MiB),
                    Gpu(2, "GPU-2ffff000-0000-1111-2222-333344445555", 81559 * MiB)]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("0, GPU-abc, [N/A], Disabled", r"memory as '\[N/A\]'"),
        ("0, GPU-abc, N/A, Disabled", "memory as 'N/A'"),
        ("0, GPU-abc, nan, Disabled", "memory as 'nan'"),
        ("0, GPU-abc, 0, Disabled", "memory as '0'"),
        ("0, GPU-abc, 81920", "cannot read"),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "cannot read"),
        ("x, GPU-abc, 81920, Disabled", "index 'x'"),
        ("0, MIG-abc, 81920, Disabled", "UUID 'MIG-abc'"),
        (f"{A100}\n{A100}", "same GPU index twice"),
    ],
)
def test_unusable_listings_are_refused_in_one_line(line: str, says: str) -> None:
    with pytest.raises(GpuListingError, match=says) as refused:
        parse_listing(line)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("cuda_visible_devices", "indices"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),  # the process's device 0 is physical GPU 2
        ("1", [1]),
        ("GPU-2ffff000", [2]),  # a unique UUID prefix, as CUDA accepts
        ("GPU-1f2e3d4c-0000-1111-2222-333344445555,0", [1, 0]),
        ("", []),
        ("0,0", [0]),
    ],
)
def test_visible_devices_in_the_process_order(cuda_visible_devices: str | None, indices: list[int]) -> None:
    gpus = parse_listing("\n".join((A100, A40, H100)))
    assert [gpu.index for gpu in visible(gpus, cuda_visible_devices)] == indices


@pytest.mark.parametrize(
    ("cuda_visible_devices", "says"),
    [("3", "'3', which is not a GPU of this node"), ("GPU-", "ambiguous"),
     ("MIG-0a1b2c3d/1/0", "MIG instance"), ("GPU-ffff", "not a GPU of this node")],
)
def test_visible_devices_that_do_not_exist_are_refused(cuda_visible_devices: str, says: str) -> None:
    gpus = parse_listing("\n".join((A100, A40, H100)))
    with pytest.raises(GpuListingError, match=says):
        visible(gpus, cuda_visible_devices)


@pytest.fixture
def fake_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.setenv("PATH", f"{FAKE_GPU_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_LOG", str(tmp_path / "calls"))
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOTUNE_DEVICE_KIND", "FAKE_NVIDIA_SMI_OUTPUT", "FAKE_NVIDIA_SMI_EXIT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_local_gpus_from_a_real_subprocess(fake_smi: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert [(g.index, g.memory_bytes) for g in local_gpus() or []] == [(0, 16 * GiB), (1, 16 * GiB), (2, 16 * GiB)]
    assert (tmp_path / "calls").read_text().split() == [
        "--query-gpu=index,uuid,memory.total,mig.mode.current", "--format=csv,noheader,nounits"]
    fake_smi.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert [g.index for g in local_gpus() or []] == [2, 1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"AUTOTUNE_DEVICE_KIND": "cpu"}, None), ({"CUDA_VISIBLE_DEVICES": ""}, None)],
)
def test_cpu_node_on_request(fake_smi: pytest.MonkeyPatch, env: dict[str, str], expected: None) -> None:
    for name, value in env.items():
        fake_smi.setenv(name, value)
    assert local_gpus() is expected


@pytest.mark.parametrize(
    ("output", "exit_code", "says"),
    [("", "0", "lists no GPU"),
     ("No devices were found", "6", r"nvidia-smi failed \(exit 6: No devices were found\)"),
     ("garbage", "0", "cannot read")],
)
def test_local_gpus_refuses_unusable_output(fake_smi: pytest.MonkeyPatch, output: str, exit_code: str,
                                            says: str) -> None:
    fake_smi.setenv("FAKE_NVIDIA_SMI_OUTPUT", output)
    fake_smi.setenv("FAKE_NVIDIA_SMI_EXIT", exit_code)
    with pytest.raises(GpuListingError, match=says):
        local_gpus()


def test_a_mig_gpu_refuses_only_the_workers_that_would_serve_it(fake_smi: pytest.MonkeyPatch) -> None:
    """The MIG check comes after the visibility filter, and on the served GPU only."""
    from workers.device import slot as slot_module

    mig_a100 = A100.replace("Disabled", "Enabled")
    fake_smi.setenv("FAKE_NVIDIA_SMI_OUTPUT", f"{mig_a100}\n{H100}")
    fake_smi.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert [gpu.index for gpu in local_gpus()] == [2]
    fake_smi.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert [(gpu.index, gpu.mig) for gpu in local_gpus()] == [(0, True), (2, False)]
    assert slot_module.describe_local_slot("n", 1, "10.0.0.2").gpu_uuid == H100.split(", ")[1]  # GPU 2: served
    with pytest.raises(GpuListingError, match="GPU 0 has MIG enabled"):
        slot_module.describe_local_slot("n", 0, "10.0.0.2")
    with pytest.raises(GpuListingError, match="GPU 0 has MIG enabled"):
        refuse_mig(local_gpus())  # what uses every visible GPU (the embedded cluster) refuses
    assert parse_listing(mig_a100)[0].mig and not parse_listing(A100)[0].mig


def test_no_nvidia_smi_means_a_cpu_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("AUTOTUNE_DEVICE_KIND", raising=False)
    assert local_gpus() is None


def test_the_worker_reads_memory_in_use_and_bus_ids_through_a_real_subprocess(fake_smi: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    """What a slot worker asks nvidia-smi besides its listing (workers.device.device_idle, workers.device.topology),
    answered by tests/fake_gpu as the real one answers: one line per GPU of the fields asked."""
    from workers.device.gpus import memory_used
    from workers.device.topology import gpu_bus_ids

    one, zero = "GPU-11111111-1111-1111-1111-111111111111", "GPU-00000000-0000-0000-0000-000000000000"
    assert memory_used(one) == 0
    used = tmp_path / "used.csv"
    used.write_text("1, 2048\n")
    fake_smi.setenv("FAKE_NVIDIA_SMI_USED_FILE", str(used))
    assert (memory_used(one), memory_used(zero), memory_used("1")) == (2 * GiB, 0, 2 * GiB)
    assert gpu_bus_ids() == {0: "0000:10:00.0", 1: "0000:11:00.0", 2: "0000:12:00.0"}
    assert f"--query-gpu=index,uuid,memory.used --format=csv,noheader,nounits -i {one}" in (tmp_path / "calls").read_text()
