"""DeepSpeed's runner, re-implemented: where a training may run and how it is started.

- `hostfile`: MPI-style hostfiles (`HOSTNAME slots=N`), read and checked;
- `resources`: `--include/--exclude/--num_nodes/--num_gpus` and CUDA_VISIBLE_DEVICES to a selection
  of hosts and device ids, with DeepSpeed's semantics and its defects fixed (pure);
- `pool`: a tuning's resource pool (`--hostfile/--include/--exclude`) matched to the registered slots (pure);
- `launch_spec`: what one launch is, and the command one node runs (DeepSpeed's launcher, torchrun);
- `launchers`: the multi-node backends by `--launcher` name, behind one interface (`backend`), one
  module per family: `pdsh_launcher`, `mpi_launchers` (Open MPI, MPICH, Intel MPI, MVAPICH),
  `slurm_launcher`;
- `environment`: what a launch exports (`.deepspeed_env`, the variables DeepSpeed forwards);
- `elastic`: DeepSpeed's elastic batch sizes.

Beside the search, not above or below it: neither imports the other.

Imports: `scheduler.errors`, `workers` (the local GPU listing). Imported by: cluster, the commands
(`python -m scheduler.run`, `python -m scheduler.resources`) and `deploy`.
"""
