"""The search: which experiments to run next, given what the ones before measured. Pure: no Redis, no
Celery, no files, no clock; a search is a generator of phases (`phases`), fed the records a real run
leaves, so it runs the same on a cluster, in a replay after a crash and in bench/'s replays.

- `space`: an experiment (stage, micro-batch, accumulation) and its DeepSpeed config;
- `memory`: the memory model, calibrated by the profile run and by every probe; `memory_facts`: what
  the probes so far predict about each stage's largest micro-batch (a misleading profile found out
  by its first failure);
- `session`: the state both searches share (what was measured, what memory it proves);
- `global_batch`: the user's train_batch_size kept by every experiment, or freed;
- `strategies`: memory strategies (offload, activation checkpointing) the user allows, what each
  frees and costs; `strategy_fit`: the one a model needs to fit at all (`strategy_swap`: its
  optimizer offload swapped for parameter offload at ZeRO-3 once); `strategy_search`: the
  larger micro-batch one lets a leader at its memory top run (`strategy_first`: tried from the lead
  stage's top before its refinement); `strategy_lines`: the memory line of
  a stage under a strategy, where its probes are read off; `strategy_time`: a run's step as the
  strategies' time priors read it;
- `deepspeed_memory`: DeepSpeed's own memory estimate, for `"estimator": "deepspeed"`;
- `fast_search`: DeepSpeed's fast/full mode with its defects fixed; `sampled_search` (the default:
  a stage sampled and refined), `stage_follow` (which later stages it explores, each followed from
  the incumbent), with `sampling` (its pure decisions: the next size, the stage order, the saw-tooth neighbour),
  `stage_space` (what a stage holds, the sizes worth measuring) and `stage_readings` (what a stage's
  readings say); `cost_model` (seconds per sample fitted to a stage's readings: the reading it
  contradicts is measured again, and of two readings the one it agrees with is read) with
  `ceilings` (a config whose readings its stage's curve contradicts is ranked at the curve until
  they settle) and
  `fit_check` (its leave-one-out predictions against what a job read, for the report);
  `repeats` (one policy for every search of ours: a crash launched once more, the winner confirmed)
  with `confirm` (re-measuring the leaders until they are told apart); `second_round` (a stage
  refined again when confirming moved its lead); `full_space` and `tuners`
  (full mode's knob points: grid, random, model-based); `ranking` (the best config from records: the mean of its readings, the median from three);
  `live_search` (what the live view shows of a running search).

Imports: `scheduler.inputs`, `scheduler.errors`, `workers.files` (the names of what a run writes).
Imported by: report, cluster and the commands.
"""
