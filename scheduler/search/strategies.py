"""Memory strategies as dimensions of the search: which the user allows, what each frees, what each costs.

Why: DeepSpeed's autotuner tunes neither offload nor activation checkpointing, so a model that does
not fit is out of reach and one that fits only at a small micro-batch is never tried at a larger one
with checkpointing. Here three strategies are dimensions the user allows in the config
(`autotuning.memory_strategies`, docs/config.md "Memory strategies"):

- `offload_optimizer` (ZeRO-1 and up): the optimizer states (Adam's moments and the fp32 master
  weights, 12 bytes per parameter on the rank's shard) live on the CPU, or NVMe with
  `autotuning.nvme_path`; the memory model drops them (`TrainingSetup.offload_optimizer`);
- `offload_param` (ZeRO-3 only): the parameters too (`TrainingSetup.offload_param`);
- `activation_checkpointing`: the script's own switch (mapped in `autotuning.arg_mappings`) keeps a
  share of each sample's activations and recomputes the rest in the backward pass. The share is
  a prior, `CHECKPOINT_KEEP_PRIOR` (a block's input kept of the dozen tensors a transformer block
  holds per sample; logits and the loss stay whole), replaced by the share a checkpointed run
  measured once one reports its peak (`measured_keep_share`).

A strategy the user's own config already sets is kept fixed in every experiment, not searched: an
offload section with device cpu or nvme, or the checkpointing switch among the script's arguments.
On CPU slots the capacity is host memory, so offloading to the CPU frees nothing and is not a choice.

Time, as priors (`step_cost_s`): checkpointing recomputes about a third of forward and backward
(`RECOMPUTE_SHARE`: the forward again, a third of forward + backward); optimizer offload runs
the optimizer step over the rank's shard on the CPU (`CPU_ADAM_PARAMS_PER_S`) and moves the
gradients down and the updated weights up over PCIe (`PCIE_BYTES_PER_S`) once per optimizer
step; parameter offload moves the rank's parameters up in every forward and backward. Before
anything is timed, candidates are ordered by `PRIOR_RANK` (the same priors for a compute-bound
step: checkpointing costs at most a third more compute, optimizer offload one CPU step amortized
over the accumulation, parameter offload traffic every micro-step), fewest strategies first.

Pure: no session, no records; `scheduler.search.strategy_search` applies it to a search.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any

from scheduler.inputs.memory_strategies import MemoryStrategyKeys
from scheduler.search.memory import MemoryModel, ModelInfo, TrainingSetup
from scheduler.search.space import strategy_of

#: Share of a sample's activations a checkpointed run keeps, before one has measured it.
CHECKPOINT_KEEP_PRIOR = 0.3
#: A measured share is clamped to this range (a peak's noise can put it below 0 or above 1).
MIN_KEEP_SHARE, MAX_KEEP_SHARE = 0.05, 1.0
#: Share of forward + backward that checkpointing recomputes (one more forward: 1 of 3 units).
RECOMPUTE_SHARE = 1 / 3
#: DeepSpeed's CPU Adam, parameters updated per second (ZeRO-Offload's figures: about 1 s per
#: billion parameters on a server's cores).
CPU_ADAM_PARAMS_PER_S = 1e9
#: Host-device bandwidth one rank gets (PCIe 4 x16 in practice, shared by the node's GPUs).
PCIE_BYTES_PER_S = 12e9
#: The order before anything is timed (module docstring): lower first.
PRIOR_RANK = {"activation_checkpointing": 0, "offload_optimizer": 1, "offload_param": 2}
#: The smallest ZeRO stage each strategy works at.
MIN_STAGE = {"activation_checkpointing": 0, "offload_optimizer": 1, "offload_param": 3}
_FREEING_DEVICES = ("cpu", "nvme")


def fixed_by_user(ds_config: Mapping[str, Any], checkpointing_fixed: bool = False) -> tuple[str, ...]:
    """The strategies the user's own config sets: an offload section with device cpu or nvme, and
    checkpointing when the script's arguments already turn it on."""
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    fixed = []
    for name in ("offload_optimizer", "offload_param"):
        section = zero.get(name)
        device = section.get("device") if isinstance(section, Mapping) else None
        if isinstance(device, str) and device.lower() in _FREEING_DEVICES:
            fixed.append(name)
    if checkpointing_fixed:
        fixed.append("activation_checkpointing")
    return strategy_of(fixed)


def searchable(keys: MemoryStrategyKeys, ds_config: Mapping[str, Any], host_memory: bool,
               checkpointing_fixed: bool = False, names: Sequence[str] | None = None) -> tuple[str, ...]:
    """The strategies that are dimensions of the search: `names` (default: the ones `keys` allows) less
    those the user's config fixed, and less CPU offload where the capacity is host memory (it frees
    nothing) unless `keys` sends offload to NVMe."""
    names = keys.allowed if names is None else strategy_of(names)
    fixed = fixed_by_user(ds_config, checkpointing_fixed)
    nvme = bool(keys.nvme_path)
    return tuple(name for name in names if name not in fixed
                 and not (host_memory and not nvme and name.startswith("offload_")))


def applies(strategy: Sequence[str], stage: int) -> bool:
    """Whether every strategy of `strategy` works at `stage` (`MIN_STAGE`)."""
    return all(stage >= MIN_STAGE[name] for name in strategy)


def ordered_combinations(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every non-empty combination of `names`, cheapest by the priors first (module docstring)."""
    names = strategy_of(names)
    found = [combo for size in range(1, len(names) + 1) for combo in combinations(names, size)]
    return sorted(found, key=lambda combo: (len(combo), sorted(PRIOR_RANK[n] for n in combo)))


def strategy_model(model: MemoryModel, strategy: Sequence[str],
                   keep_share: float = CHECKPOINT_KEEP_PRIOR) -> MemoryModel:
    """The memory model of runs with `strategy` added: offload drops the states it moves (the
    model's own `TrainingSetup` flags), checkpointing keeps `keep_share` of each sample's activations."""
    setup: TrainingSetup = model.setup
    if "offload_optimizer" in strategy:
        setup = replace(setup, offload_optimizer=True)
    if "offload_param" in strategy:
        setup = replace(setup, offload_param=True)
    info: ModelInfo = model.info
    if "activation_checkpointing" in strategy:
        info = replace(info, activation_mem_per_gpu=int(info.activation_mem_per_gpu * keep_share))
    return replace(model, info=info, setup=setup)


def freed_bytes(model: MemoryModel, strategy: Sequence[str], stage: int) -> int:
    """What the strategy's offload frees at `stage` in every run, whatever the micro-batch."""
    return model.held_bytes(stage) - strategy_model(model, strategy).held_bytes(stage)


def measured_keep_share(peak_bytes: float, fixed_bytes: float, per_sample_bytes: float, mbs: int) -> float | None:
    """The share of a sample's activations a checkpointed run at `mbs` kept: its peak above the
    fixed memory of its config, over what `mbs` samples hold without checkpointing (None: no figure)."""
    if per_sample_bytes <= 0 or mbs < 1 or peak_bytes <= 0:
        return None
    share = (peak_bytes - fixed_bytes) / (per_sample_bytes * mbs)
    return min(MAX_KEEP_SHARE, max(MIN_KEEP_SHARE, share))


@dataclass(frozen=True)
class StepFacts:
    """What a strategy's time cost depends on, for one rank and one optimizer step."""

    compute_s: float  #: forward + backward of every micro-step of the step
    micro_steps: int  #: gradient accumulation steps
    shard_params: int  #: parameters of the rank's optimizer shard (trainable / dp from ZeRO-1)
    rank_params: int  #: parameters the rank holds in forward and backward (all of them, / dp at ZeRO-3)
    width: int = 2  #: bytes per parameter and gradient on the device (2 in fp16/bf16, 4 in fp32)


def step_cost_s(strategy: Sequence[str], facts: StepFacts) -> float:
    """Seconds a strategy adds to one optimizer step, by the priors (module docstring)."""
    cost = 0.0
    if "activation_checkpointing" in strategy:
        cost += RECOMPUTE_SHARE * facts.compute_s
    if "offload_optimizer" in strategy:  # CPU Adam over the shard; gradients down and weights up
        cost += facts.shard_params / CPU_ADAM_PARAMS_PER_S + 2 * facts.width * facts.shard_params / PCIE_BYTES_PER_S
    if "offload_param" in strategy:  # the parameters come up for the forward and again for the backward
        cost += facts.micro_steps * 2 * facts.width * facts.rank_params / PCIE_BYTES_PER_S
    return cost


def allow_line(strategy: Sequence[str]) -> str:
    """The config line that allows `strategy` (for a refusal that names it)."""
    names = ", ".join(f'"{name}"' for name in strategy_of(strategy))
    line = f'"autotuning": {{"memory_strategies": [{names}]'
    if "activation_checkpointing" in strategy:
        line += ', "arg_mappings": {"activation_checkpointing": "<your script\'s checkpointing flag>"}'
    return line + "}"
