"""The typed records (`workers.slot.records`): result.json and a rank's record read into
`ExperimentRecord` / `RankRecord` and written back unchanged, older records read with defaults, and
one `not_started` record for every rank whose script never ran.

The samples in tests/unit/records/ are result.json files the tool wrote (tests/integration/test_run.py's
two ranks, ok and crashed; tests/integration/test_tuning.py's fast mode: a measurement, an out-of-memory
config and the profile run).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest

from workers.in_rank.failure import Status
from workers.slot import rank
from workers.slot.rank_claim import refused_record
from workers.slot.records import CAUSE_KEYS, ExperimentRecord, RankRecord, aggregate, experiment_record, not_started

SAMPLES = Path(__file__).parent / "records"
NAMES = sorted(path.stem for path in SAMPLES.glob("*.json"))


def sample(name: str) -> dict:
    return json.loads((SAMPLES / f"{name}.json").read_text())


def test_the_samples_are_there() -> None:
    assert NAMES == ["profile_model_info", "run_rank_crashed", "run_two_ranks_ok", "tuning_ok", "tuning_oom"]


@pytest.mark.parametrize("name", NAMES)
def test_a_written_record_reads_and_writes_back_unchanged(name: str) -> None:
    written = sample(name)
    record = ExperimentRecord.from_json(written)
    assert record.to_json() == written
    assert list(record.to_json()) == list(written)  # in the order aggregate wrote it
    assert record.extra == {}  # every key it holds is named by the type
    assert ExperimentRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


@pytest.mark.parametrize("name", NAMES)
def test_each_ranks_record_reads_and_writes_back_unchanged(name: str) -> None:
    for written in sample(name)["ranks"]:
        ranked = RankRecord.from_json(written)
        assert ranked.to_json() == written
        assert (ranked.name, ranked.status.value, ranked.exit) == (written["name"], written["status"], written["exit"])


def test_the_samples_read_typed() -> None:
    ok = ExperimentRecord.from_json(sample("tuning_ok"))
    crashed = ExperimentRecord.from_json(sample("run_rank_crashed"))
    assert ok.ok and ok.status is Status.OK and ok.metrics["throughput"] > 0 and ok.cause is None
    assert ok.ds_config["train_micro_batch_size_per_gpu"] == 35 and ok.start_path in ("warm", "cold")
    assert crashed.status is Status.CRASHED and not crashed.ok and crashed.metrics is None
    assert crashed.cause == {"rank": 1, "slot": "testnode.gpu1", "exit": "exit 7", "stderr_tail": ""}
    assert crashed.slots == ["testnode.gpu0", "testnode.gpu1"] and crashed.wall_s == 0.581
    assert RankRecord.from_json(crashed.ranks[0]).status is Status.ABORTED
    assert RankRecord.from_json(crashed.ranks[1]).extra["master"] == "127.0.0.1:27381"


def test_aggregate_writes_what_the_samples_hold() -> None:
    for name in NAMES:
        written = sample(name)
        exp = {"name": written["name"], "exp_id": written["exp_id"], "ds_config": written["ds_config"],
               "world_size": len(written["ranks"])}
        assert aggregate(exp, written["ranks"]) == written
        assert experiment_record(exp, written["ranks"]) == ExperimentRecord.from_json(written)


def test_an_older_record_reads_with_defaults() -> None:
    """A record from before a key was written (here: exp_id, slots, start_path, the ranks, the
    costs) reads as the key's default (None for a cost: not measured) and is written back with it."""
    written = sample("tuning_ok")
    old = {key: value for key, value in written.items()
           if key not in ("exp_id", "slots", "start_path", "ranks", "wall_s", "peak_rss_bytes")}
    record = ExperimentRecord.from_json(old)
    assert (record.exp_id, record.slots, record.start_path, record.ranks) == (None, [], None, [])
    assert (record.wall_s, record.peak_rss_bytes) == (None, None)  # not measured, rather than zero
    assert record.metrics == written["metrics"] and record.ok
    again = record.to_json()
    assert again == {**old, "exp_id": None, "slots": [], "wall_s": None, "peak_rss_bytes": None, "ranks": []}
    assert "start_path" not in again  # an optional key is not made up


def test_a_lost_launchs_record_reads() -> None:
    """The sweep's record of a launch given up (`scheduler.cluster.sweep`): no times, no ranks."""
    lost = {"name": "z1_gas1_tmbspg2", "status": "lost", "metrics": None, "ds_config": {"train_batch_size": 2},
            "slots": ["n.gpu0"], "cause": {"error": "its worker is gone; gave up after 2 attempts"}}
    record = ExperimentRecord.from_json(lost)
    assert record.status is Status.LOST and record.cause == lost["cause"] and record.ranks == []
    assert {key: value for key, value in record.to_json().items() if key in lost} == lost


def test_a_lost_record_writes_what_its_builder_was_told_and_nothing_it_never_had() -> None:
    """`ExperimentRecord.lost` as its three callers build it, compared as text with the JSON each
    wrote as a literal: the sweep's give-up (result.json), a fixed job's experiment without a result,
    and a fenced launch's answer."""
    given_up = ExperimentRecord.lost("z1", "its worker is gone; gave up after 2 attempts", metrics=None,
                                     ds_config={"train_batch_size": 2}, slots=["n.gpu0", "n.gpu1"])
    assert json.dumps(given_up.to_json(), indent=2) == json.dumps(
        {"name": "z1", "status": "lost", "metrics": None, "ds_config": {"train_batch_size": 2},
         "slots": ["n.gpu0", "n.gpu1"], "cause": {"error": "its worker is gone; gave up after 2 attempts"}}, indent=2)
    unknown = ExperimentRecord.lost("z1", metrics=None, ds_config=None, slots=[])  # told: written, even empty
    assert json.dumps(unknown.to_json()) == '{"name": "z1", "status": "lost", "metrics": null, "ds_config": null, ' \
                                           '"slots": []}'
    assert json.dumps(ExperimentRecord.lost("z1").to_json()) == '{"name": "z1", "status": "lost"}'
    assert json.dumps(ExperimentRecord.lost("z1", stale=True).to_json()) == \
        '{"name": "z1", "status": "lost", "stale": true}'
    for record in (given_up, unknown, ExperimentRecord.lost("z1", stale=True)):
        assert ExperimentRecord.from_json(record.to_json()) == record  # read back: the same record
    assert "ranks" in ExperimentRecord.from_json(given_up.to_json()).to_json()  # read back, written in full
    with pytest.raises(TypeError):
        ExperimentRecord.lost("z1", metric=None)  # no such field


def test_a_record_without_a_status_is_lost_and_without_a_name_is_refused() -> None:
    assert ExperimentRecord.from_json({"name": "x"}).status is Status.LOST
    assert RankRecord.from_json({"rank": 1}).status is Status.LOST
    with pytest.raises(TypeError):
        ExperimentRecord.from_json({"status": "ok"})


def test_keys_the_type_does_not_name_are_kept() -> None:
    written = {**sample("tuning_ok"), "co_runners": [{"name": "b", "slot": "n.gpu1"}], "from_a_newer_writer": 3}
    record = ExperimentRecord.from_json(written)
    assert record.co_runners == written["co_runners"] and record.extra == {"from_a_newer_writer": 3}
    assert record.to_json() == written


def test_a_fenced_launchs_record_reads_stale() -> None:
    """What a launch that no longer held its experiment leaves in result.json (tasks.experiment): the
    readers skip it by `stale`; the launch's attempt stays in `extra`."""
    written = {**sample("tuning_ok"), "stale": True, "attempt": 2}
    record = ExperimentRecord.from_json(written)
    assert record.stale is True and record.extra == {"attempt": 2} and record.to_json() == written
    assert ExperimentRecord.from_json(sample("tuning_ok")).stale is None


def test_the_ranks_read_typed() -> None:
    record = ExperimentRecord.from_json(sample("run_rank_crashed"))
    ranks = record.rank_records
    assert [rank.slot for rank in ranks] == record.slots and [rank.rank for rank in ranks] == [0, 1]
    assert [rank.status for rank in ranks] == [Status.ABORTED, Status.CRASHED]


def full_record() -> ExperimentRecord:
    """An experiment with every optional field set: a tolerated failure after the measurement, device
    figures, an op build, the GPU link, the engine's figures, warm and cold ranks."""
    r0 = {"rank": 0, "slot": "n.gpu0", "status": "ok", "started_at": 1.0, "ended_at": 5.0, "peak_rss_bytes": 10,
          "metrics": {"throughput": 8.0}, "metrics_at": 4.0, "engine_metrics": {"throughput": 7.5},
          "step_seconds": [0.5, 0.5], "start_path": "warm", "peak_device_bytes": 2**30,
          "peak_device_allocated_bytes": 2**29, "device_alloc_retries": 1, "device_total_bytes": 2**34,
          "device_untracked_bytes": 2**20, "device_foreign_bytes": 2**10, "device_foreign_after_bytes": 2**11,
          "peak_device_init_bytes": 2**25, "peak_device_init_allocated_bytes": 2**24}
    r1 = {"rank": 1, "slot": "n.gpu1", "status": "crashed", "exit": "signal SIGABRT", "started_at": 1.5,
          "ended_at": 6.0, "peak_rss_bytes": 12, "profiling_exit": True, "start_path": "cold", "stderr_tail": "x"}
    record = experiment_record({"name": "z2", "exp_id": 4, "ds_config": {"train_batch_size": 8}, "world_size": 2,
                                "gpu_link": "NV12"},
                               [r1, r0])
    return dataclasses.replace(record, op_build_failed="fused_adam", co_runners=[{"name": "b"}], stale=True,
                               cause={"rank": 1}, extra={"note": 1})


def test_every_field_is_written_and_read_back() -> None:
    """A field `to_json` leaves out, or `from_json` does not read, fails here."""
    record = full_record()
    unset = [spec.name for spec in dataclasses.fields(record) if getattr(record, spec.name) in (None, {}, [])]
    assert unset == ["written"]  # no key of the JSON: which keys `ExperimentRecord.lost` writes
    assert record.exit_after_metrics["rank"] == 1 and record.start_path == "cold+warm"
    written = json.loads(json.dumps(record.to_json()))
    assert set(written) == {spec.name for spec in dataclasses.fields(record)} - {"extra", "written"} | {"note"}
    assert ExperimentRecord.from_json(written) == record


def test_a_rank_record_with_every_field_round_trips() -> None:
    ranked = RankRecord(name="e", rank=1, slot="n.gpu1", node="n", device=1, worker="w", threads=2,
                        status=Status.TIMEOUT, exit="signal SIGKILL", exit_code=-9, started_at=1.0, ended_at=2.0,
                        wall_s=1.0, peak_rss_bytes=5, error="ran past 60s", stale=True, extra={"timeline": {}})
    written = json.loads(json.dumps(ranked.to_json()))
    assert set(written) == {spec.name for spec in dataclasses.fields(ranked)} - {"extra"} | {"timeline"}
    assert RankRecord.from_json(written) == ranked


def test_not_started() -> None:
    record = not_started(Status.RENDEZVOUS_FAILED, "no address from rank 0 within 30s")
    written = record.to_json()
    assert written == {"status": "rendezvous_failed", "exit": "not started", "started_at": written["started_at"],
                       "ended_at": written["started_at"], "wall_s": 0.0, "peak_rss_bytes": 0,
                       "error": "no address from rank 0 within 30s"}
    busy = not_started(Status.GPU_BUSY, "held", device_foreign_bytes=2**30, device_wait_s=3.0).to_json()
    assert (busy["device_foreign_bytes"], busy["device_wait_s"], "stale" in busy) == (2**30, 3.0, False)
    assert not_started(Status.LOST, "gone", stale=True).to_json()["stale"] is True
    crashed = not_started(Status.CRASHED, "KeyError: 'x'", started_at=written["started_at"] - 2.0)
    assert crashed.wall_s >= 2.0 and crashed.ended_at - crashed.started_at == pytest.approx(crashed.wall_s, abs=1e-3)


def test_a_refused_claims_record_is_not_started() -> None:
    stale = refused_record("running")
    assert (stale.status, stale.exit, stale.stale) == (Status.LOST, "not started", True)
    lost = refused_record("lost")
    assert (lost.status, lost.stale, lost.wall_s) == (Status.LOST, None, 0.0) and "pool process" in lost.error


def test_a_rank_delivered_after_its_reservation_went_is_a_stale_not_started_record(tmp_path: Path) -> None:
    spec = mock.Mock(gang_token="t1", attempt="a1", result_dir=tmp_path)
    slot = mock.Mock(queue="n.gpu0")
    client = mock.Mock()
    client.mget.return_value = [b"t2"]  # a newer launch holds the slot (GangReservations.holds reads it)
    record = rank._run(spec, slot, client, "task")
    assert (record.status, record.stale, record.exit) == (Status.LOST, True, "not started")
    assert not list(tmp_path.iterdir())  # nothing of the newer launch's folder touched


def test_a_cause_holds_only_its_keys() -> None:
    record = ExperimentRecord.from_json(sample("run_rank_crashed"))
    assert set(record.cause) <= set(CAUSE_KEYS)
