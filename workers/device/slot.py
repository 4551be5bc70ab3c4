"""What a slot is, what it can hold, and how a child process is bound to it.

A slot is one device of one node, served by one Celery worker through the queue `<node>.gpu<i>`.
On a GPU node `gpu<i>` is the node's i-th usable GPU (`workers.device.gpus`: nvidia-smi, honouring an
inherited CUDA_VISIBLE_DEVICES), the capacity is its memory as nvidia-smi reports it, and the worker
never initialises CUDA itself; a rank sees its gang's GPUs on the node (see `Slot.child_env`). On a node
without GPUs, `gpu<i>` is a CPU slot: a memory cap (AUTOTUNE_SLOT_MEMORY, default total RAM /
slots) that our monitor enforces, and a thread budget (cores / slots) with CPU affinity.

The slot memory is the device's memory as the search sees it: on a CPU slot that is host memory, so
it caps each rank's RSS; on a GPU slot it is the GPU's, and AUTOTUNE_SLOT_MEMORY does not touch it
nor the ranks' host memory (a `--slot-memory 1.25GiB` copied from a CPU example would otherwise end
every GPU rank that loads a real model as a false `oom`). A GPU rank's host memory is capped only
when its user asks by name: AUTOTUNE_HOST_MEMORY_CAP (`--host-memory-cap`).

Environment read here (all optional):
    AUTOTUNE_NODE             node name (default: the worker's --hostname node part, else the host name)
    AUTOTUNE_ADDRESS          address other nodes use to reach this node (default: the interface
                              that routes to Redis)
    AUTOTUNE_SLOT_MEMORY      memory per CPU slot, e.g. "3GiB": its capacity and its ranks' RSS cap
                              (GPU slots ignore it: their capacity is the GPU's memory)
    AUTOTUNE_HOST_MEMORY_CAP  RSS cap of each rank on a GPU slot, e.g. "64GiB" (default: none;
                              CPU slots ignore it: AUTOTUNE_SLOT_MEMORY is theirs)
    AUTOTUNE_SLOTS_PER_NODE   slots sharing this node's RAM and cores (CPU default: number of cores)
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass
from functools import cached_property

import psutil

from workers.device.gpus import GpuListingError, local_gpus, refuse_mig
from workers.device.topology import gpu_bus_ids, gpu_links, node_cpus, numa_node_of

_QUEUE = re.compile(r"^(?:(?P<node>[A-Za-z0-9_.-]+)\.)?gpu(?P<device>\d+)$")
_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?i?B?)?\s*$", re.IGNORECASE)
#: The one setting that caps a GPU rank's host memory (RSS); `--host-memory-cap` of the embedded cluster.
HOST_MEMORY_CAP_ENV = "AUTOTUNE_HOST_MEMORY_CAP"
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from '3GiB', '512MiB', '2G', '1500000000'. ValueError on anything else."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 3GiB, 512MiB, 2G or a byte count)")
    unit = (match["unit"] or "").upper().removesuffix("B")
    if unit not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 3GiB, 512MiB, 2G or a byte count)")
    return int(float(match["num"]) * _UNITS[unit])


def parse_queue(queue: str) -> tuple[str | None, int] | None:
    """('node2', 0) from 'node2.gpu0', (None, 0) from the bare 'gpu0', None for other queues."""
    match = _QUEUE.match(queue)
    if not match:
        return None
    return match["node"], int(match["device"])


def slot_queue(node: str, device: int) -> str:
    return f"{node}.gpu{device}"


def node_name(worker_hostname: str | None) -> str:
    """AUTOTUNE_NODE, else the node part of the worker's `name@node`, else this host's name."""
    if os.environ.get("AUTOTUNE_NODE"):
        return os.environ["AUTOTUNE_NODE"]
    if worker_hostname and "@" in worker_hostname:
        return worker_hostname.split("@", 1)[1]
    return socket.gethostname()


def address_towards(host: str, port: int) -> str:
    """AUTOTUNE_ADDRESS, else the local address of the interface that routes to (host, port)."""
    if os.environ.get("AUTOTUNE_ADDRESS"):
        return os.environ["AUTOTUNE_ADDRESS"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


@dataclass(frozen=True)
class Slot:
    """One (node, device) as the scheduler sees it, registered in Redis by its worker."""

    node: str
    device: int
    kind: str  #: "cuda" or "cpu"
    memory_bytes: int  #: what an experiment may use on this slot
    address: str  #: how ranks on other nodes reach this node (rank 0's MASTER_ADDR)
    threads: int  #: CPU threads an experiment on this slot should use
    cpus: tuple[int, ...]  #: cores the slot's children are pinned to (CPU slots: its own; CUDA: its GPU's NUMA node's)
    worker: str = ""  #: Celery nodename of the worker serving the slot
    instance: str = ""  #: new at every worker start: a changed value means the worker restarted
    cuda_index: int = -1  #: CUDA slots: the GPU's nvidia-smi (PCI bus order) index; -1 on CPU slots
    host: str = ""  #: the machine's identity (machine-id): "nodes" sharing it can meet over loopback
    gpu_uuid: str = ""  #: CUDA slots: the GPU's UUID, which no other slot of the same host may serve
    numa_node: int = -1  #: CUDA slots: the GPU's NUMA node (workers.device.topology; -1: unknown)
    #: CUDA slots: (other GPU's index, link class) for the node's other GPUs (`nvidia-smi topo -m`)
    links: tuple[tuple[int, str], ...] = ()

    @cached_property
    def queue(self) -> str:
        """`<node>.gpu<i>` (computed once: placement reads it for every slot on every decision)."""
        return slot_queue(self.node, self.device)

    @property
    def host_memory_cap(self) -> int | None:
        """The RSS cap our monitor enforces: on CPU slots the slot memory, on GPU slots only what
        AUTOTUNE_HOST_MEMORY_CAP asks (never the slot memory: see the module docstring)."""
        if self.kind == "cpu":
            return self.memory_bytes
        explicit = os.environ.get(HOST_MEMORY_CAP_ENV)
        return parse_size(explicit) if explicit else None

    @property
    def nvidia_smi_id(self) -> str:
        """How nvidia-smi (`-i`) is asked about this slot's GPU: its UUID, else its index."""
        return self.gpu_uuid or str(self.cuda_index)

    def to_redis(self) -> dict[str, str]:
        fields = asdict(self)
        fields["cpus"] = ",".join(map(str, self.cpus))
        fields["links"] = ",".join(f"{index}:{link}" for index, link in self.links)
        return {key: str(value) for key, value in fields.items()}

    @classmethod
    def from_redis(cls, fields: dict[str, str]) -> Slot:
        return cls(
            node=fields["node"], device=int(fields["device"]), kind=fields["kind"],
            memory_bytes=int(fields["memory_bytes"]), address=fields["address"],
            threads=int(fields["threads"]),
            cpus=tuple(int(c) for c in fields.get("cpus", "").split(",") if c),
            worker=fields.get("worker", ""), instance=fields.get("instance", ""),
            cuda_index=int(fields.get("cuda_index", -1)), host=fields.get("host", ""),
            gpu_uuid=fields.get("gpu_uuid", ""), numa_node=int(fields.get("numa_node", -1)),
            links=tuple((int(index), link) for index, _, link in
                        (pair.partition(":") for pair in fields.get("links", "").split(",") if pair)
                        if index.isdigit()),
        )

    def link_to(self, other: Slot) -> str:
        """The link class between this slot's GPU and `other`'s ("" when unknown)."""
        return self._link_by_index.get(other.cuda_index, "")

    @cached_property
    def _link_by_index(self) -> dict[int, str]:
        return dict(self.links)

    def child_env(self, cuda_devices: list[str] | None = None) -> dict[str, str]:
        """Variables that bind a training process to this slot. A rank of a multi-GPU experiment sees
        `cuda_devices`, its gang's GPUs on this node in local-rank order (its own among them), so
        LOCAL_RANK indexes its own device as under torchrun and NCCL can use P2P between them.
        GPUs are named by their nvidia-smi index with CUDA_DEVICE_ORDER=PCI_BUS_ID (the order
        nvidia-smi lists them in), as DeepSpeed's launcher names them from `--include` and as
        cmd_optimal.txt's run will: DeepSpeed itself reads CUDA_VISIBLE_DEVICES as integers (ZeRO-1/2's
        `available_memory` with pynvml installed, `_get_nvml_gpu_id`), so GPU UUIDs there crashed
        every ZeRO-1/2 experiment on such a node."""
        env = {"AUTOTUNE_SLOT": self.queue, "OMP_NUM_THREADS": str(self.threads),
               "MKL_NUM_THREADS": str(self.threads)}
        if self.kind == "cuda":
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda_devices or [str(self.cuda_index)])
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
        return env


def machine_id() -> str:
    """This machine's identity: systemd's machine-id, else the host name. Two workers with the same
    one run on the same machine, whatever node names they were given."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()


def rank_threads(cores: int, slots: int) -> int:
    """CPU threads per rank: the worker's own OMP_NUM_THREADS when its user set one (tuning then
    measures what they will train with, and cmd_optimal.txt writes that value), else the slot's
    share of the node's cores, so the node's slots do not oversubscribe it."""
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(1, cores // slots)


def cpu_slot_memory(slots: int, explicit: str | None) -> int:
    """A CPU slot's memory cap: `explicit` (AUTOTUNE_SLOT_MEMORY, e.g. "3GiB") when set, else the node's
    RAM shared by its `slots`. The autotuner predicts its embedded cluster's slots with the same rule."""
    return parse_size(explicit) if explicit else psutil.virtual_memory().total // slots


def describe_local_slot(node: str, device: int, address: str, worker: str = "") -> Slot:
    """The slot this node offers as device `device`: its `device`-th usable GPU when nvidia-smi lists
    GPUs (GpuListingError when there is no such GPU, it has MIG enabled or the listing is unusable),
    else a CPU slot."""
    cores = os.cpu_count() or 1
    gpus = local_gpus()
    if gpus is not None:
        if device >= len(gpus):
            raise GpuListingError(f"gpu{device}: this node offers {len(gpus)} GPU(s) (nvidia-smi indices "
                                  f"{', '.join(str(g.index) for g in gpus)}); start slot workers gpu0.."
                                  f"gpu{len(gpus) - 1} only")
        gpu = refuse_mig([gpus[device]])[0]  # only the GPU this worker serves: a MIG neighbour is no concern
        slots = int(os.environ.get("AUTOTUNE_SLOTS_PER_NODE", "0")) or len(gpus)
        threads = rank_threads(cores, slots)
        numa = numa_node_of(gpu_bus_ids().get(gpu.index))
        links = tuple(sorted(gpu_links().get(gpu.index, {}).items()))
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(cores))
        local = tuple(core for core in node_cpus(numa) if core in allowed)  # the GPU's socket, within our cgroup
        return Slot(node, device, "cuda", gpu.memory_bytes, address, threads, local, worker, cuda_index=gpu.index,
                    host=machine_id(), gpu_uuid=gpu.uuid, numa_node=numa, links=links)
    slots = int(os.environ.get("AUTOTUNE_SLOTS_PER_NODE", "0")) or cores
    memory = cpu_slot_memory(slots, os.environ.get("AUTOTUNE_SLOT_MEMORY"))
    share = max(1, cores // slots)
    threads = rank_threads(cores, slots)
    first = (device * share) % cores
    cpus = tuple(sorted({(first + i) % cores for i in range(share)}))
    return Slot(node, device, "cpu", memory, address, threads, cpus, worker, host=machine_id())
