"""DeepSpeed's ops built before the script (workers.slot.op_prebuild): which ops a config makes the
engine load, and an op already built is not built again (no child started). The child interpreter
that builds them is tested in tests/integration/test_op_prebuild_child.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from workers.slot.op_prebuild import missing_ops, needed_op_builders, prebuild_ops


def _config(optimizer: str | None, torch_adam: bool = False, stage: int = 2, **zero: object) -> dict:
    config: dict = {"zero_optimization": {"stage": stage, **zero}}
    if optimizer:
        config["optimizer"] = {"type": optimizer, "params": {"lr": 1e-3, **({"torch_adam": True} if torch_adam else {})}}
    return config


@pytest.mark.parametrize("config, expected", [
    (_config("Adam"), ["FusedAdamBuilder"]),
    (_config("ADAMW"), ["FusedAdamBuilder"]),  # DeepSpeed lower-cases the type
    (_config("Muon"), ["FusedAdamBuilder"]),  # its auxiliary Adam
    (_config("AdamW", torch_adam=True), []),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": 1}}}, []),  # any true value, as DeepSpeed reads it
    (_config("Adam", offload_optimizer={"device": "cpu"}), ["CPUAdamBuilder"]),
    (_config("Adam", offload_optimizer={"device": "none"}), ["FusedAdamBuilder"]),
    (_config("Adam", cpu_offload=True), ["CPUAdamBuilder"]),  # the legacy key
    (_config("Adam", stage=3, offload_optimizer={"device": "nvme"}), ["CPUAdamBuilder", "AsyncIOBuilder"]),
    (_config("SGD", stage=3, offload_param={"device": "nvme"}), ["AsyncIOBuilder"]),
    (_config("SGD", offload_optimizer={"device": "nvme"}), []),  # ZeRO-1/2 never swap to NVMe
    (_config("SGD", stage=3, zero_quantized_weights=True), ["QuantizerBuilder"]),
    (_config("Adagrad"), []),
    (_config("Adagrad", offload_optimizer={"device": "cpu"}), ["CPUAdagradBuilder"]),
    (_config("Lamb"), ["FusedLambBuilder"]),
    (_config("Lion"), ["FusedLionBuilder"]),
    (_config("Lion", offload_optimizer={"device": "cpu"}), ["CPULionBuilder"]),
    (_config(None), []),  # the script brings its own optimizer
    ({"optimizer": "Adam", "zero_optimization": 3}, []),  # malformed: the engine's own error
])
def test_the_ops_a_config_makes_deepspeed_load(config, expected) -> None:
    assert needed_op_builders(config) == expected


def test_an_op_already_built_in_the_folder_is_not_built_again(tmp_path: Path) -> None:
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").write_bytes(b"")
    (tmp_path / "cpu_adam").mkdir()  # a folder without its library: a build never finished
    assert missing_ops(["FusedAdamBuilder", "CPUAdamBuilder"], tmp_path) == ["CPUAdamBuilder"]
    log = tmp_path / "op_prebuild.log"
    assert prebuild_ops(["FusedAdamBuilder"], {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, log) is None
    assert not log.exists()  # no child was started
