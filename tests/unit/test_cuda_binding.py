"""A CUDA slot worker refuses a binding that opens another GPU than its own (workers.device.cuda_binding):
the comparison, and the child process that asks CUDA, run against a stand-in
`torch` (this machine has no GPU) that numbers GPUs as $FAKE_CUDA_UUIDS says."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.device import cuda_binding
from workers.device.cuda_binding import (NO_DEVICE, SWITCH_ENV, binding_problem, same_gpu, should_check, torch_has_cuda,
                                  uuid_seen_by_cuda)
from workers.device.slot import Slot

SLOT = Slot("n0", 1, "cuda", 80 << 30, "127.0.0.1", 8, (), "gpu1@n0", cuda_index=1, host="m1",
            gpu_uuid="GPU-11111111-1111-1111-1111-111111111111")
FAKE_TORCH = '''import os
class _Props:
    def __init__(self, uuid): self.uuid = uuid
class cuda:
    @staticmethod
    def _visible():
        table = dict(entry.split("=") for entry in os.environ.get("FAKE_CUDA_UUIDS", "").split(",") if entry)
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            return list(table.values())
        return [table[index] for index in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if index in table]
    @staticmethod
    def is_available(): return bool(cuda._visible())
    @staticmethod
    def device_count(): return len(cuda._visible())
    @staticmethod
    def get_device_properties(ordinal): return _Props(cuda._visible()[ordinal])
'''


@pytest.fixture
def fake_torch(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}


def test_cuda_opening_the_slots_own_gpu_is_fine(fake_torch: dict[str, str]) -> None:
    env = {**fake_torch, "FAKE_CUDA_UUIDS": "0=00000000-0000-0000-0000-000000000000,"
                                            "1=11111111-1111-1111-1111-111111111111"}
    seen = uuid_seen_by_cuda(SLOT, env)
    assert seen == "11111111-1111-1111-1111-111111111111"
    assert binding_problem(SLOT, seen) is None


def test_cuda_numbering_gpus_differently_is_refused_in_one_line(fake_torch: dict[str, str]) -> None:
    """Under MPS index 1 opens what nvidia-smi calls GPU 0."""
    env = {**fake_torch, "FAKE_CUDA_UUIDS": "1=00000000-0000-0000-0000-000000000000"}
    problem = binding_problem(SLOT, uuid_seen_by_cuda(SLOT, env))
    assert problem is not None and "\n" not in problem
    assert problem.startswith("GPU 1 is GPU-11111111-1111-1111-1111-111111111111 to nvidia-smi, but CUDA")
    assert "opens GPU-00000000-0000-0000-0000-000000000000" in problem


def test_cuda_seeing_gpus_but_none_under_the_binding_is_refused(fake_torch: dict[str, str]) -> None:
    """An MPS server that leaves nvidia-smi's GPU 1 out: CUDA sees GPUs, none as CUDA_VISIBLE_DEVICES=1."""
    env = {**fake_torch, "FAKE_CUDA_UUIDS": "0=00000000-0000-0000-0000-000000000000"}
    seen = uuid_seen_by_cuda(SLOT, env)
    assert seen == NO_DEVICE
    problem = binding_problem(SLOT, seen)
    assert problem is not None and "sees no GPU, though it sees GPUs unbound" in problem and "\n" not in problem


def test_the_check_can_be_switched_off_and_skips_a_cpu_torch(monkeypatch) -> None:
    monkeypatch.setattr(cuda_binding.importlib.metadata, "version", lambda name: "2.13.0")
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert should_check()
    monkeypatch.setenv(SWITCH_ENV, "off")
    assert not should_check()
    monkeypatch.delenv(SWITCH_ENV)
    monkeypatch.setattr(cuda_binding.importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert not should_check()


def test_a_child_that_cannot_tell_refuses_nothing(fake_torch: dict[str, str], tmp_path: Path) -> None:
    assert uuid_seen_by_cuda(SLOT, {**fake_torch, "FAKE_CUDA_UUIDS": ""}) is None  # sees no CUDA device
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise RuntimeError('CUDA driver initialization failed')\n")
    assert uuid_seen_by_cuda(SLOT, {"PATH": os.environ["PATH"], "PYTHONPATH": str(broken)}) is None
    assert binding_problem(SLOT, None) is None
    assert binding_problem(Slot("n0", 0, "cuda", 1, "127.0.0.1", 1, (), cuda_index=0), "anything") is None


@pytest.mark.parametrize(("smi", "cuda", "same"), [
    ("GPU-11111111-1111-1111-1111-111111111111", "11111111-1111-1111-1111-111111111111", True),
    ("GPU-11111111-1111-1111-1111-111111111111", "GPU-11111111-1111-1111-1111-111111111111", True),
    ("GPU-ABCDEF01-1111-1111-1111-111111111111", "abcdef01-1111-1111-1111-111111111111", True),
    ("GPU-11111111-1111-1111-1111-111111111111", "11111111-1111-1111-1111-111111111112", False),
    ("MIG-11111111-1111-1111-1111-111111111111", "11111111-1111-1111-1111-111111111111", True),
])
def test_uuids_compare_without_nvidia_smis_prefix(smi: str, cuda: str, same: bool) -> None:
    assert same_gpu(smi, cuda) is same


@pytest.mark.parametrize(("version", "has"), [("2.13.0+cpu", False), ("2.13.0", True), ("2.13.0+cu126", True)])
def test_only_a_cuda_torch_is_asked(monkeypatch, version: str, has: bool) -> None:
    monkeypatch.setattr(cuda_binding.importlib.metadata, "version", lambda name: version)
    assert torch_has_cuda() is has
