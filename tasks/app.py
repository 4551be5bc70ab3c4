"""The Celery app: `celery -A tasks` finds it through the package, every task module registers on it.

Its own module so that the task modules import the app and the package imports the task modules,
with no import going back up (tests/unit/test_architecture.py). Its settings are celeryconfig.py's.
"""
from celery import Celery

app = Celery("tasks")
app.config_from_object("celeryconfig")
