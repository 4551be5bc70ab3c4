"""The noise of one reading, which the cost model's contradictions are judged against
(`stage_readings.reading_noise`): a config's outlying reading is no noise."""
from __future__ import annotations

from scheduler.search.session import SearchSettings, Session
from scheduler.search.space import Experiment
from scheduler.search.stage_readings import reading_noise, stage_values, suspect_size


def _session(readings: dict[str, float]) -> Session:
    """ZeRO-1 readings by name ("8", "8_r2"): 32 samples per GPU per step, so size 8 runs gas 4."""
    settings = SearchSettings(ds_config={}, capacity_bytes=1 << 34, stages=(1,), num_gpus=2,
                              max_train_batch_size=64, peak_memory_key="peak_device_bytes")
    session = Session(settings)
    for name, value in readings.items():
        mbs = int(name.split("_")[0])
        exp = Experiment(f"z1_gas{32 // mbs}_tmbspg{mbs}" + name[len(str(mbs)):], 1, mbs, 32 // mbs, {})
        session.measured[exp.name] = (exp, {"name": exp.name, "status": "ok", "metrics": {"throughput": value}})
    return session


def test_two_readings_torn_apart_add_nothing_to_the_noise() -> None:
    """4 read 100 and 104 (2 % noise); 8 read 150 and 80, one of them an outlier. Pooled as noise, that
    pair alone would give 0.3."""
    assert 0.02 < reading_noise(_session({"4": 100.0, "4_r2": 104.0, "8": 150.0, "8_r2": 80.0})) < 0.04


def test_a_straggler_is_still_found_after_a_config_was_read_torn() -> None:
    """The curve falls from 110 at size 4 to 85 at 32. 8 read a straggler's 50 beside its 100, and 4
    read a straggler's 60: the fit of 8, 16 and 32 contradicts 4, which is measured again."""
    session = _session({"4": 60.0, "8": 50.0, "8_r2": 100.0, "16": 92.0, "32": 85.0})
    assert suspect_size(session, 1, stage_values(session, 1)) == 4
