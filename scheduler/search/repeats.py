"""Launching a config again: once after a failure that says nothing about it, and to confirm a winner.

Why its own module: every search of ours follows one policy (a failure that says nothing is retried
once, a winner is confirmed before it is named), and the sampled search, a micro-batch list and full
mode's knob points all run it; DeepSpeed's own algorithm (`"search": "deepspeed"`) keeps DeepSpeed's
behaviour (a crash is that config's result, the best single reading wins), and the summary says so
(`policy_notes`).

- a failure that says nothing about the config (`RETRIED`: a crash, a timeout, a rendezvous that
  failed; or an out-of-memory while other processes held memory on its GPU, `says_nothing`) is
  launched once more as `<name>_r2`, its own folder and record (`relaunch`); a config failing twice
  counts as failed;
- `confirm`: no config is named on one reading. The leader is measured again, then the rivals it is
  not separated from at the measured noise (`scheduler.search.confirm.next_repeat`), one launch per
  phase, each with its nodes otherwise idle (`Experiment.exclusive`), within `REPEAT_BUDGET` (with a
  kept global batch, up to `KEPT_BATCH_LAUNCHES` launches in all: `confirm.repeat_budget`, and a
  config read once at half the leader's reading or more is a rival too: `confirm.doubtful`), and a
  leader still read once, or a config whose two readings are `confirm.torn` (not with a kept batch:
  `confirm.past_budget`), gets up to `READ_ONCE_GRACE` launches more; whenever nothing else is due
  (the leader confirmed, or those launches spent), a leader read once, or twice and torn, or a config
  ranked at its stage's curve that would lead on its own readings (`scheduler.search.ceilings`) is
  measured again, up to three readings each (`confirm.unsettled_leader`); then a smaller config
  of the leader's curve read once whose reading bounds the leader below its value is read once
  more (`_leaders_witness`: its bound becomes firm, or its reading was a straggler's); the winner
  is the best pooled value of every reading (`scheduler.search.ranking.best` pools repeats: a mean,
  a median from three, capped at its stage's curve where that contradicts them).
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from scheduler.search.confirm import (READ_ONCE_GRACE, Readings, group_readings, next_repeat, ordered, past_budget,
                                      repeat_budget, unsettled_leader)
from scheduler.search.ceilings import SETTLED_READINGS, bound_witnesses
from scheduler.search.ranking import curve_ceilings, curve_points, metric_value
from scheduler.search.session import Session, Step, under_foreign_memory
from scheduler.search.space import PROFILE, Experiment

#: Failures that say nothing about the config: launched once more before the config counts as failed.
#: Not `lost` (the dispatcher already relaunches those, up to its max_attempts) nor `aborted` (we
#: stopped it: a cancelled job must end, not start its experiments again).
RETRIED = frozenset({"crashed", "timeout", "rendezvous_failed"})
#: A re-measurement of `<name>` is `<name>_r2`, `<name>_r3`, ...: its own folder and record.
REPEAT_NAME = re.compile(r"^(?P<original>.+)_r(?P<index>[2-9]|[1-9][0-9]+)$")


def says_nothing(record: Mapping[str, Any]) -> bool:
    """Whether a failed launch says nothing about its config, so it is launched once more: a
    `RETRIED` status, or an out-of-memory while other processes held memory on its GPU
    (`session.under_foreign_memory`: a notebook, another job, a context still being torn down),
    which is no memory bound either (`session.too_large`)."""
    status = record.get("status")
    return status in RETRIED or (status == "oom" and under_foreign_memory(record))


def original_name(name: str, measured: Mapping[str, Any]) -> str:
    """The experiment `name` re-measures (`<original>_r<n>` of an experiment in `measured`), else `name`."""
    match = REPEAT_NAME.match(name)
    return match["original"] if match and match["original"] in measured else name


def is_repeat(name: str, measured: Mapping[str, Any]) -> bool:
    """Whether `name` is a re-measurement (`<original>_r<n>`) of an experiment in `measured`."""
    return original_name(name, measured) != name


def relaunch(session: Session, label: str, experiments: Sequence[Experiment]) -> Step:
    """Measure `experiments` as one phase, then launch those whose failure `says_nothing` once more
    (`<name>_r2`, together in a phase `<label>_retry`); returns each experiment's record, the retry's
    in place of a failure it relaunched. Under `"search": "deepspeed"` nothing is relaunched."""
    records = yield from session.measure(label, experiments)
    if session.settings.search != "sampled":
        return records
    again = [(i, replace(exp, name=f"{exp.name}_r2")) for i, (exp, record) in enumerate(zip(experiments, records))
             if says_nothing(record)]
    if not again:
        return records
    retried = yield from session.measure(f"{label}_retry", [exp for _, exp in again])
    out = list(records)
    for (index, _), record in zip(again, retried):
        out[index] = record
    return out


def confirm(session: Session) -> Step:
    """Measure the leader and the rivals it is not yet separated from, one launch per phase, until
    `scheduler.search.confirm.next_repeat` is satisfied or the budget (`confirm.repeat_budget`) is
    spent; past it, only a leader read once or a `torn` config is measured again (`confirm.past_budget`, up
    to READ_ONCE_GRACE launches more; a torn pair is looked for even where `next_repeat` is
    satisfied: on a lower-is-better metric a straggler's reading can make its config look separated);
    whenever nothing else is due (the leader confirmed, or those launches spent), a leader read once,
    or read twice and torn, or a config ranked at its stage's curve that would lead on its readings,
    is measured again (`confirm.unsettled_leader`: no winner on one reading nor on a torn pair, and a
    lucky pair settled or not; up to SETTLED_READINGS readings each, so it ends). One at a time: the
    originals ran alone, so must the repeats."""
    st = session.settings
    budget = repeat_budget(len(session.measured), bool(st.kept_per_gpu))
    for spent in itertools.count(1):
        originals: dict[str, Experiment] = {}
        readings: dict[str, list[float]] = {}
        steps: dict[str, list[list[float] | None]] = {}
        launched: dict[str, int] = {}
        for name, (exp, record) in session.measured.items():
            if exp.space == PROFILE:
                continue
            original = original_name(name, session.measured)
            if original == name:
                originals[name] = exp
            launched[original] = launched.get(original, 0) + 1
            value = metric_value(record, st.metric)
            if value is not None:
                readings.setdefault(original, []).append(value)
                steps.setdefault(original, []).append(record.get("step_seconds"))
        caps = curve_ceilings({key: (originals[key].ds_config, values) for key, values in readings.items()},
                              st.maximize)
        groups = group_readings(readings, steps, caps)
        key = next_repeat(groups, st.maximize, doubt_once=bool(st.kept_per_gpu))
        if spent > budget and groups:
            key = past_budget(groups, st.maximize, bool(st.kept_per_gpu))
        if spent > budget + READ_ONCE_GRACE:
            key = None
        if key is None and groups:
            key = unsettled_leader(groups, st.maximize)
            key = key if key is not None and launched[key] == len(readings[key]) < SETTLED_READINGS else None
        if key is None and groups:
            key = _leaders_witness(groups, originals, readings, launched, st.maximize)
        if key is None:
            return
        exp = originals[key]
        repeat = Experiment(f"{exp.name}_r{launched[key] + 1}", exp.stage, exp.micro_batch_size,
                            exp.gradient_accumulation_steps, exp.ds_config, exp.num_nodes, exp.num_gpus,
                            exp.tuning_space, exclusive=True, strategy=exp.strategy)
        yield from session.measure(f"confirm_{spent}", [repeat])


def _leaders_witness(groups: Sequence[Readings[str]], originals: Mapping[str, Experiment],
                     readings: Mapping[str, Sequence[float]], launched: Mapping[str, int],
                     maximize: bool) -> str | None:
    """The config read once whose reading bounds the leader below its value
    (`scheduler.search.ceilings.bound_witnesses`): read again, its bound is firm and ranks the
    leader at it, or it was a straggler's and the leader stands. None otherwise."""
    leader = ordered(groups, maximize)[0].key
    points = curve_points({key: (originals[key].ds_config, values) for key, values in readings.items()})
    witness = bound_witnesses(points).get(leader) if maximize else None
    return witness if witness is not None and launched[witness] == 1 else None
