#!/usr/bin/env bash
# Prepare this machine to run celery-autotune: redis-server (apt), a venv in .venv with the CPU or
# CUDA torch already chosen by pip's configuration, and this package with its DeepSpeed and test
# extras. Idempotent: a second run installs nothing new. Used by the README and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    echo "setup: installing redis-server (apt)"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq redis-server >/dev/null
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$python" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0"
    .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
if ! .venv/bin/python -c "import deepspeed, celery, scheduler, pytest_timeout" >/dev/null 2>&1; then
    echo "setup: installing celery-autotune[deepspeed,dev]"
    .venv/bin/pip install -q --disable-pip-version-check -e ".[deepspeed,dev]" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import torch, deepspeed, celery, scheduler" >/dev/null
echo "setup: ready (.venv, redis-server $(redis-server --version | awk '{print $3}'))"
