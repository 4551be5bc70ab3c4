"""Moves processes between hosts: machine set-up (setup.sh), `python -m deploy` (fabric start/stop of
workers, remote clean-up of recorded process groups) and systemd/Slurm templates."""
