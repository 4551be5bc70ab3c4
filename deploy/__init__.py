"""Moves processes between hosts: machine set-up (setup.sh) now; fabric start/stop of workers later."""
