"""Which launch's result counts: only the launch that holds its experiment now (a fencing token).

Each launch of an experiment carries its attempt token (with its gang reservation's owner token,
`scheduler.cluster.launches.RunningLaunch`). A launch can outlive its hold: its node was cut off
from Redis or froze for longer than its lease, or Redis lost its data, and the sweep launched the
experiment again elsewhere. Its ranks may still finish (they run on through a Redis outage by
design), and their chord callback still comes; `finish_experiment` asks `holds_experiment` under
the cluster lock before it writes anything, so such a launch is never recorded and never writes
metrics.json; its record goes to result.json, marked `stale`, only where the folder has none yet
(the replay skips it; a launch that holds the experiment writes over it). Its ranks wrote only
files named after their own launch (`workers.files.layout.LAUNCH_FILES`), so neither launch read
the other's metrics.

A launch the job does not know at all is the one case adopted without being the running launch:
after Redis lost its data the job was submitted again, and a launch that ran on through the restart
(its ranks took their slots back, `workers.state.gang.SlotLease`) answers its experiment when the job
has it neither running, queued nor recorded (`progress.launches_holding_slots` made it wait).

Both decisions read and write only the job's store (`stores.BaseJobStore`), so they are unit-tested
over its in-memory twin (tests/unit/test_finish_decisions.py).
"""
from __future__ import annotations

from scheduler.cluster.launches import FinishSpec
from scheduler.cluster.stores import BaseJobStore
from workers.slot.records import ExperimentRecord


def holds_experiment(store: BaseJobStore, finish: FinishSpec) -> bool:
    """Whether `finish`'s launch holds its experiment now in its job's `store`: it is the job's
    running launch of it (one read), or the job lost track of it and may adopt it (module docstring)."""
    launch = store.running_of([finish.name]).get(finish.name)
    if launch is not None:
        return launch.attempt == finish.attempt
    return _adoptable(store, finish.name)


def _adoptable(store: BaseJobStore, name: str) -> bool:
    """The job is active (its spec stored) and has the experiment neither queued nor recorded."""
    return bool(store.spec_json()) and name not in store.queued_names() and name not in store.recorded()


def adopted(store: BaseJobStore, finish: FinishSpec, record: ExperimentRecord) -> bool:
    """Record a launch its job does not know, when it may adopt it (module docstring): a launch
    that was retried or given up finds its experiment running, queued or recorded and stays stale."""
    name = finish.name
    if name in store.running_names() or not _adoptable(store, name):
        return False
    store.mark_recorded(name)
    store.publish({"kind": "record", "record": record.to_json()})
    return True
