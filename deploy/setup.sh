#!/usr/bin/env bash
# Prepare this machine to tune (README command 1): redis-server, a venv in .venv with torch and this
# package with its DeepSpeed extra, and DeepSpeed's ops built once. Only what tuning needs: what the
# tests alone use is deploy/setup_tests.sh's. Idempotent: a second run installs nothing new.
#
#   bash deploy/setup.sh [--extras deepspeed,hf]    # the package's extras (default: deepspeed)
#
# torch: with nvidia-smi on this machine, pip's default build (on Linux the CUDA one). Without it,
# the CPU build from https://download.pytorch.org/whl/cpu (a few hundred MB, not several GB), or
# pip's own index when that cannot be reached; setup says which. TORCH_INDEX_URL names the index
# on any machine (a CPU or a given CUDA build, a mirror).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=deepspeed
if [ "${1:-}" = "--extras" ] && [ -n "${2:-}" ]; then
    extras=$2
elif [ $# -gt 0 ]; then
    echo "usage: bash deploy/setup.sh [--extras deepspeed,hf]" >&2
    exit 2
fi
TORCH="torch==2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
python=${PYTHON:-python3}
"$python" -c "import sys; assert sys.version_info >= (3, 10)" 2>/dev/null \
    || { echo "setup: error: $python is not Python 3.10 or newer (PYTHON names another)" >&2; exit 1; }

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [ ! -x .venv/bin/pip ] && ! "$python" -c "import ensurepip, venv" >/dev/null 2>&1; then
    missing+=("python$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
[ ${#missing[@]} -eq 0 ] || bash deploy/apt_install.sh "for tuning" "${missing[@]}"

if [ ! -x .venv/bin/pip ]; then
    echo "setup: creating .venv"
    "$python" -m venv .venv
fi
pip_install() {  # pip's output only when it says something; a failure stops setup
    local log
    log=$(mktemp)
    if ! .venv/bin/pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "setup: error: pip install $* failed" >&2
        exit 1
    fi
    grep -v "^WARNING: Location" "$log" || true
    rm -f "$log"
}
reachable() {
    timeout 10 "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$1" \
        >/dev/null 2>&1
}
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    index=()
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        index=(--index-url "$TORCH_INDEX_URL")
        echo "setup: installing $TORCH from $TORCH_INDEX_URL (TORCH_INDEX_URL)"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        echo "setup: installing $TORCH, pip's default build (on Linux the CUDA one: this machine has nvidia-smi)"
    elif reachable "$CPU_INDEX/"; then
        index=(--index-url "$CPU_INDEX")
        echo "setup: installing the CPU build of $TORCH from $CPU_INDEX (no nvidia-smi here)"
    else
        echo "setup: installing $TORCH from pip's own index: no nvidia-smi here, but $CPU_INDEX cannot be reached" \
             "(PyPI's Linux wheel is the CUDA build, several GB; TORCH_INDEX_URL names a CPU index)"
    fi
    pip_install "${index[@]}" "$TORCH"
fi

# The package is installed again when pyproject.toml changes (a dependency added) or an extra is
# asked for the first time: .venv/celery-autotune-setup holds "extra pyproject-sha256" per line.
STAMP=.venv/celery-autotune-setup
sha=$(sha256sum pyproject.toml | cut -c1-64)
wanted=$(echo "base,$extras" | tr ',' '\n' | sed "s/\$/ $sha/" | sort -u)
have=$(grep " $sha\$" "$STAMP" 2>/dev/null | sort -u || true)
if [ -n "$(comm -23 <(echo "$wanted") <(echo "$have"))" ] || [ ! -x .venv/bin/celery-autotune ] \
        || ! .venv/bin/python -c "import celery, scheduler" >/dev/null 2>&1; then
    echo "setup: installing celery-autotune[$extras]"
    pip_install -e ".[$extras]"
    .venv/bin/python -c "import torch, celery, scheduler" >/dev/null
    printf '%s\n' "$have" "$wanted" | grep . | sort -u > "$STAMP"
fi

# DeepSpeed JIT-compiles its CPU communication op at the first init_distributed. Do it once here,
# outside any experiment: the compiler's ~2 GB would otherwise count against a CPU slot's memory cap
# and turn the first experiment into a false OOM. The slot workers use this same cache (the venv's
# torch_extensions, or this machine's subfolder of it on a shared filesystem: workers.slot.build_locks).
if .venv/bin/python -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('deepspeed'))"; then
    EXTENSIONS=$(.venv/bin/python -c "from workers.slot.build_locks import default_extensions_dir; print(default_extensions_dir())")
    if ! command -v nvidia-smi >/dev/null 2>&1 && ! ls "$EXTENSIONS"/deepspeed_shm_comm/*.so >/dev/null 2>&1; then
        echo "setup: compiling DeepSpeed's CPU communication op (once, a few minutes)"
        DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$EXTENSIONS" .venv/bin/python -c \
            "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()" \
            >/dev/null 2>&1 || echo "setup: warning: could not pre-build deepspeed_shm_comm; the first experiment will compile it" >&2
    fi
    # On a GPU node, the ops DeepSpeed's GPU runs compile most often (FusedAdam for "Adam" without
    # torch_adam, CPUAdam for an offloaded optimizer) are built here, for this node's GPUs, before any
    # tuning; a slot worker builds any other op a config needs once per node, outside the experiment's
    # limits (workers.slot.op_prebuild). Without nvcc they cannot build: said here, and by the job's first
    # experiment that needs one.
    if command -v nvidia-smi >/dev/null 2>&1 && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1 \
            && ! ls "$EXTENSIONS"/fused_adam/*.so "$EXTENSIONS"/cpu_adam/*.so >/dev/null 2>&1; then
        echo "setup: compiling DeepSpeed's FusedAdam and CPUAdam for this node's GPUs (once, a few minutes)"
        REPORT=$(mktemp)
        TORCH_EXTENSIONS_DIR="$EXTENSIONS" .venv/bin/python -m workers.slot.op_prebuild "$REPORT" FusedAdamBuilder CPUAdamBuilder \
            >/dev/null 2>&1 || true
        if [ "$(cat "$REPORT" 2>/dev/null)" != "{}" ]; then
            echo "setup: warning: could not pre-build DeepSpeed's GPU ops ($(cat "$REPORT" 2>/dev/null)); an experiment that needs one builds it first (is nvcc installed?)" >&2
        fi
        rm -f "$REPORT"
    fi
fi
torch_version=$(.venv/bin/python -c "from importlib.metadata import version; print(version('torch'))")
echo "setup: ready (.venv with torch $torch_version and celery-autotune[$extras], redis-server $(redis-server --version | awk '{print $3}' | sed 's/^v=//'))"
