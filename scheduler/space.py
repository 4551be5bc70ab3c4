"""The experiments of a search, each a complete DeepSpeed config with a DeepSpeed-style name.

"User list" mode: every combination of the listed micro-batch sizes and ZeRO stages, named as
DeepSpeed's fast mode names them (`z{stage}_gas{gas}_tmbspg{mbs}`), so results folders read the
same. Each experiment config is built from the user's config, never by mutating it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from scheduler.config import TuningConfig

#: Our own keys in the autotuning section; DeepSpeed's engine must not see them.
_OURS = ("user_script", "user_args", "results_dir", "exps_dir")


@dataclass(frozen=True)
class Experiment:
    """One configuration to measure, and the shape of the slots it needs."""

    name: str
    stage: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    ds_config: dict[str, Any] = field(compare=False)
    num_nodes: int = 1
    num_gpus: int = 1
    tuning_space: str = ""  #: full mode: DeepSpeed's space name (e.g. z1_rbs_abs_tmbspg)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus

    @property
    def space(self) -> str:
        """The tuning space it belongs to in summary.txt (fast mode: one per ZeRO stage)."""
        return self.tuning_space or f"z{self.stage}"


def experiment_name(stage: int, gas: int, mbs: int) -> str:
    return f"z{stage}_gas{gas}_tmbspg{mbs}"


def experiment_config(user_config: dict[str, Any], stage: int, mbs: int, gas: int,
                      world_size: int, start_profile_step: int, end_profile_step: int) -> dict[str, Any]:
    """The user's config pinned to one point of the search, with profiling switched on."""
    config = copy.deepcopy(user_config)
    config["train_micro_batch_size_per_gpu"] = mbs
    config["gradient_accumulation_steps"] = gas
    config["train_batch_size"] = mbs * gas * world_size
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = stage
    config["zero_optimization"] = zero
    autotuning = {k: v for k, v in config.get("autotuning", {}).items() if k not in _OURS}
    autotuning.update(enabled=True, start_profile_step=start_profile_step,
                      end_profile_step=end_profile_step)
    config["autotuning"] = autotuning
    return config


def user_list_experiments(cfg: TuningConfig, num_nodes: int, num_gpus: int) -> list[Experiment]:
    """Every (stage, micro-batch size) combination, stage-major, smallest batch first."""
    gas = cfg.gradient_accumulation_steps
    world = num_nodes * num_gpus
    return [
        Experiment(
            name=experiment_name(stage, gas, mbs), stage=stage, micro_batch_size=mbs,
            gradient_accumulation_steps=gas,
            ds_config=experiment_config(cfg.ds_config, stage, mbs, gas, world,
                                        cfg.start_profile_step, cfg.end_profile_step),
            num_nodes=num_nodes, num_gpus=num_gpus,
        )
        for stage in cfg.stages
        for mbs in cfg.micro_batch_sizes
    ]


def optimal_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The config to train with: the experiment's, without the autotuning section (no profiling exit)."""
    config = copy.deepcopy(ds_config)
    config.pop("autotuning", None)
    return config
