#!/usr/bin/env bash
# A GPU machine that cannot reach PyPI or apt (the lent H100/H200 machines: an image with CUDA,
# Python 3.12 and torch in a venv, nothing else of ours) runs bench/gpu_smoke.sh with what this
# script carries there. Two steps, from the repository root:
#
#     bash bench/gpu_offline.sh bundle    # here, after deploy/setup.sh: fills .gpu/ (git-ignored)
#     bash bench/gpu_offline.sh install   # there: .venv over the image's venv, .gpu's wheels, redis-server
#     GPU_SMOKE_SKIP_SETUP=1 bash bench/gpu_smoke.sh
#
# `bundle` downloads, for the target Python (GPU_PYTHON, default 3.12), the wheels of what we need
# beyond torch and the image's packages, at the versions this .venv holds (Celery and its needs,
# redis-py with hiredis, hjson, pydantic; tzlocal is one Celery imports at start), builds
# DeepSpeed's wheel (pure Python: its ops are built on the GPU machine, by the slot worker), and
# copies this machine's redis-server with the libraries it links beyond the C library, behind a
# wrapper that sets LD_LIBRARY_PATH for it alone. About 15 MB.
# `install` makes .venv a venv over the image's own (a .pth naming the image venv's site-packages:
# `--system-site-packages` reaches only the base interpreter's), installs the wheels without
# touching the network, makes this checkout importable (a .pth, as `pip install -e .` would, with no
# build step), and puts the redis-server wrapper in .venv/bin, which gpu_smoke.sh puts first on
# PATH. Both steps are easy to get wrong by hand on a machine without PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.gpu
packages=(celery kombu billiard amqp vine click-didyoumean click-plugins click-repl prompt_toolkit wcwidth
          redis hiredis hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions tzlocal)

case "${1:-}" in
bundle)
    [ -x .venv/bin/python ] || { echo "gpu_offline: no .venv here; run bash deploy/setup.sh first" >&2; exit 2; }
    rm -rf "$bundle" && mkdir -p "$bundle/whl" "$bundle/bin" "$bundle/lib"
    pins=$(.venv/bin/python - "${packages[@]}" <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
EOF
)
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$bundle/whl" $pins 2>&1 | grep -v "^WARNING: Location" || true
    deepspeed=$(.venv/bin/python -c "from importlib.metadata import version; print(version('deepspeed'))")
    DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$bundle/whl" \
        "deepspeed==$deepspeed" 2>&1 | grep -v "^WARNING: Location" || true
    server=$(command -v redis-server) || { echo "gpu_offline: no redis-server here to carry" >&2; exit 2; }
    cp "$server" "$bundle/bin/redis-server.bin"
    ldd "$server" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
        | while read -r lib; do cp -L "$lib" "$bundle/lib/"; done
    cat > "$bundle/bin/redis-server" <<'EOF'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib" exec "$here/redis-server.bin" "$@"
EOF
    chmod +x "$bundle/bin/redis-server"
    wheels=$(find "$bundle/whl" -name '*.whl' | wc -l)
    if [ "$wheels" -ne $(( ${#packages[@]} + 1 )) ]; then
        echo "gpu_offline: $wheels wheels in $bundle/whl, expected $(( ${#packages[@]} + 1 ))" >&2
        exit 1
    fi
    "$bundle/bin/redis-server" --version
    echo "gpu_offline: $bundle ready ($(du -sh "$bundle" | cut -f1)); carry it with the working tree"
    ;;
install)
    [ -d "$bundle/whl" ] || { echo "gpu_offline: no $bundle/whl; run 'bash bench/gpu_offline.sh bundle' first" >&2; exit 2; }
    python3 -m venv --system-site-packages .venv
    site=$(ls -d .venv/lib/python3*/site-packages)
    python3 -c 'import site; print(site.getsitepackages()[0])' > "$site/image_venv.pth"
    .venv/bin/python -m pip install -q --no-index --no-deps --no-compile "$bundle"/whl/*.whl 2>&1 \
        | grep -v "^WARNING" || true
    echo "$PWD" > "$site/celery_autotune_src.pth"  # this checkout importable, as `pip install -e .` would
    ln -sf "../../$bundle/bin/redis-server" .venv/bin/redis-server
    .venv/bin/python -c "import torch, deepspeed, celery, scheduler; print('gpu_offline: torch', torch.__version__,
        'deepspeed', deepspeed.__version__, 'celery', celery.__version__, 'CUDA', torch.cuda.is_available())"
    .venv/bin/redis-server --version
    ;;
*)
    echo "usage: bash bench/gpu_offline.sh bundle|install" >&2
    exit 2
    ;;
esac
