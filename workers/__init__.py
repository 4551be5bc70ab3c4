"""Runs on a slot: device binding, slot registration, launching the user's script, classifying how it ended.

This is the lowest layer: it imports nothing from `tasks/` or `scheduler/`, so a slot worker on a
remote node needs only this package and the Celery app.
"""
