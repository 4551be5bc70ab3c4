"""Where an experiment can run now: pure choice of slots, no Redis.

An experiment asks for `num_nodes x num_gpus` slots with at least `min_memory` bytes each, on
distinct nodes when it spans several, and only among its job's resource pool (`allowed`) when it
has one. Real device ids are kept (DeepSpeed renumbers them), and nodes of different sizes are all
usable (DeepSpeed truncates every node to the smallest).
Two rules keep a gang runnable: its slots are all of one kind (CUDA ranks use NCCL, CPU ranks gloo;
one process group cannot mix them, and a search sized for GPU memory means nothing on a CPU slot),
and a gang spanning nodes never uses a slot whose address is loopback (its peers could not reach it),
unless all of the gang's slots are on one machine (the same `Slot.host`). On a node, a gang's GPUs
are taken from one NUMA node when one has enough free (`Slot.numa_node`, workers.device.topology): across
the sockets of a two-socket node GPUs have no PCIe peer-to-peer, and the experiment would measure
the placement, not the config; within it, the GPUs whose slowest link is fastest (NVLink pairs
before PCIe neighbours, `best_linked`).
"""
from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable
from itertools import combinations
from operator import attrgetter

from scheduler.errors import ClusterError
from workers.device.slot import Slot
from workers.device.topology import link_rank, worst_link


#: Slot kinds in the order an experiment that does not name one tries them.
KINDS = ("cuda", "cpu")
_NODE_DEVICE = attrgetter("node", "device")  #: the order slots are taken in (C, not a lambda: a pass sorts often)


def place(slots: list[Slot], busy: set[str], num_nodes: int, num_gpus: int,
          min_memory: int = 0, kind: str = "", exclusive: bool = False,
          allowed: frozenset[str] | None = None, ordered: bool = False) -> list[list[Slot]] | None:
    """One list of `num_gpus` free slots per node for `num_nodes` nodes, or None if it does not fit now.

    All slots are of `kind` ("" = of any one kind, CUDA first). Nodes are taken in name order and
    devices in id order, so the same cluster state always gives the same placement (reproducible
    experiments, readable logs). `exclusive`: only nodes on which no slot at all is busy (the
    experiment is to be measured with its nodes otherwise idle). `allowed`: only these slot queues
    (the job's resource pool, `scheduler.launch.pool`; None = every slot). `ordered`: `slots` are
    already in that order (`in_order`), as a policy placing many items sorts them once.
    """
    nodes = _fitting_nodes(slots, busy, num_nodes, num_gpus, min_memory, kind, exclusive, allowed, ordered)
    return None if nodes is None else [_compact(free, num_gpus) for free in nodes]


def _fitting_nodes(slots: list[Slot], busy: set[str], num_nodes: int, num_gpus: int, min_memory: int, kind: str,
                   exclusive: bool, allowed: frozenset[str] | None, ordered: bool = False) -> list[list[Slot]] | None:
    """The free usable slots of the first `num_nodes` nodes (name order) with `num_gpus` of them, or
    None. Only the nodes taken are compacted by `place`: choosing GPUs by their links costs up to
    C(16, k) subsets a node, which over every fitting node of a large cluster was most of a pass."""
    in_turn = slots if ordered else in_order(slots)
    occupied = {s.node for s in slots if s.queue in busy} if exclusive else set()
    for candidate in ((kind,) if kind else KINDS):
        usable = [s for s in in_turn if s.queue not in busy and s.memory_bytes >= min_memory and s.kind == candidate
                  and s.node not in occupied and (allowed is None or s.queue in allowed)]
        for pool in _reachable_pools(usable, num_nodes):
            free_by_node: dict[str, list[Slot]] = defaultdict(list)
            for slot in pool:
                free_by_node[slot.node].append(slot)
            chosen = [free for _, free in sorted(free_by_node.items()) if len(free) >= num_gpus][:num_nodes]
            if len(chosen) == num_nodes:
                return chosen
    return None


def in_order(slots: Iterable[Slot]) -> list[Slot]:
    """`slots` by node name, then device id: the order `place` takes them in."""
    return sorted(slots, key=_NODE_DEVICE)


def _compact(free: list[Slot], count: int) -> list[Slot]:
    """`count` of a node's free slots (in device order): from the first NUMA node (by its lowest free
    device) that has `count` free, else from all of them (a gang larger than a NUMA node, or
    unknown NUMA nodes, which all count as one); among those, the set whose slowest GPU link is
    fastest (`best_linked`)."""
    groups: dict[int, list[Slot]] = defaultdict(list)
    for slot in free:
        groups[slot.numa_node].append(slot)
    whole = [group for group in groups.values() if len(group) >= count]
    return best_linked(min(whole, key=lambda group: group[0].device) if whole else free, count)


#: Above this many candidate GPUs the sets are not enumerated (a node has at most 8-16).
MAX_LINK_CANDIDATES = 16


def best_linked(candidates: list[Slot], count: int) -> list[Slot]:
    """The first `count` candidates (device order) whose slowest pairwise link (`Slot.links`,
    workers.device.topology) is fastest: on a node whose GPUs are NVLinked in pairs or islands, a gang of two
    takes a linked pair rather than two GPUs that only meet over PCIe. Unknown links: the first `count`."""
    if count < 2 or len(candidates) <= count or len(candidates) > MAX_LINK_CANDIDATES \
            or not any(slot.links for slot in candidates):  # no links known: every set ties
        return candidates[:count]
    best, best_rank = candidates[:count], _slowest(candidates[:count])
    for subset in combinations(candidates, count):
        rank = _slowest(list(subset))
        if rank > best_rank:
            best, best_rank = list(subset), rank
    return best


def gang_link(slots: list[Slot]) -> str:
    """The slowest GPU link inside one node's part of a gang ("" for one GPU, or unknown links)."""
    return worst_link(a.link_to(b) for a, b in combinations(slots, 2)) if len(slots) > 1 else ""


def _slowest(slots: list[Slot]) -> int:
    return min((link_rank(a.link_to(b)) for a, b in combinations(slots, 2)), default=-1)


def _reachable_pools(slots: list[Slot], num_nodes: int) -> list[list[Slot]]:
    """Groups of slots whose ranks can all reach each other: any slots for a one-node gang; for
    several nodes, the slots with routable addresses, then each machine's own slots (its "nodes"
    meet over loopback)."""
    if num_nodes == 1:
        return [slots]
    pools = [[s for s in slots if not is_loopback(s.address)]]
    for host in sorted({s.host for s in slots if s.host}):
        pools.append([s for s in slots if s.host == host])
    return pools


def is_loopback(address: str) -> bool:
    """127.x, ::1 or "localhost": an address only this node can reach."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def pinned_placement(slots: list[Slot], busy: set[str], queues_per_node: list[list[str]]) -> list[list[Slot]] | None:
    """Exactly the named slot queues (one list per node), or None while any of them is busy.

    Raises ClusterError when a named slot has no live worker: waiting would never end.
    """
    by_queue = {slot.queue: slot for slot in slots}
    missing = [q for node in queues_per_node for q in node if q not in by_queue]
    if missing:
        raise ClusterError(f"no live slot worker for {', '.join(missing)}: start "
                           f"`celery -A tasks worker -Q gpu<i> -n gpu<i>@<host>` there, or change the selection")
    if any(q in busy for node in queues_per_node for q in node):
        return None
    return [[by_queue[q] for q in node] for node in queues_per_node]


def largest_shape(slots: list[Slot]) -> tuple[int, int]:
    """(nodes, slots on the biggest node): the most any single experiment could ask for here."""
    per_node: dict[str, int] = defaultdict(int)
    for slot in slots:
        per_node[slot.node] += 1
    return len(per_node), max(per_node.values(), default=0)


def fits_ever(slots: list[Slot], num_nodes: int, num_gpus: int, min_memory: int = 0, kind: str = "",
              allowed: frozenset[str] | None = None) -> bool:
    """Whether the shape could run on this cluster (within `allowed`) at all, once every slot is free."""
    return _fitting_nodes(slots, set(), num_nodes, num_gpus, min_memory, kind, False, allowed) is not None
