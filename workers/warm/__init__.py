"""A slot's warm interpreter: a forkserver that preloads torch and DeepSpeed and forks ranks ready to run.

`warm_start` drives it from the slot worker; `warm_plan` decides what it preloads and which scripts
run cold (pure); `warm_server` is the forkserver; `warm_preload` runs inside it; `warm_rank` is what
a forked process does to become the rank before `workers.in_rank.entry` runs the script;
`rank_start` says how a rank was started, warm or cold, and why.

Imports: `warm_preload` and `warm_rank` (the forkserver and the ranks it forks carry what they
import): the standard library, torch and `workers.in_rank` only (tests/unit/test_architecture.py
checks). The others: also psutil and `workers.process` (a rank's launch environment).
Imported by: `workers.slot` (the rank task), the Celery tasks, `deploy` and bench/.
"""
