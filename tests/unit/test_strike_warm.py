"""bench/strike_warm.py: which warm process it strikes, and what it accepts as a lost launch run again.

The strike and the job are real only in the bench itself (minutes of DeepSpeed); here the choice is
made on planted processes and the checks read planted experiment folders.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.chaos_checks import Seen
from bench.chaos_strikes import Struck
from bench.strike_warm import LOST_NOTE, narrowed, problems, ripe

WARM = "autotune warm slot=vm.gpu0"
LAUNCH, AGAIN = "fd7eaed75ae3", "e35673fa6b7c"


def target(pid: int, experiment: str, warm: int = 100) -> Struck:
    return Struck(warm, WARM, pid, Seen("vm.gpu0", LAUNCH, f"job1/{experiment}", "0"))


def test_the_strike_waits_for_a_rank_of_an_experiment_that_has_run_long_enough():
    found = [target(200, "z1_gas1_tmbspg8"), target(300, "profile_model_info", warm=101),
             target(400, "z1_gas4_tmbspg2", warm=102)]
    assert ripe(found, {200: 0.5, 300: 9.0, 400: 0.2}, 1.0) is None  # the profile run is never struck
    assert ripe(found, {200: 1.2, 300: 9.0, 400: 3.0}, 1.0) == found[2]  # the oldest ripe rank
    assert ripe(found, {200: 1.2}, 1.0) == found[0]
    assert ripe([], {200: 5.0}, 1.0) is None


def test_the_job_is_narrowed_to_the_short_list_and_its_script_found_from_the_config(tmp_path: Path):
    config = {"train_micro_batch_size_per_gpu": [2, 8, 48], "zero_optimization": {"stage": [0, 1, 2, 3]},
              "autotuning": {"user_script": "train_gpt.py", "user_args": ["--steps", "50"]}}
    found = narrowed(config, tmp_path)
    assert found["train_micro_batch_size_per_gpu"] == [2, 8] and found["zero_optimization"] == {"stage": [1]}
    assert found["autotuning"]["user_script"] == str(tmp_path / "train_gpt.py")
    assert config["zero_optimization"]["stage"] == [0, 1, 2, 3]  # the caller's config is left alone


def plant(results: Path, status: str = "ok", launches: tuple[str, ...] = (LAUNCH, AGAIN),
          note: bool = True, counted: str = AGAIN) -> dict[str, str]:
    """An experiment folder as the control worker leaves it: one set of files per launch, the plain
    stderr.log a hard link to the counted launch's; what the striker wrote about it."""
    folder = results / "z1_gas1_tmbspg8"
    folder.mkdir(parents=True)
    for launch in launches:
        (folder / f"ds_config.{launch}.json").write_text("{}")
        (folder / f"stderr.{launch}.log").write_text(f"training\n{LOST_NOTE if note and launch == LAUNCH else ''}\n")
    os.link(folder / f"stderr.{counted}.log", folder / "stderr.log")
    (folder / "result.json").write_text(json.dumps({"name": folder.name, "status": status}))
    return {"experiment": folder.name, "launch": LAUNCH, "rank": "0"}


def test_a_launch_recorded_lost_and_run_again_passes(tmp_path: Path):
    assert problems(tmp_path, plant(tmp_path), 0) == []


def test_an_oom_after_the_relaunch_is_the_configs_own_end(tmp_path: Path):
    assert problems(tmp_path, plant(tmp_path, status="oom"), 0) == []


@pytest.mark.parametrize("planted, expected", [
    ({"status": "crashed"}, "recorded crashed"),  # the dead warm process taken for the config's crash
    ({"status": "lost"}, "recorded lost"),  # given up: never measured
    ({"launches": (LAUNCH,), "counted": LAUNCH}, "and another expected"),  # never launched again
    ({"note": False}, "does not say"),  # ended some other way than the warm path's lost launch
    ({"counted": LAUNCH}, "the counted launch is the struck one"),
])
def test_a_struck_experiment_not_run_again_to_a_result_fails(tmp_path: Path, planted: dict, expected: str):
    found = problems(tmp_path, plant(tmp_path, **planted), 0)
    assert any(expected in line for line in found), found


def test_nothing_struck_or_a_failed_command_fails(tmp_path: Path):
    assert problems(tmp_path, None, 0) == ["nothing struck: no warm-forked rank of an experiment ran long "
                                           "enough (see --after)"]
    assert problems(tmp_path, plant(tmp_path), 1) == ["the command exited 1"]
