"""The experiments of a search, each a complete DeepSpeed config with a DeepSpeed-style name.

Experiments are named as DeepSpeed names them (`z{stage}_gas{gas}_tmbspg{mbs}` in fast mode), so
results folders read the same; one run with memory strategies (`Experiment.strategy`) has a suffix per
strategy in DeepSpeed's style (`_oo` offload_optimizer, `_op` offload_param, `_ac` activation
checkpointing), its offload sections in zero_optimization and the strategies listed under
`arguments.STRATEGY_KEY` in its autotuning section (the script's checkpointing switch is appended
from it). Each experiment config is built from the user's config, never by mutating it. Which
experiments to run is decided by the searches (`fast_search`, `full_space`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from scheduler.inputs.arguments import STRATEGY_KEY
from scheduler.inputs.memory_strategies import MEMORY_STRATEGIES
from workers.files.layout import METRICS


#: Our own keys in the autotuning section; DeepSpeed's engine must not see them.
_OURS = ("user_script", "user_args", "results_dir", "exps_dir", "mlflow", "memory_strategies", "nvme_path")
#: Each memory strategy's suffix in an experiment's name (DeepSpeed's own offload prefixes).
STRATEGY_SUFFIX = {"offload_optimizer": "oo", "offload_param": "op", "activation_checkpointing": "ac"}
#: The autotuning key under which an experiment keeps the user's settings it turned off while
#: tuning, for `optimal_config` to restore (DeepSpeed reads only the autotuning keys it knows).
RESTORE_KEY = "restore_after_tuning"


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
    metric_file: str = METRICS  #: what rank 0 writes: model_info.json for the profile run (workers.files.layout)
    min_memory: int = 0  #: bytes every slot it runs on must offer (heterogeneous clusters)
    #: run with its nodes otherwise idle (the finalists' re-measurements: `scheduler.cluster.dispatch`)
    exclusive: bool = False
    #: the memory strategies it runs with, in MEMORY_STRATEGIES' order (`strategy_of`; () in older records)
    strategy: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, tuple):  # a JSON list from a stored record
            object.__setattr__(self, "strategy", strategy_of(self.strategy))

    def to_json(self) -> dict[str, Any]:
        """The fields as a dict of JSON values (`strategy` a list); `ds_config` is the same object
        (`asdict` would deep-copy it)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["strategy"] = list(self.strategy)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Experiment:
        return cls(**data)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus

    @property
    def space(self) -> str:
        """The tuning space it belongs to in summary.txt (fast mode: one per ZeRO stage)."""
        return self.tuning_space or f"z{self.stage}"


#: The model-info profile run's experiment name and tuning space (DeepSpeed's): not a tuning
#: experiment, so summaries, plots and rankings leave it out.
PROFILE = "profile_model_info"


def strategy_of(names: Any) -> tuple[str, ...]:
    """Strategy names as an Experiment holds them: known ones, each once, in MEMORY_STRATEGIES' order."""
    given = set(names or ())
    return tuple(name for name in MEMORY_STRATEGIES if name in given)


def strategy_label(strategy: Any) -> str:
    """The strategy as run names and phase labels spell it: `oo_ac` for the optimizer offloaded
    with checkpointing, empty for none."""
    return "_".join(STRATEGY_SUFFIX[name] for name in strategy_of(strategy))


def _suffixed(name: str, strategy: Any) -> str:
    label = strategy_label(strategy)
    return f"{name}_{label}" if label else name


def experiment_name(stage: int, gas: int, mbs: int, strategy: tuple[str, ...] = ()) -> str:
    return _suffixed(f"z{stage}_gas{gas}_tmbspg{mbs}", strategy)


def profile_name(strategy: tuple[str, ...] = ()) -> str:
    """The profile run's name, with a suffix per strategy when it runs offloaded (`strategy_search`)."""
    return _suffixed(PROFILE, strategy)


def offload_section(nvme_path: str | None = None) -> dict[str, Any]:
    """The offload section a strategy writes: to the CPU, or to NVMe under `nvme_path`
    (`autotuning.nvme_path`, parsed by `scheduler.inputs.memory_strategies`)."""
    return {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}


def experiment_config(user_config: dict[str, Any], stage: int, mbs: int, gas: int,
                      dp_size: int, start_profile_step: int, end_profile_step: int,
                      strategy: tuple[str, ...] = (), nvme_path: str | None = None) -> dict[str, Any]:
    """The user's config pinned to one point of the search, with profiling switched on.

    `dp_size` is the data-parallel degree (ranks / mp_size): train_batch_size = mbs * gas * dp_size.
    `strategy`'s offloads go to `nvme_path` when given (`MemoryStrategyKeys.nvme_path`), else to the CPU.
    The result is a new top-level dict with new `zero_optimization` and `autotuning` sections; its
    other sections are the user's own objects, shared, not copied (a search builds thousands of
    these): treat them as read-only and replace a section rather than change it in place.
    """
    config = dict(user_config)
    config["train_micro_batch_size_per_gpu"] = mbs
    config["gradient_accumulation_steps"] = gas
    config["train_batch_size"] = mbs * gas * dp_size
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = stage
    strategy = strategy_of(strategy)
    for name in ("offload_optimizer", "offload_param"):
        if name in strategy:
            zero[name] = offload_section(nvme_path)
    config["zero_optimization"] = zero
    autotuning = {k: v for k, v in config.get("autotuning", {}).items() if k not in _OURS}
    autotuning.update(enabled=True, start_profile_step=start_profile_step,
                      end_profile_step=end_profile_step)
    if strategy:
        autotuning[STRATEGY_KEY] = list(strategy)
    if config.get("memory_breakdown"):
        # DeepSpeed's memory_breakdown resets the allocator's peak counters around forward, backward
        # and step on rank 0 (and slows every step): the peak a rank reports would cover the optimizer
        # step alone. Off while tuning; the winner's config gets the user's value back.
        autotuning[RESTORE_KEY] = {"memory_breakdown": config["memory_breakdown"]}
        config["memory_breakdown"] = False
    config["autotuning"] = autotuning
    return config


def optimal_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The config to train with: the experiment's, without the autotuning section (no profiling exit),
    with the user's settings that tuning turned off restored."""
    config = copy.deepcopy(ds_config)
    autotuning = config.pop("autotuning", None) or {}
    config.update(autotuning.get(RESTORE_KEY) or {})
    return config
