"""What one stage of the sampled search can hold, and the sizes worth measuring in it.

Why its own module: the memory side of the search (the largest size worth probing, the step a
stage's configs fill, the accumulation of each size) is read by the generators
(`scheduler.search.sampled_search`) and by what the readings say (`scheduler.search.stage_readings`);
here it sits below both. Functions of a `Session`, no phases.
"""
from __future__ import annotations

from scheduler.search.global_batch import kept_sizes, largest_kept
from scheduler.search.sampling import full_step_sizes, geometric_mid
from scheduler.search.session import Session
from scheduler.search.space import PROFILE


#: A stage stops probing upward after this many failed probes (the issue's target: at most 2).
MAX_FAILURES = 2
#: Before any size of the job ran, the top is halved after each failure up to this many times: a
#: profile that understates the activations can over-predict the top by 2-4x. Once a stage ran
#: something, another stage's top is predicted from it, and gets MAX_FAILURES.
MAX_BLIND_FAILURES = 3
#: The share of the memory budget the top probe may fill. Closer to 1 than memory.SAFETY: the
#: budget already leaves out the untracked reserve, the line is fitted on two of the stage's own
#: sizes before the top is probed, and a failure only costs one launch and bounds the stage.
TOP_SAFETY = 0.98
#: Without max_train_batch_size the top also sets the step every smaller size fills (DeepSpeed's
#: rule), so a margin below the budget costs throughput on every step of the real run, while a
#: failed probe costs one launch: the whole budget.
TOP_SAFETY_UNBOUNDED = 1.0


def stage_candidates(session: Session, stage: int) -> list[int]:
    """The sizes worth measuring in the stage now: the full-step sizes of its space, and its top (with
    a kept global batch, the sizes dividing its share: `global_batch.kept_sizes`).
    Without max_train_batch_size the space ends at the largest size known to run; a top above it
    is probed at the user's gas and, once it runs, widens the space."""
    top = stage_top(session, stage)
    step = samples_per_step(session, stage)
    if session.settings.kept_per_gpu:
        return kept_sizes(step, session.settings.min_micro_batch_size, top)
    if session.settings.samples_per_step:
        return full_step_sizes(step, top)
    known = min(top, known_feasible(session, stage) or top)
    return full_step_sizes(step, known) + ([top] if top > known else [])


def samples_per_step(session: Session, stage: int) -> int:
    """The samples per GPU per optimizer step a stage's configs fill (the space searched).

    With max_train_batch_size, what it allows. Without it, DeepSpeed's rule (its mtbpg): the stage's
    largest feasible micro-batch times the user's gas, so a size below the top gets the accumulation
    that fills the same step. Feasible means known to run (`known_feasible`): every stage runs
    its top first (`sampled_search.anchor`, at the user's gas, which the predicted top stands in for until then),
    so the step never outgrows what the stage can hold. A stage measured only at another stage's
    config (`stage_follow._leads_at`) fills that config's step until its own top ran.
    """
    st = session.settings
    if st.samples_per_step:
        return st.samples_per_step
    top = known_feasible(session, stage)
    if not top:  # measured only at another stage's config (its top not run yet): the step it filled there
        filled = [exp.micro_batch_size * exp.gradient_accumulation_steps for exp, record in session.stage_records(stage)
                  if record.get("status") == "ok" and not exp.tuning_space]
        if filled:
            return max(filled)
    return max(1, st.gradient_accumulation_steps) * max(1, top or stage_top(session, stage))


def known_feasible(session: Session, stage: int) -> int:
    """The largest size the stage ran at the user's gas (0: none yet): its top, as DeepSpeed's max
    probes find it (the sizes sampled below the top run at more gas). Another stage's success does
    not count: a stage holding less may hold much more, and its space is bounded by its own top."""
    gas = session.settings.gradient_accumulation_steps
    return max((exp.micro_batch_size for exp, record in session.stage_records(stage)
                if record.get("status") == "ok" and exp.gradient_accumulation_steps <= gas and not exp.tuning_space),
               default=0)


def gas_for(session: Session, stage: int, mbs: int) -> int:
    """The accumulation of `mbs` in the stage's space: what fills `samples_per_step`, at least the user's."""
    st = session.settings
    if st.samples_per_step:
        return st.gas_for(mbs)
    return max(1, st.gradient_accumulation_steps, samples_per_step(session, stage) // mbs)


#: Without max_train_batch_size (or a kept batch, whose sizes are the step's), a predicted top of at
#: least `ALIGN_FROM` is probed at the largest multiple of `ALIGN` below it: GPU kernels run rows in
#: tiles, so a size just past a multiple of 8 pays for a tile it barely fills (bench/heldout.py's
#: tile-steps scripts, with odd token counts, read up to a fifth slower there), while from 128 on the
#: size given up is at most 5 % of a top that is no more certain than that.
ALIGN, ALIGN_FROM = 8, 128


def stage_top(session: Session, stage: int, cautious: bool = False) -> int:
    """The largest size worth probing now: the calibrated prediction, capped, kept below failures;
    after a failure above a success, the geometric midpoint between them; after MAX_FAILURES
    failures, the largest success. A size that ran at any gas counts (memory does not depend on
    the accumulation), and so does a size a stage holding more ran (`memory_facts.shared_facts`).
    `cautious`: the size is the stage's first probe (`memory_facts.predict_max_micro_batch_size`).
    Without a step limit, a predicted top of `ALIGN_FROM` or more is a multiple of `ALIGN`."""
    sizes = sizes_ran(session, stage)
    failed = [m for m, ok in sizes.items() if not ok]
    borrowed = session.shared_facts(stage).success  # the stage's own failure outranks another stage's success
    largest_ok = max([m for m, ok in sizes.items() if ok] + [borrowed if not failed or borrowed < min(failed) else 0])
    predicted = session.predicted_max(stage, TOP_SAFETY if session.settings.samples_per_step else TOP_SAFETY_UNBOUNDED,
                                      cautious)
    if failed:
        smallest_failed = min(failed)
        if largest_ok and failures_since_a_success(session, stage) >= MAX_FAILURES:
            return largest_ok
        ran_elsewhere = any(record.get("status") == "ok" for exp, record in session.measured.values()
                            if exp.space != PROFILE and exp.stage != stage)
        if not largest_ok and len(failed) >= (MAX_FAILURES if ran_elsewhere else MAX_BLIND_FAILURES):
            return 0
        if largest_ok:
            mid = geometric_mid(largest_ok, smallest_failed)
            predicted = min(predicted, mid if mid is not None else largest_ok)
        else:
            predicted = min(predicted, smallest_failed // 2)
    if not session.settings.samples_per_step and predicted >= ALIGN_FROM:
        predicted -= predicted % ALIGN
    top = max(predicted, largest_ok)
    kept = session.settings.kept_per_gpu
    return largest_kept(kept, top) if kept else top  # a kept global batch: only sizes dividing its share


def failures_since_a_success(session: Session, stage: int) -> int:
    """Sizes of the stage that failed after its first success: the ones that bracket its top (the
    blind ones before it only found a size that runs). A size whose retry ran is none of them."""
    failed, seen_ok = set(), bool(session.shared_facts(stage).success)
    ran = sizes_ran(session, stage)
    for exp, record in session.stage_records(stage):
        if exp.tuning_space:
            continue
        if record.get("status") == "ok":
            seen_ok = True
        elif seen_ok and not ran.get(exp.micro_batch_size):
            failed.add(exp.micro_batch_size)
    return len(failed)


def sizes_ran(session: Session, stage: int) -> dict[int, bool]:
    """size -> whether it ran (at any gas) in the stage, for the memory side."""
    out: dict[int, bool] = {}
    for exp, record in session.stage_records(stage):
        if not exp.tuning_space:
            out[exp.micro_batch_size] = out.get(exp.micro_batch_size, False) or record.get("status") == "ok"
    return out
