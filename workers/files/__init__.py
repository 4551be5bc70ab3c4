"""What the tool writes into a folder: file names and the atomic writes and safe joins every writer uses.

`paths` writes JSON atomically and joins a name under a folder without leaving it; `layout` names
what a results folder holds (the overwrite guard reads it too).

Imports: the standard library only.
Imported by: the slot worker's packages, the embedded cluster, the scheduler and the Celery tasks; never
by `workers.in_rank` (the training process stays clear of them).
"""
