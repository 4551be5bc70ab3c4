"""The GPUs of this node as nvidia-smi lists them, and which of them a process may use.

Why: the worker never initialises CUDA (a CUDA context per worker would cost device memory on the
very device it offers), so nvidia-smi is the only source of what a node has. Its output is read
strictly: a listing this code cannot read, a MIG-enabled GPU a worker would serve or a
CUDA_VISIBLE_DEVICES naming a device that does not exist is a one-line refusal at start-up, never a
silent CPU slot on a GPU node. A MIG GPU refuses only the slot worker that would serve it (and the
commands that would use every GPU: the embedded cluster, `scheduler.resources`), never its
neighbours' workers.

Device numbers: nvidia-smi's index is the PCI bus order. Every process we start gets
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, so CUDA numbers devices the same way, and numeric entries of an
inherited CUDA_VISIBLE_DEVICES are read as those indices. Entries may also be GPU UUIDs (or a
unique prefix of one, as CUDA accepts).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

#: Fields asked of nvidia-smi, in this order.
QUERY = "index,uuid,memory.total,mig.mode.current"
#: Set to "cpu" to offer CPU slots on a node that has nvidia-smi (a GPU box used for CPU tests).
DEVICE_KIND_ENV = "AUTOTUNE_DEVICE_KIND"


class GpuListingError(ValueError):
    """This node's GPUs cannot be used as listed; the message is one line saying what to change."""


@dataclass(frozen=True)
class Gpu:
    """One physical GPU: its PCI-order index (what children's CUDA_VISIBLE_DEVICES names) and size."""

    index: int
    uuid: str
    memory_bytes: int
    mig: bool = False  #: MIG mode enabled: refused as a slot, but only where this worker would use it


def parse_listing(text: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits` output."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            raise GpuListingError(f"nvidia-smi printed a line this tool cannot read: {line.strip()[:120]!r} "
                                  f"(expected {QUERY}); check the driver with `nvidia-smi`")
        index, uuid, memory, mig = fields
        if not index.isdigit() or not uuid.startswith("GPU-"):
            raise GpuListingError(f"nvidia-smi listed a GPU with index {index!r} and UUID {uuid!r}, which this "
                                  "tool cannot read; check the driver with `nvidia-smi`")
        try:
            mib = float(memory)
        except ValueError:
            mib = -1.0
        if not mib > 0 or mib != mib or mib == float("inf"):
            raise GpuListingError(f"nvidia-smi reports GPU {index}'s memory as {memory!r}, not a number of MiB; "
                                  "check the driver with `nvidia-smi`")
        gpus.append(Gpu(int(index), uuid, int(mib) * 1024**2, mig=mig.lower() == "enabled"))
    if len({gpu.index for gpu in gpus}) != len(gpus):
        raise GpuListingError("nvidia-smi listed the same GPU index twice; check the driver with `nvidia-smi`")
    return sorted(gpus, key=lambda gpu: gpu.index)


def refuse_mig(gpus: list[Gpu]) -> list[Gpu]:
    """`gpus` unchanged, or GpuListingError for the first with MIG enabled. Called on the GPUs that
    will be used (a slot worker's one GPU; every visible GPU for the embedded cluster), after
    CUDA_VISIBLE_DEVICES: a MIG GPU left out, or served by another worker, is no concern."""
    for gpu in gpus:
        if gpu.mig:
            raise GpuListingError(f"GPU {gpu.index} has MIG enabled; MIG instances are not supported as slots: "
                                  f"disable MIG (`nvidia-smi -i {gpu.index} -mig 0`) or leave that GPU out of "
                                  "CUDA_VISIBLE_DEVICES")
    return gpus


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a process sees, in its own device order, given its CUDA_VISIBLE_DEVICES (None: all)."""
    if cuda_visible_devices is None:
        return list(gpus)
    seen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if not entry:
            continue
        if entry.startswith("MIG-"):
            raise GpuListingError(f"CUDA_VISIBLE_DEVICES names the MIG instance {entry}; MIG instances are not "
                                  "supported as slots: name whole GPUs")
        if entry.isdigit():
            match = [gpu for gpu in gpus if gpu.index == int(entry)]
        else:
            match = [gpu for gpu in gpus if gpu.uuid.startswith(entry) or gpu.uuid == f"GPU-{entry}"]
        if len(match) != 1:
            known = ", ".join(str(gpu.index) for gpu in gpus) or "none"
            raise GpuListingError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices} names {entry!r}, which is "
                                  f"{'ambiguous' if match else 'not a GPU of this node'} (GPUs: {known}); fix it")
        if match[0] not in seen:
            seen.append(match[0])
    return seen


def local_gpus() -> list[Gpu] | None:
    """The GPUs this process may use (honouring CUDA_VISIBLE_DEVICES), or None on a node without
    nvidia-smi, with AUTOTUNE_DEVICE_KIND=cpu or with CUDA_VISIBLE_DEVICES empty (a CPU node then).
    Raises GpuListingError when the listing is unusable. MIG-enabled GPUs are listed (`Gpu.mig`):
    whoever would use one refuses it (`refuse_mig`)."""
    if os.environ.get(DEVICE_KIND_ENV, "").lower() == "cpu" or not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GpuListingError(f"nvidia-smi could not run ({exc}); fix the driver, or set "
                              f"{DEVICE_KIND_ENV}=cpu to use CPU slots") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise GpuListingError(f"nvidia-smi failed (exit {done.returncode}: {said[0][:120] if said else 'no output'}); "
                              f"fix the driver, or set {DEVICE_KIND_ENV}=cpu to use CPU slots")
    gpus = parse_listing(done.stdout)
    if not gpus:
        raise GpuListingError(f"nvidia-smi lists no GPU; fix the driver, or set {DEVICE_KIND_ENV}=cpu "
                              "to use CPU slots")
    return visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) or None


def parse_memory_used(text: str, gpu: str) -> int | None:
    """The used memory in bytes of `gpu` (its UUID, or its index as a string) from `nvidia-smi
    --query-gpu=index,uuid,memory.used --format=csv,noheader,nounits` output, or None when the output
    does not say."""
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3 and gpu in (fields[0], fields[1]):
            try:
                mib = float(fields[2])
            except ValueError:
                return None
            return int(mib * 1024**2) if 0 <= mib < float("inf") else None
    return None


def query(fields: str, gpu: str | None = None) -> str | None:
    """`nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` (of `gpu` only, its UUID or
    index, when given): its output, or None when it cannot run, fails or times out. For the facts a
    worker reads besides its listing, where "cannot tell" is an answer and never a reason to refuse."""
    argv = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(argv + ([] if gpu is None else ["-i", gpu]), capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def memory_used(gpu: str) -> int | None:
    """How much memory is in use on `gpu`, named by its UUID (`Slot.nvidia_smi_id`: the name no
    renumbering changes, under MPS or in device cgroups) or index; None when
    nvidia-smi cannot tell (it failed, timed out or printed something else): then nothing is waited for."""
    text = query("index,uuid,memory.used", gpu)
    return None if text is None else parse_memory_used(text, gpu)
