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

# The tests of `python -m deploy` start their own sshd and take a Flower screenshot with chromium;
# the two-host tests build hosts from network and PID namespaces (ip from iproute2; unshare and
# nsenter from util-linux).
missing=""
[ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
{ command -v unshare && command -v nsenter; } >/dev/null 2>&1 || missing="$missing util-linux"
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing="$missing chromium"
if [ -n "$missing" ]; then
    echo "setup: installing$missing (apt, for the deploy, two-host and Flower tests)"
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq $missing >/dev/null
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
# (again when the celery-autotune command is missing: a .venv made before it existed)
if ! .venv/bin/python -c "import deepspeed, celery, scheduler, pytest_timeout, xdist, transformers, accelerate" >/dev/null 2>&1 \
        || [ ! -x .venv/bin/celery-autotune ]; then
    echo "setup: installing celery-autotune[deepspeed,dev,hf]"
    .venv/bin/pip install -q --disable-pip-version-check -e ".[deepspeed,dev,hf]" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import torch, deepspeed, celery, scheduler" >/dev/null
# DeepSpeed JIT-compiles its CPU communication op at the first init_distributed. Do it once here,
# outside any experiment: the compiler's ~2 GB would otherwise count against a CPU slot's memory cap
# and turn the first experiment into a false OOM. The slot workers use this same cache (the venv's
# torch_extensions, or this machine's subfolder of it on a shared filesystem: workers.build_locks).
EXTENSIONS=$(.venv/bin/python -c "from workers.build_locks import default_extensions_dir; print(default_extensions_dir())")
if ! command -v nvidia-smi >/dev/null 2>&1 && ! ls "$EXTENSIONS"/deepspeed_shm_comm/*.so >/dev/null 2>&1; then
    echo "setup: compiling DeepSpeed's CPU communication op (once, about 80 s)"
    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$EXTENSIONS" .venv/bin/python -c \
        "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()" \
        >/dev/null 2>&1 || echo "setup: warning: could not pre-build deepspeed_shm_comm; the first experiment will compile it" >&2
fi
# On a GPU node, the ops DeepSpeed's GPU runs compile most often (FusedAdam for "Adam" without
# torch_adam, CPUAdam for an offloaded optimizer) are built here, for this node's GPUs, before any
# tuning; a slot worker builds any other op a config needs once per node, outside the experiment's
# limits (workers.op_prebuild). Without nvcc they cannot build: said here, and by the job's first
# experiment that needs one.
if command -v nvidia-smi >/dev/null 2>&1 && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1 \
        && ! ls "$EXTENSIONS"/fused_adam/*.so "$EXTENSIONS"/cpu_adam/*.so >/dev/null 2>&1; then
    echo "setup: compiling DeepSpeed's FusedAdam and CPUAdam for this node's GPUs (once, a few minutes)"
    REPORT=$(mktemp)
    TORCH_EXTENSIONS_DIR="$EXTENSIONS" .venv/bin/python -m workers.op_prebuild "$REPORT" FusedAdamBuilder CPUAdamBuilder \
        >/dev/null 2>&1 || true
    if [ "$(cat "$REPORT" 2>/dev/null)" != "{}" ]; then
        echo "setup: warning: could not pre-build DeepSpeed's GPU ops ($(cat "$REPORT" 2>/dev/null)); an experiment that needs one builds it first (is nvcc installed?)" >&2
    fi
    rm -f "$REPORT"
fi
echo "setup: ready (.venv, redis-server $(redis-server --version | awk '{print $3}'))"
