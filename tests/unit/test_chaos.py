"""bench/chaos.py's checks (bench/chaos_checks.py), on planted records: each count is 0 on a clean soak
and goes up when its property breaks (a lost experiment, a duplicate, two experiments on one slot, a
leftover); and its command line's bad input."""
from __future__ import annotations

import pytest

from bench.chaos import main
from bench.chaos_checks import (MAX_GAP_S, MIN_GAP_S, Fault, JobRecords, Leftovers, ProcessRow, Sample, Seen,
                                duplicated_experiments, fault_made, fault_schedule, identify, lost_experiments,
                                overlap_seconds, sampled_overlap_seconds, summary_line, verdict)
from workers.process_identity import RankIdentity

REFERENCE = {"z0_a": "ok", "z0_b": "ok", "z1_a": "ok"}


def job(listed=None, on_disk=None, finished=True, name="j1", reference=REFERENCE) -> JobRecords:
    listed = tuple((listed or REFERENCE).items()) if not isinstance(listed, tuple) else listed
    on_disk = dict(listed) if on_disk is None else on_disk
    return JobRecords(name, finished, listed, on_disk, reference)


def seen(slot="s.gpu0", launch="L1", experiment="j1/z0_a", rank="0") -> Seen:
    return Seen(slot, launch, experiment, rank)


CLEAN_SPANS = [("s.gpu0", "j1/z0_a", 0.0, 2.0), ("s.gpu0", "j1/z0_b", 2.0, 4.0), ("s.gpu1", "j1/z0_a", 0.0, 2.0)]
CLEAN_SAMPLES = [Sample(0.0, (seen(), seen(slot="s.gpu1", launch="L2", rank="1"))), Sample(0.25, ()),
                 Sample(0.5, (seen(launch="L3", experiment="j1/z0_b"),))]


def test_a_clean_soak_counts_nothing():
    result = verdict([job()], CLEAN_SAMPLES, CLEAN_SPANS, Leftovers())
    assert (result.lost, result.duplicated, result.overlapping_s, result.leaked) == (0, 0, 0.0, 0)
    assert result.findings == ()


# ------------------------------------------------------------------ lost


@pytest.mark.parametrize("planted, why", [
    (job(listed={**REFERENCE, "z1_a": "lost"}), "a `lost` record left after the resume pass"),
    (job(on_disk={"z0_a": "ok", "z0_b": "ok"}), "listed, but no result.json on disk"),
    (job(on_disk={**REFERENCE, "z0_b": "crashed"}), "result.json says another status than the list"),
    (job(on_disk={**REFERENCE, "z0_b": None}), "result.json unreadable"),
    (job(listed={"z0_a": "ok", "z0_b": "ok"}), "a fault-free path lacking one of the reference's experiments"),
    (job(on_disk={**REFERENCE, "z1_b": "ok"}), "a folder with a record the job's results do not list"),
    (job(on_disk={**REFERENCE, "z1_b": None}), "a folder of a launch that never recorded, not listed"),
])
def test_each_lost_experiment_is_counted(planted, why):
    assert len(lost_experiments([planted])) == 1, why
    assert verdict([planted], [], [], Leftovers()).lost == 1


def test_an_unfinished_job_loses_what_it_has_not_recorded():
    unfinished = job(listed={"z0_a": "ok"}, finished=False)
    assert sorted(lost_experiments([unfinished])) == ["j1/z0_b: job unfinished", "j1/z1_a: job unfinished"]


def test_a_failure_the_faults_made_may_change_the_path():
    """A killed rank is a crash to the search: `z0_b` crashed, it retried `z0_b_r2` and never went to
    `z1_a`. Not lost, not duplicated; what it did record must still be final and on disk."""
    other_path = job(listed={"z0_a": "ok", "z0_b": "crashed", "z0_b_r2": "ok"})
    assert fault_made(other_path)
    assert lost_experiments([other_path]) == [] and duplicated_experiments([other_path], []) == []
    broken = job(listed={"z0_a": "ok", "z0_b": "crashed", "z0_b_r2": "ok"}, on_disk={"z0_a": "ok", "z0_b": "crashed"})
    assert len(lost_experiments([broken])) == 1


def test_a_reference_failure_is_not_a_fault():
    reference = {"z0_a": "ok", "z0_b": "oom"}
    same = job(listed=dict(reference), reference=reference)
    assert not fault_made(same) and lost_experiments([same]) == []


# ------------------------------------------------------------------ duplicated


def test_an_experiment_listed_twice_is_duplicated():
    twice = job(listed=(("z0_a", "ok"), ("z0_b", "ok"), ("z1_a", "ok"), ("z0_a", "ok")))
    assert duplicated_experiments([twice], []) == ["j1/z0_a: listed 2 times"]


def test_an_experiment_the_fault_free_path_never_ran_is_duplicated():
    extra = job(listed={**REFERENCE, "z0_a_r2": "ok"})
    assert duplicated_experiments([extra], []) == ["j1/z0_a_r2: the fault-free run has no such experiment"]


def test_one_rank_in_two_launches_at_once_is_duplicated():
    samples = [Sample(1.0, (seen(launch="L1"), seen(slot="s.gpu2", launch="L9"))),
               Sample(1.25, (seen(launch="L1"), seen(slot="s.gpu2", launch="L9")))]
    found = duplicated_experiments([job()], samples)
    assert len(found) == 1 and found[0].startswith("j1/z0_a: rank 0 in 2 launches")
    assert verdict([job()], samples, [], Leftovers()).duplicated == 1


def test_ranks_of_one_launch_and_launches_one_after_another_are_not_duplicates():
    samples = [Sample(1.0, (seen(rank="0", launch="A0"), seen(slot="s.gpu1", rank="1", launch="A1"))),
               Sample(2.0, (seen(launch="B0"),))]
    assert duplicated_experiments([job()], samples) == []


# ------------------------------------------------------------------ overlapping slot-seconds


def test_two_experiments_on_one_slot_at_once_overlap():
    spans = [*CLEAN_SPANS, ("s.gpu1", "j2/z1_a", 1.5, 3.0)]
    assert overlap_seconds(spans) == pytest.approx(0.5)
    assert verdict([job()], [], spans, Leftovers()).overlapping_s == pytest.approx(0.5)


def test_three_experiments_overlapping_count_each_second_once():
    spans = [("g", "a", 0.0, 10.0), ("g", "b", 2.0, 4.0), ("g", "c", 3.0, 6.0)]
    assert overlap_seconds(spans) == pytest.approx(4.0)  # 2..6 has two or more


def test_spans_that_only_touch_or_lie_on_other_slots_do_not_overlap():
    assert overlap_seconds(CLEAN_SPANS) == 0.0
    assert overlap_seconds([("g", "a", 0.0, 1.0), ("g", "a", 0.5, 2.0)]) == 0.0  # one experiment's own spans


def test_two_launches_on_one_slot_in_the_process_table_overlap():
    samples = [Sample(0.0, (seen(launch="L1"), seen(launch="L2", experiment="j2/z1_a"))), Sample(0.4, ())]
    assert sampled_overlap_seconds(samples) == pytest.approx(0.4)
    assert verdict([job()], samples, [], Leftovers()).overlapping_s == pytest.approx(0.4)
    assert sampled_overlap_seconds(CLEAN_SAMPLES) == 0.0


# ------------------------------------------------------------------ which processes are ranks

JOB_A, JOB_B, STRANGER = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"
JOBS = {JOB_A: "001-list", JOB_B: "002-pair"}
#: What /proc shows for a rank forked from the warm process, before its title: the warm process's line.
FORKSERVER = ("/venv/bin/python -B -c from multiprocessing.forkserver import main; main(5, 7, "
              "['workers.warm_preload'], **{'sys_path': ['/repo']})")


def titled(job_id: str, experiment: str, rank: int, world: int, launch: str, slot: str = "chaos.gpu0") -> str:
    return RankIdentity(slot, job_id, experiment, rank, world, launch.ljust(32, "0")).title()


def test_a_warm_forked_rank_is_the_rank_its_title_names_not_the_warm_process():
    rows = [
        ProcessRow(100, 100, "[celeryd: gpu0@chaos:MainProcess] -active- (worker -Q gpu0)"),
        ProcessRow(101, 100, FORKSERVER),  # the warm process: in its worker's group, no rank title
        ProcessRow(200, 200, titled(JOB_A, "z0_mbs1", 0, 1, "launch1")),  # forked from 101, then titled
        ProcessRow(201, 200, titled(JOB_A, "z0_mbs1", 0, 1, "launch1")),  # what it forked: the same title
        ProcessRow(202, 200, "gcc -c cpu_adam.cpp"),  # what it exec'd: untitled, in its group
        ProcessRow(300, 300, titled(JOB_B, "z0_mbs1", 1, 2, "launch2", "chaos.gpu1")),  # a cold rank, other job
        ProcessRow(400, 400, titled(STRANGER, "z0_mbs1", 0, 1, "launch9")),  # another cluster's rank
        ProcessRow(500, 500, FORKSERVER),  # a forked rank not yet titled: nobody's yet
    ]
    found = identify(rows, JOBS)
    rank = Seen("chaos.gpu0", "launch100000", "001-list/z0_mbs1", "0")
    assert found == {200: rank, 201: rank, 202: rank,
                     300: Seen("chaos.gpu1", "launch200000", "002-pair/z0_mbs1", "1")}


def test_a_rank_in_two_launches_is_seen_as_two_and_one_launchs_processes_as_one():
    """The same experiment name in two jobs is two experiments; one rank in two launches of one job is
    a duplicate; a rank and what it forked are one launch."""
    both = identify([ProcessRow(1, 1, titled(JOB_A, "z1_mbs2", 0, 1, "launchX")),
                     ProcessRow(2, 1, titled(JOB_A, "z1_mbs2", 0, 1, "launchX")),
                     ProcessRow(3, 3, titled(JOB_B, "z1_mbs2", 0, 1, "launchY", "chaos.gpu1"))], JOBS)
    assert duplicated_experiments([], [Sample(0.0, tuple(both.values()))]) == []
    twice = identify([ProcessRow(1, 1, titled(JOB_A, "z1_mbs2", 0, 1, "launchX")),
                      ProcessRow(3, 3, titled(JOB_A, "z1_mbs2", 0, 1, "launchZ", "chaos.gpu1"))], JOBS)
    assert len(duplicated_experiments([], [Sample(0.0, tuple(twice.values()))])) == 1


# ------------------------------------------------------------------ leaked


@pytest.mark.parametrize("leftovers", [
    Leftovers(redis_keys=("autotune:gang:chaos.gpu0",)),
    Leftovers(training=("4242 (rank 0 of 001-list/z0_mbs1 on chaos.gpu0, launch 0123456789ab)",)),
    Leftovers(processes=(4243,)),
    Leftovers(shm=("deepspeed_allreduce_buffer_0_127.0.0.1_29500_0",)),
])
def test_each_leftover_is_a_leak(leftovers):
    assert verdict([job()], [], [], leftovers).leaked == 1


# ------------------------------------------------------------------ the schedule and the command line


def test_the_schedule_is_the_seeds():
    first, again, other = fault_schedule(1, 1800), fault_schedule(1, 1800), fault_schedule(2, 1800)
    assert first == again and first != other
    times = [at for at, _ in first]
    assert times == sorted(times) and 0 < times[0] <= MAX_GAP_S and times[-1] < 1800
    assert all(MIN_GAP_S <= b - a <= MAX_GAP_S + 0.02 for a, b in zip(times, times[1:]))
    assert {fault for _, fault in first} == set(Fault)


def test_the_summary_line():
    result = verdict([job()], [], [("g", "a", 0.0, 3.0), ("g", "b", 1.0, 2.0)], Leftovers(training=(1,)))
    assert summary_line(7, 40, 5, result) == ("chaos: 7 faults, 40 experiments, 5 jobs: 0 lost, 0 duplicated, "
                                              "1 overlapping slot-seconds, 1 leaked")
    brief = verdict([job()], [Sample(0.0, (seen(launch="L1"), seen(launch="L2"))), Sample(0.1, ())], [], Leftovers())
    assert "1 overlapping slot-seconds" in summary_line(0, 0, 0, brief)  # a tenth of a second still shows


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--seconds", "nan"], ["--slots", "1"], ["--seed", "x"],
                                  ["--bogus"]])
def test_bad_flags_are_one_error_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
