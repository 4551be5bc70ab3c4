"""The training processes a slot starts: their launch, their memory, their names, their files.

`launch` starts a rank in its own process group under the slot's memory cap and ends the group;
`tree_memory` reads a process tree's memory cheaply; `process_identity` tells what a training process
is from its title and its slot's record; `launch_files` names what one launch writes;
`shared_memory` removes the /dev/shm segments DeepSpeed's CPU all-reduce leaves.

Imports: the standard library, psutil, redis, `workers.in_rank`, `workers.files`, `workers.state` and
this package; never `workers.warm` or `workers.slot`.
Imported by: `workers.warm`, `workers.slot`, the embedded cluster, `python -m scheduler.run`, `deploy`
and the Celery tasks.
"""
