"""Run by tests/integration/test_killed_run.py in a pytest run started with SIGINT ignored: writes the
SigIgn mask of a command a test starts, as a test's Ctrl-C would find it."""
import os
import subprocess
import sys


def test_a_started_command_takes_sigint() -> None:
    mask = subprocess.run([sys.executable, "-c", "import re; print(re.search(r'SigIgn:\\s*(\\w+)', "
                           "open('/proc/self/status').read()).group(1))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.environ["SIGINT_INNER_OUT"], "w") as out:
        out.write(mask)
