"""At a CUDA slot worker's start: does CUDA, given the slot's binding, open the slot's own GPU?

Why: ranks are bound by nvidia-smi index (`CUDA_VISIBLE_DEVICES=<index>` with
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, `Slot.child_env`), because DeepSpeed reads that variable as integers
and the final `deepspeed --include` names GPUs the same way. Under MPS, and possibly inside device
cgroups, CUDA can number devices differently from nvidia-smi: a rank would then train on another
slot's GPU, two experiments would share one GPU and measure each other, and nothing would fail. So
the worker asks CUDA once, in a child process bound as its ranks will be (the worker itself never
opens a CUDA context), which GPU it got, and refuses to serve the slot when its UUID is not the
slot's. A torch without CUDA, or a child that cannot tell, is no reason to refuse: it is logged.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from workers.device.slot import Slot

#: What the child prints: the UUID of the one device CUDA sees, or nothing when it sees no CUDA.
PROBE = ("import torch\n"
         "if torch.cuda.is_available() and torch.cuda.device_count() == 1:\n"
         "    print(torch.cuda.get_device_properties(0).uuid)\n")
#: Asked only when the bound child saw nothing: how many GPUs CUDA sees unbound.
COUNT = "import torch\nprint(torch.cuda.device_count() if torch.cuda.is_available() else 0)\n"
#: `uuid_seen_by_cuda`'s answer when CUDA sees GPUs, but none under the slot's binding.
NO_DEVICE = "no device"
#: Well inside the embedded cluster's start-up limit, so a hung child is named, not a silent start.
PROBE_TIMEOUT_S = 30.0
#: Set to "off" where the check must not run (a fake GPU listing on a machine with real ones).
SWITCH_ENV = "AUTOTUNE_CUDA_BINDING_CHECK"


def should_check() -> bool:
    """Whether to ask CUDA at all: not where `SWITCH_ENV` is "off", nor with a CPU build of torch."""
    return os.environ.get(SWITCH_ENV, "").lower() != "off" and torch_has_cuda()


def torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, read from its distribution's version without
    importing it (a CPU wheel is `<version>+cpu`): a CPU torch needs no probe."""
    try:
        return not importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def uuid_seen_by_cuda(slot: Slot, env: dict[str, str] | None = None) -> str | None:
    """The UUID of the GPU CUDA opens for `slot`'s binding, asked in a child process; `NO_DEVICE`
    when CUDA sees GPUs but none under that binding (an MPS server that leaves it out); None when
    the child cannot tell (no CUDA at all, it failed or timed out)."""
    base = dict(os.environ if env is None else env)
    seen = _ask(PROBE, {**base, **slot.child_env()})
    if seen is not None:
        return seen
    unbound = {name: value for name, value in base.items() if name != "CUDA_VISIBLE_DEVICES"}
    count = _ask(COUNT, unbound)
    return NO_DEVICE if count is not None and count.isdigit() and int(count) > 0 else None


def _ask(code: str, env: dict[str, str]) -> str | None:
    """The last word the child printed, or None."""
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    words = done.stdout.split()
    return words[-1] if done.returncode == 0 and words else None


def same_gpu(nvidia_smi_uuid: str, cuda_uuid: str) -> bool:
    """nvidia-smi writes `GPU-<uuid>` (or `MIG-...`), torch the bare UUID."""
    def bare(text: str) -> str:
        text = text.strip().lower()
        return text.split("-", 1)[1] if text.startswith(("gpu-", "mig-")) else text
    return bare(nvidia_smi_uuid) == bare(cuda_uuid)


def binding_problem(slot: Slot, cuda_uuid: str | None) -> str | None:
    """Why `slot`'s binding opens another GPU than its own, or None (the same, or cannot tell)."""
    if not slot.gpu_uuid or cuda_uuid is None or same_gpu(slot.gpu_uuid, cuda_uuid):
        return None
    if cuda_uuid == NO_DEVICE:
        return (f"CUDA bound as a rank would be (CUDA_VISIBLE_DEVICES={slot.cuda_index}, CUDA_DEVICE_ORDER="
                f"PCI_BUS_ID) sees no GPU, though it sees GPUs unbound: it numbers them differently from "
                f"nvidia-smi (MPS, or a device cgroup), and GPU {slot.cuda_index} ({slot.gpu_uuid}) would "
                "be out of reach; run the workers where nvidia-smi and CUDA agree")
    return (f"GPU {slot.cuda_index} is {slot.gpu_uuid} to nvidia-smi, but CUDA bound as a rank would be "
            f"(CUDA_VISIBLE_DEVICES={slot.cuda_index}, CUDA_DEVICE_ORDER=PCI_BUS_ID) opens GPU-{cuda_uuid}: "
            "the two number GPUs differently (MPS, or a device cgroup), so ranks would train on another "
            "slot's GPU; run the workers where nvidia-smi and CUDA agree (without MPS, or with the MPS "
            "server seeing every GPU in PCI order)")
