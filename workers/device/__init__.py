"""What a slot is: one device of one node, what it can hold, and how a child process is bound to it.

`slot` (the `Slot` a worker serves, its capacity and its child's environment), `gpus` (nvidia-smi's
GPUs and which a process may use), `topology` (a GPU's NUMA node and cores), `cuda_binding` (does
CUDA open the slot's own GPU), `device_idle` (waiting for memory others hold on the device).

Imports: the standard library and this package; nothing of the slots' Redis state.
Imported by: `workers.state` (a slot's registration), `workers.slot`, the embedded cluster, the
scheduler, `deploy` and the Celery tasks.
"""
