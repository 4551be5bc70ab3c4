"""Unit tests for workers.in_rank.metrics: config decoding and DeepSpeed's autotuning metric semantics."""

from __future__ import annotations

import base64
import json
import os

import pytest

from workers.in_rank.metrics import (
    AutotuningMetrics,
    AutotuningSettings,
    BatchSizes,
    load_ds_config,
    summarise_window,
    trimmed_mean,
    write_json_atomic,
    write_model_info,
)

SAMPLE_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 1},
    "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2},
}


class FakeClock:
    """A clock that advances only when told to, so timed blocks have exact durations."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def autotuning_config(tmp_path, **overrides) -> dict:
    section = {
        "enabled": True,
        "start_profile_step": 1,
        "end_profile_step": 2,
        "metric_path": str(tmp_path / "m.json"),
        **overrides.pop("autotuning", {}),
    }
    batch = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    return {**batch, **overrides, "autotuning": section}


def run_micro_step(metrics: AutotuningMetrics, clock: FakeClock, fwd: float, bwd: float, step: float) -> None:
    for name, seconds in (("fwd", fwd), ("bwd", bwd), ("step", step)):
        with metrics.timed(name):
            clock.advance(seconds)
    metrics.end_micro_step()


# load_ds_config


def test_load_ds_config_decodes_urlsafe_base64_as_the_autotuner_passes_it():
    config = {"train_micro_batch_size_per_gpu": 2, "note": "~~~???>>>"}
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert "-" in encoded or "_" in encoded  # the payload exercises the URL-safe alphabet
    assert load_ds_config(encoded) == config


def test_load_ds_config_decodes_standard_base64():
    config = {"note": "~~~???>>>", "zero_optimization": {"stage": 3}}
    encoded = base64.b64encode(json.dumps(config).encode()).decode()
    assert "+" in encoded or "/" in encoded
    assert load_ds_config(encoded) == config


def test_load_ds_config_reads_a_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SAMPLE_CONFIG))
    assert load_ds_config(str(path)) == SAMPLE_CONFIG


def test_load_ds_config_reads_an_hjson_file(tmp_path):
    pytest.importorskip("hjson")
    path = tmp_path / "ds_config.hjson"
    path.write_text("{\n  # comment\n  train_micro_batch_size_per_gpu: 8\n  bf16: {enabled: true}\n}\n")
    assert load_ds_config(str(path)) == {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}}


UNDECODABLE = ["no_such_config.json", "!!not base64!!", base64.b64encode(b"\xff\xfe").decode()]


@pytest.mark.parametrize("value", UNDECODABLE)
def test_load_ds_config_names_the_value_it_cannot_decode(value):
    with pytest.raises(ValueError, match="neither an existing file nor base64") as error:
        load_ds_config(value)
    assert repr(value) in str(error.value)


@pytest.mark.parametrize("payload", [b"[1, 2]", b"plain words"])
def test_load_ds_config_rejects_base64_that_is_not_a_json_object(payload):
    with pytest.raises(ValueError, match="neither an existing file nor base64"):
        load_ds_config(base64.b64encode(payload).decode())


def test_load_ds_config_rejects_a_file_that_is_not_a_json_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json.*holds a list"):
        load_ds_config(str(path))


def test_importing_the_module_does_not_import_torch():
    import subprocess
    import sys

    module_path = os.path.join(os.path.dirname(__file__), "..", "..", "workers", "in_rank", "metrics.py")
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('metrics_probe', {module_path!r})\n"
        "module = sys.modules['metrics_probe'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "sys.exit('torch' in sys.modules)\n"
    )
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


# batch sizes and settings


@pytest.mark.parametrize(
    ("config", "world_size", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 6}, 3, (6, 2, 1)),
    ],
)
def test_batch_sizes_are_completed_like_deepspeed(config, world_size, expected):
    sizes = BatchSizes.from_ds_config(config, world_size)
    assert (sizes.train_batch_size, sizes.micro_batch_per_gpu, sizes.gradient_accumulation_steps) == expected


def test_batch_sizes_reject_inconsistent_or_untuned_values():
    with pytest.raises(ValueError, match="inconsistent"):
        BatchSizes.from_ds_config(
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, 1
        )
    with pytest.raises(ValueError, match="must be an integer"):
        BatchSizes.from_ds_config({"train_micro_batch_size_per_gpu": [2, 8]}, 1)


def test_settings_default_paths_are_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"autotuning": {"enabled": True, "model_info": {"profile": True}}}
    settings = AutotuningSettings.from_ds_config(config)
    assert settings.metric_path == os.path.join(str(tmp_path), "autotuning_metric.json")
    assert settings.model_info_path == os.path.join(str(tmp_path), "autotuning_model_info.json")
    assert (settings.start_profile_step, settings.end_profile_step) == (3, 5)
    assert settings.profile_model_info


def test_model_info_profiling_needs_autotuning_enabled():
    config = {"autotuning": {"enabled": False, "model_info": {"profile": True}}}
    settings = AutotuningSettings.from_ds_config(config)
    assert not settings.profile_model_info


# metric arithmetic


def test_trimmed_mean_drops_a_tenth_from_each_end_like_deepspeed():
    assert trimmed_mean([1.0, 2.0, 3.0, 4.0]) == 2.5  # round(0.4) == 0: nothing trimmed
    assert trimmed_mean([1.0, 2.0, 3.0, 4.0, 100.0]) == 22.0  # round(0.5) == 0 (banker's rounding)
    assert trimmed_mean([100.0, 1.0, 2.0, 3.0, 4.0, -50.0]) == 2.5  # round(0.6) == 1
    assert trimmed_mean([]) == 0.0


def test_summarise_window_matches_hand_computed_numbers():
    record = summarise_window(
        {"fwd": [0.010, 0.030], "bwd": [0.040, 0.040], "step": [0.001, 0.009]},
        gradient_accumulation_steps=2,
        train_batch_size=16,
        flops_per_optimizer_step=2.0e9,
    )
    assert record["fwd"] == pytest.approx(20_000.0)
    assert record["bwd"] == pytest.approx(40_000.0)
    assert record["step"] == pytest.approx(5_000.0)
    assert record["latency"] == pytest.approx(130_000.0)  # (20 + 40 + 5) ms * 2 micro-steps
    assert record["throughput"] == pytest.approx(16 / 0.130)
    assert record["FLOPS_per_gpu"] == pytest.approx(2.0e9 / 0.130)


def test_summarise_window_omits_flops_without_an_estimate():
    record = summarise_window({"fwd": [0.1], "bwd": [0.2], "step": [0.1]}, 1, 8)
    assert "FLOPS_per_gpu" not in record
    assert record["latency"] == pytest.approx(400_000.0)
    assert record["throughput"] == pytest.approx(20.0)


def test_summarise_window_refuses_an_empty_window():
    with pytest.raises(ValueError, match="no fwd/bwd/step time"):
        summarise_window({"fwd": [], "bwd": [], "step": []}, 1, 8)


# step counting and exit


def test_exit_after_optimizer_step_end_profile_step_plus_one_with_accumulation(tmp_path):
    config = autotuning_config(tmp_path, gradient_accumulation_steps=3, autotuning={"end_profile_step": 2})
    clock = FakeClock()
    metrics = AutotuningMetrics.from_ds_config(
        config, rank=0, world_size=2, flops_per_optimizer_step=6e9, clock=clock
    )
    boundaries = []
    for _ in range(8):  # optimizer steps 1 and 2 plus two micro-steps of step 3
        boundaries.append(metrics.is_gradient_accumulation_boundary)
        run_micro_step(metrics, clock, fwd=9.0, bwd=9.0, step=9.0)
    assert boundaries == [False, False, True, False, False, True, False, False]
    assert (metrics.micro_steps, metrics.global_steps) == (8, 2)
    assert not (tmp_path / "m.json").exists()

    assert metrics.is_gradient_accumulation_boundary
    with pytest.raises(SystemExit) as exit_info:
        run_micro_step(metrics, clock, fwd=0.5, bwd=0.6, step=0.7)
    assert exit_info.value.code == 0
    assert metrics.global_steps == 3

    written = json.loads((tmp_path / "m.json").read_text())
    assert set(written) == {"fwd", "bwd", "step", "latency", "throughput", "FLOPS_per_gpu", "rank"}
    assert written["rank"] == 0
    # The window is optimizer step 3: micro-steps 7 and 8 (9 s each) and micro-step 9.
    expected_fwd, expected_bwd, expected_step = (18.5e6 / 3, 18.6e6 / 3, 18.7e6 / 3)
    assert written["fwd"] == pytest.approx(expected_fwd)
    assert written["bwd"] == pytest.approx(expected_bwd)
    assert written["step"] == pytest.approx(expected_step)
    latency = (expected_fwd + expected_bwd + expected_step) * 3
    assert written["latency"] == pytest.approx(latency)
    assert written["throughput"] == pytest.approx(4 * 3 * 2 * 1e6 / latency)
    assert written["FLOPS_per_gpu"] == pytest.approx(6e9 * 1e6 / latency)


def test_metric_window_is_the_last_optimizer_step_only(tmp_path):
    config = autotuning_config(tmp_path, gradient_accumulation_steps=2, autotuning={"end_profile_step": 1})
    clock = FakeClock()
    metrics = AutotuningMetrics.from_ds_config(
        config, rank=0, world_size=2, flops_per_optimizer_step=1.6e9, clock=clock
    )
    run_micro_step(metrics, clock, fwd=5.0, bwd=5.0, step=5.0)  # optimizer step 1: outside the window
    run_micro_step(metrics, clock, fwd=5.0, bwd=5.0, step=5.0)
    run_micro_step(metrics, clock, fwd=0.010, bwd=0.020, step=0.000)  # optimizer step 2: the window
    with pytest.raises(SystemExit):
        run_micro_step(metrics, clock, fwd=0.030, bwd=0.040, step=0.020)

    written = json.loads((tmp_path / "m.json").read_text())
    assert written["fwd"] == pytest.approx(20_000.0)
    assert written["bwd"] == pytest.approx(30_000.0)
    assert written["step"] == pytest.approx(10_000.0)
    assert written["latency"] == pytest.approx(120_000.0)
    assert written["throughput"] == pytest.approx(16 / 0.120)  # train batch 4 * 2 * 2
    assert written["FLOPS_per_gpu"] == pytest.approx(1.6e9 / 0.120)


def test_other_ranks_exit_without_writing(tmp_path):
    config = autotuning_config(tmp_path, autotuning={"end_profile_step": 0})
    clock = FakeClock()
    metrics = AutotuningMetrics.from_ds_config(config, rank=1, world_size=2, clock=clock)
    with pytest.raises(SystemExit) as exit_info:
        run_micro_step(metrics, clock, fwd=0.1, bwd=0.1, step=0.1)
    assert exit_info.value.code == 0
    assert not (tmp_path / "m.json").exists()


def test_disabled_autotuning_never_writes_or_exits(tmp_path):
    config = autotuning_config(tmp_path, autotuning={"enabled": False, "end_profile_step": 0})
    clock = FakeClock()
    metrics = AutotuningMetrics.from_ds_config(config, rank=0, world_size=1, clock=clock)
    for _ in range(5):
        run_micro_step(metrics, clock, fwd=0.1, bwd=0.1, step=0.1)
    assert metrics.global_steps == 5
    assert not (tmp_path / "m.json").exists()
    assert list(tmp_path.iterdir()) == []


def test_config_without_autotuning_section_is_disabled(tmp_path):
    metrics = AutotuningMetrics.from_ds_config({"train_micro_batch_size_per_gpu": 1}, rank=0, world_size=1)
    assert not metrics.enabled
    metrics.end_micro_step()
    assert metrics.global_steps == 1


def test_unknown_timer_name_is_rejected(tmp_path):
    metrics = AutotuningMetrics.from_ds_config(autotuning_config(tmp_path), rank=0, world_size=1)
    with pytest.raises(ValueError, match="unknown timer"):
        metrics.record("forward", 1.0)


# files


def test_write_json_atomic_replaces_without_leaving_temporary_files(tmp_path):
    path = tmp_path / "nested" / "metric.json"
    write_json_atomic(str(path), {"throughput": 1.0})
    write_json_atomic(str(path), {"throughput": 2.0})
    assert json.loads(path.read_text()) == {"throughput": 2.0}
    assert os.listdir(path.parent) == ["metric.json"]


def test_write_json_atomic_keeps_the_old_file_when_serialisation_fails(tmp_path):
    path = tmp_path / "metric.json"
    write_json_atomic(str(path), {"throughput": 1.0})
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {"throughput": object()})
    assert json.loads(path.read_text()) == {"throughput": 1.0}
    assert os.listdir(tmp_path) == ["metric.json"]


def test_write_model_info_uses_deepspeeds_format(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    path = tmp_path / "model_info.json"
    record = write_model_info(str(path), model, activation_mem_per_gpu=12345)
    expected = {"num_params": 16 + 10, "trainable_num_params": 16 + 2, "activation_mem_per_gpu": 12345}
    assert record == {**expected, "rank": 0}
    assert json.loads(path.read_text()) == record
