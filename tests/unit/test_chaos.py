"""bench/chaos.py's checks (bench/chaos_checks.py), on planted records: each count is 0 on a clean soak
and goes up when its property breaks (a lost experiment, a duplicate, two experiments on one slot, a
leftover); and its command line's bad input."""
from __future__ import annotations

import json

import psutil
import pytest

from bench.chaos import main
from bench.chaos_checks import (STALE, MAX_GAP_S, MIN_EACH, MIN_GAP_S, Fault, JobRecords, Leftovers, ProcessRow, Sample,
                                Seen, duplicated_experiments, failed_after_strikes, fault_made, fault_schedule,
                                identify, lost_experiments, overlap_seconds, sampled_overlap_seconds, summary_line,
                                verdict)
from bench.chaos_strikes import Struck, bump_candidates, pools_running, warm_parents
from workers.state import keys
from workers.process.process_identity import RankIdentity, RankProcess

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


def test_a_resume_that_took_another_path_keeps_what_its_first_run_measured():
    """The first run gave `z1_a` up as lost and re-measured `z0_b` (`z0_b_r2`); the resume ran `z1_a`
    and no longer needed `z0_b_r2` nor the `z1_b` it had given up. `z0_b_r2` is listed off the path
    (a measurement: it stays); `z1_b`'s folder holds a `lost` record, no measurement: not listed."""
    resumed = JobRecords("j1", True, (*REFERENCE.items(), ("z0_b_r2", "ok")),
                         {**REFERENCE, "z0_b_r2": "ok", "z1_b": "lost"}, REFERENCE, frozenset({"z0_b_r2"}))
    assert lost_experiments([resumed]) == [] and duplicated_experiments([resumed], []) == []
    unmarked = JobRecords("j1", True, resumed.listed, resumed.on_disk, REFERENCE)
    assert duplicated_experiments([unmarked], []) == ["j1/z0_b_r2: the fault-free run has no such experiment"]
    dropped = JobRecords("j1", True, tuple(REFERENCE.items()), resumed.on_disk, REFERENCE)
    assert lost_experiments([dropped]) == ["j1/z0_b_r2: ran (on disk ok) but the job's results lack it"]


def test_a_folder_of_a_launch_that_was_not_counted_is_no_lost_result():
    """A resubmitted job went on without `z0_b_r2` while a launch of it ran: that launch's record is
    in the folder marked stale (`finish_experiment`), never counted; a folder that ran and holds no
    record at all is still a lost result."""
    fenced = JobRecords("j1", True, tuple(REFERENCE.items()), {**REFERENCE, "z0_b_r2": STALE}, REFERENCE)
    assert lost_experiments([fenced]) == []
    unrecorded = JobRecords("j1", True, tuple(REFERENCE.items()), {**REFERENCE, "z0_b_r2": None}, REFERENCE)
    assert lost_experiments([unrecorded]) == ["j1/z0_b_r2: ran (on disk None) but the job's results lack it"]


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
    assert verdict([job()], samples, [], Leftovers()).findings[1:] == (
        "overlapping: s.gpu0: j1/z0_a (L1) and j2/z1_a (L2) from 0.0s for 0.4s",)


# ------------------------------------------------------------------ which processes are ranks

JOB_A, JOB_B, STRANGER = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"
JOBS = {JOB_A: "001-list", JOB_B: "002-pair"}
#: What /proc shows for a rank forked from the warm process, before its title: the warm process's line.
FORKSERVER = ("/venv/bin/python -B -c from multiprocessing.forkserver import main; main(5, 7, "
              "['workers.warm.warm_preload'], **{'sys_path': ['/repo']})")


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


@pytest.mark.parametrize("seed", range(1, 21))
def test_every_kind_is_struck_at_least_twice_in_ten_minutes(seed):
    """Drawn by weight alone, 9 of these 20 seeds leave a kind once or never in 600 s."""
    schedule = fault_schedule(seed, 600)
    counts = {kind: sum(1 for _, fault in schedule if fault is kind) for kind in Fault}
    assert min(counts.values()) >= MIN_EACH, counts
    times = [at for at, _ in schedule]
    assert all(MIN_GAP_S <= b - a <= MAX_GAP_S + 0.02 for a, b in zip(times, times[1:]))


# ------------------------------------------------------------------ what kill_pool and kill_warm strike

POOL = "[celeryd: gpu0@chaos:ForkPoolWorker-1]"


def record(pid: int, launch: str = "launch1", slot: str = "chaos.gpu0") -> RankProcess:
    return RankProcess(RankIdentity(slot, JOB_A, "z0_mbs1", 0, 1, launch.ljust(32, "0")), pid, pid, 777)


def claim(pid: int, started: float) -> str:
    return json.dumps({"pid": pid, "started": started, "group": {"pid": 200, "started": 5.0}})


RANK_200 = Seen("chaos.gpu0", "launch100000", "001-list/z0_mbs1", "0")


def test_the_pool_process_struck_is_the_live_claimant_of_a_running_ranks_task():
    records = {"chaos.gpu0:t1": record(200), "chaos.gpu1:t2": record(300, "launch2", "chaos.gpu1"),
               "chaos.gpu2:t3": record(400, "launch3", "chaos.gpu2"), "chaos.gpu0:t4": record(500, "launch4"),
               "chaos.gpu1:t5": record(600, "launch5", "chaos.gpu1")}
    claims = {"chaos.gpu0:t1": claim(150, 1000.0),
              "chaos.gpu1:t2": claim(160, 1000.0),  # its claimant died: PID 160 is another process now
              "chaos.gpu2:t3": None,  # no claim (a rank started by an older worker)
              "chaos.gpu0:t4": claim(170, 1000.0),
              "chaos.gpu1:t5": "{not json"}
    live = {200: RANK_200,
            300: Seen("chaos.gpu1", "launch200000", "001-list/z0_mbs2", "0"),
            400: Seen("chaos.gpu2", "launch300000", "001-list/z0_mbs3", "0"),
            500: Seen("chaos.gpu0", "launch900000", "002-pair/z1_mbs1", "1"),  # PID 500 is another launch's rank now
            600: Seen("chaos.gpu1", "launch500000", "001-list/z0_mbs4", "0")}
    processes = {150: (1000.004, POOL), 160: (1234.0, "bash"), 170: (1000.0, POOL)}
    assert pools_running(records, claims, live, processes) == [Struck(150, POOL, 200, RANK_200)]
    assert pools_running(records, claims, {}, processes) == []  # nothing running: nothing struck


def test_the_warm_process_struck_is_the_forkserver_a_running_rank_was_forked_from():
    rows = {101: (100, FORKSERVER), 200: (101, titled(JOB_A, "z0_mbs1", 0, 1, "launch1")),
            150: (100, POOL), 300: (150, titled(JOB_B, "z0_mbs1", 1, 2, "launch2")),  # a cold rank: its pool's child
            400: (999, "")}  # its parent already gone
    live = {200: RANK_200, 300: Seen("chaos.gpu1", "launch200000", "002-pair/z0_mbs1", "1"),
            400: Seen("chaos.gpu2", "launch300000", "001-list/z0_mbs2", "0")}
    assert warm_parents(live, rows) == [Struck(101, FORKSERVER, 200, RANK_200)]


def test_the_distributions_a_bump_touches_are_installed_with_their_metadata():
    found = bump_candidates()
    assert "torch" in {bump.name for bump in found}
    assert all(bump.metadata.name == "METADATA" and bump.metadata.is_file() and bump.version for bump in found)


@pytest.mark.parametrize("status, struck, counted", [
    ("crashed", {"kill_warm"}, 1),  # a rank whose warm process died read as a crash: a result taken
    ("crashed", {"kill_pool"}, 1),
    ("crashed", {"kill_warm", "kill_rank"}, 0),  # its rank was killed too: a crash is what it is
    ("crashed", set(), 0),  # no fault aimed at it: the path may differ (fault_made)
    ("ok", {"kill_warm", "kill_pool"}, 0),  # lost, run again, measured
    ("oom", {"kill_pool"}, 0),  # the fault-free run's status for it
])
def test_a_failure_after_a_fault_that_spares_the_rank_is_a_lost_result(status, struck, counted):
    reference = {**REFERENCE, "z1_a": "oom"} if status == "oom" else REFERENCE
    planted = job(listed={"z0_a": "ok", "z0_b": "ok", "z1_a": status}, reference=reference)
    assert lost_experiments([planted]) == []  # the record itself is whole: only the strike makes it lost
    assert len(failed_after_strikes([planted], {"j1/z1_a": struck})) == counted
    assert verdict([planted], [], [], Leftovers(), {"j1/z1_a": struck}).lost == counted
