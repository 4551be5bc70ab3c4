"""Full mode's experiments: a stage's ZeRO-knob space x micro-batch sizes, named the way DeepSpeed names them.

DeepSpeed's full mode (`autotuning.fast: false`) tunes, per ZeRO stage, a small grid of ZeRO knobs
combined with the micro-batch sizes its fast phase kept. The space a config defines (DeepSpeed's
defaults overridden by the user's zero section), its grid and its names are `scheduler.inputs.
full_mode` and `experiment_names`, where the config is read and a space whose points cannot name
folders is refused; here each point becomes an experiment config built from the user's config.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scheduler.inputs.config import TuningConfig
from scheduler.inputs.experiment_names import MBS, ZERO, canonical_name, naming_view
from scheduler.inputs.full_mode import distinct, name_refusal, points, template, tuning_keys, zero_section, zero_space
from scheduler.search.session import SearchAborted
from scheduler.search.space import Experiment, experiment_config


def space_name(overrides: Mapping[str, Any], stage: int, micro_batch_sizes: Sequence[int]) -> str:
    """DeepSpeed's tuning-space name, e.g. `z1_rbs_abs_tmbspg` (keys only, in space order);
    `overrides`: the user's zero section as parsed (`TuningConfig.full_mode.zero`)."""
    space = {ZERO: zero_space(overrides, stage), MBS: distinct(micro_batch_sizes)}
    return canonical_name(space, tuning_keys(space), prefix=f"z{stage}_", omit_val=True)


def full_experiments(cfg: TuningConfig, stage: int, micro_batch_sizes: Sequence[int],
                     max_train_batch_size_per_gpu: int, num_nodes: int, num_gpus: int,
                     hidden_size: int | None = None) -> list[Experiment]:
    """Every distinct (ZeRO knobs, micro-batch size) point of the stage's space, in grid order.

    The grid order is DeepSpeed's product order: zero keys in space order, the micro-batch size
    varying fastest. gas = max_train_batch_size_per_gpu // mbs (at least 1), as in DeepSpeed.
    `hidden_size` (stage 3) sizes the template's prefetch bucket and persistence threshold. Names
    the config's check could not foresee (micro-batch sizes that name alike, a name grown too long
    at a large accumulation) end the search with the same line (`SearchAborted`).
    """
    if not micro_batch_sizes:
        raise ValueError("full mode needs at least one micro-batch size to combine with")
    overrides = cfg.full_mode.zero
    space = {ZERO: zero_space(overrides, stage), MBS: distinct(micro_batch_sizes)}
    tuning = tuning_keys(space)
    name_of_space = canonical_name(space, tuning, prefix=f"z{stage}_", omit_val=True)
    base = template(stage, hidden_size, overrides)
    experiments: list[Experiment] = []
    for point in points(space):
        mbs = point[MBS]
        gas = max(1, max_train_batch_size_per_gpu // mbs)
        ds_config = experiment_config(cfg.ds_config, stage, mbs, gas, num_nodes * num_gpus,
                                      cfg.start_profile_step, cfg.end_profile_step)
        ds_config[ZERO] = zero_section(base, point[ZERO])
        name = canonical_name(naming_view(ds_config), tuning, prefix=f"z{stage}_")
        experiments.append(Experiment(
            name=name, stage=stage, micro_batch_size=mbs, gradient_accumulation_steps=gas,
            ds_config=ds_config, num_nodes=num_nodes, num_gpus=num_gpus, tuning_space=name_of_space))
    refusal = name_refusal(cfg.path, space[ZERO], [exp.name for exp in experiments])
    if refusal is not None:
        raise SearchAborted(refusal)
    return experiments
