"""The warm path's decisions (workers.warm.warm_plan; workers.warm.warm_start.server_env): what is preloaded,
what runs cold, what the warm process's environment holds, when its code changed on disk, and when
CUDA was initialised in it. The forking itself: tests/integration/test_warm_start.py."""
from __future__ import annotations

import os
import shutil
import sys
import types
from pathlib import Path

import pytest

from workers.process.launch import CONTAINER_ENV
from workers.warm.warm_preload import code_stamp, driver_evidence, driver_initialised
from workers.warm.warm_rank import rank_sys_path
from workers.warm.warm_plan import (DEEPSPEED_PRELOAD, SWITCH_ENV, beyond_the_standard_library, code_changed,
                               import_time_env, installed_roots, preload_modules, top_level_imports, why_cold)
from workers.warm.warm_start import PRELOAD_ENV, server_env


def test_top_level_imports_in_order_including_guarded_ones_but_not_inside_functions() -> None:
    source = ("from __future__ import annotations\nimport os, torch.nn as nn\nfrom transformers import AutoModel\n"
              "from . import sibling\ntry:\n    import wandb\nexcept ImportError:\n    import json\n"
              "if True:\n    import numpy\ndef main():\n    import pandas\nimport os\n")
    assert top_level_imports(source) == ["os", "torch.nn", "transformers", "wandb", "json", "numpy"]


def test_only_installed_packages_are_preloaded_never_the_scripts_own_modules(tmp_path: Path) -> None:
    site, here = tmp_path / "site", tmp_path / "job"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    (site / "lonely.py").write_text("")
    (site / "shadowed.py").write_text("")
    here.mkdir()
    (here / "gpt_model.py").write_text("")
    (here / "shadowed.py").write_text("")  # next to the script: the rank imports this one, fresh
    script = here / "train.py"
    script.write_text("import pkg.sub\nimport lonely\nimport shadowed\nfrom gpt_model import GPT\nimport missing\n")
    chosen = preload_modules(script, [site.resolve()], [str(here), str(site)])
    assert chosen == ["pkg.sub", "lonely"]  # torch and DeepSpeed are not under this stand-in's root


def test_torch_and_deepspeed_are_preloaded_for_a_script_that_imports_them_and_only_for_one(tmp_path: Path) -> None:
    """A warm process for a script of the standard library alone would import torch for nothing:
    such a script runs cold (`beyond_the_standard_library` empty). DeepSpeed and torch._dynamo go
    with a script that uses DeepSpeed, also through Hugging Face's Trainer; a plain torch script's
    warm process imports torch and what the script imports, not DeepSpeed (2.3 s of a core a start)."""
    roots, path = installed_roots(), [str(tmp_path), *__import__("sys").path[1:]]
    trainer, plain = tmp_path / "train.py", tmp_path / "plain.py"
    hf, torch_only = tmp_path / "train_hf.py", tmp_path / "train_torch.py"
    trainer.write_text("import argparse\nimport deepspeed\n")
    plain.write_text("import argparse, json\nfrom pathlib import Path\n")
    hf.write_text("import torch\nfrom transformers import Trainer\n")
    torch_only.write_text("import argparse\nif True:\n    import torch.distributed as dist\n")
    assert preload_modules(trainer, roots, path) == [*DEEPSPEED_PRELOAD, "argparse"]
    assert preload_modules(hf, roots, path) == [*DEEPSPEED_PRELOAD, "transformers"]
    assert preload_modules(torch_only, roots, path) == ["argparse", "torch.distributed"]
    assert preload_modules(plain, roots, path) == ["argparse", "json", "pathlib"]
    assert beyond_the_standard_library(preload_modules(plain, roots, path)) == []
    assert beyond_the_standard_library(["json", "torch._dynamo", "os.path", "numpy"]) == ["torch._dynamo", "numpy"]


def test_a_script_edited_or_a_package_installed_between_launches_is_seen_at_the_next(tmp_path: Path) -> None:
    """The script's imports and where they are found are worked out once per version of the file
    and of the search path's folders (every rank asks): an edit of the script, or a package
    installed next to the others, changes the next launch's answer."""
    site, here = tmp_path / "site", tmp_path / "job"
    site.mkdir()
    here.mkdir()
    (site / "first.py").write_text("")
    script = here / "train.py"
    script.write_text("import first\nimport later\n")
    stamp = os.stat(script).st_mtime_ns
    path = [str(here), str(site)]
    assert preload_modules(script, [site.resolve()], path) == ["first"]
    (site / "later.py").write_text("")  # installed: the folder's mtime moves
    assert preload_modules(script, [site.resolve()], path) == ["first", "later"]
    script.write_text("import later\n")  # edited
    os.utime(script, ns=(stamp + 10**9, stamp + 10**9))
    assert preload_modules(script, [site.resolve()], path) == ["later"]
    assert why_cold([str(script)], {SWITCH_ENV: "1"}) is None
    script.write_text("import later\ndef (:\n")
    os.utime(script, ns=(stamp + 2 * 10**9, stamp + 2 * 10**9))
    assert "cannot be read as Python" in why_cold([str(script)], {SWITCH_ENV: "1"})


def test_what_the_warm_path_cannot_serve(tmp_path: Path) -> None:
    good = tmp_path / "train.py"
    good.write_text("print(1)\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    on = {SWITCH_ENV: "1"}
    assert why_cold([str(good)], on) is None
    assert "not a Python script" in why_cold([str(tmp_path / "run.sh")], on)
    assert "switched off" in why_cold([str(good)], {SWITCH_ENV: "0"})
    assert why_cold([str(good)], {}) is None  # on unless turned off
    assert "cannot be read as Python" in why_cold([str(broken)], on)


def test_the_warm_process_has_no_ranks_identity_but_checks_cuda_through_nvml(tmp_path: Path) -> None:
    rank = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "4",
            "AUTOTUNE_EXIT_REPORT": "/x/rank1.exit.json", CONTAINER_ENV: "launch-token", "AUTOTUNE_SLOT": "n.gpu0"}
    env = server_env(rank, "cuda", ["torch", "deepspeed"], "server-token", tmp_path / "r.json")
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "AUTOTUNE_EXIT_REPORT"} & set(env)
    assert env[CONTAINER_ENV] == "server-token" and env["AUTOTUNE_SLOT"] == "n.gpu0"
    assert env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1" and env["DS_ACCELERATOR"] == "cuda"
    assert env["OMP_NUM_THREADS"] == "4" and env[PRELOAD_ENV] == "torch,deepspeed,workers.warm.warm_rank"
    assert server_env({"DS_ACCELERATOR": "cpu"}, "cuda", [], "t", tmp_path)["DS_ACCELERATOR"] == "cpu"
    assert import_time_env({"OMP_NUM_THREADS": "4"}) != import_time_env({"OMP_NUM_THREADS": "2"})


def test_the_ranks_path_is_a_cold_ranks() -> None:
    assert rank_sys_path("/job/train.py", "/work", ["", "/pp", "/job", "/stdlib"]) == \
        ["/job", "/work", "/pp", "/stdlib"]


#: /proc/self/maps lines as Linux writes them (address, perms, offset, dev, inode, path).
LIBCUDA = "7f00a000-7f00b000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.560.35.03\n"
GPU_NODE = "7f00c000-7f00d000 rw-s 00000000 00:05 88 /dev/nvidia0\n"
UVM_MAP = "7f00e000-7f00f000 rw-s 00000000 00:05 90 /dev/nvidia-uvm\n"
TORCH = "7f010000-7f011000 r-xp 00000000 08:01 99 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so\n"


@pytest.mark.parametrize("maps, fds, initialised", [
    (TORCH, ["/dev/null", "pipe:[123]"], False),  # torch imported, CUDA untouched
    (TORCH + LIBCUDA, ["/dev/nvidiactl", "/dev/nvidia0"], False),  # libcuda loaded, NVML asked: nothing initialised
    (TORCH, ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"], True),  # cuInit (pycuda.autoinit, CuPy)
    (UVM_MAP, [], True),  # the unified-memory device mapped, its descriptor closed
    (LIBCUDA + GPU_NODE, ["/dev/nvidiactl"], True),  # a GPU's registers mapped beside the driver: a context
    (GPU_NODE, [], False),  # without the driver library: not CUDA's
    ("", [], False),  # no /proc (not Linux): nothing seen
])
def test_cuda_initialised_by_any_library_is_seen_in_the_drivers_state(maps: str, fds: list[str],
                                                                       initialised: bool) -> None:
    """torch's own flag misses pycuda.autoinit and CuPy; the driver's state in /proc does not, and
    neither torch's import nor NVML's queries (DeepSpeed's accelerator asks them) count as an
    initialisation, or the warm process would drop torch itself from its preload."""
    assert driver_initialised(maps, fds) is initialised


def _fake_distribution(site: Path, name: str, version: str) -> Path:
    """A distribution as pip leaves it in site-packages: its package and its dist-info folder."""
    for old in site.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    (site / name).mkdir(exist_ok=True)
    (site / name / "__init__.py").write_text(f"VERSION = {version!r}\n")
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    return site / name / "__init__.py"


def test_the_warm_processs_code_changes_with_an_upgrade_a_reinstall_or_an_edit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the warm process imported is stamped once (`code_stamp`, in it) and checked with a stat
    per distribution and per file of the user's own before every rank (`code_changed`): an upgrade
    (`pip install -U`: a new dist-info), a reinstall of the same version, and an edit of a module
    outside site-packages each say what changed; nothing changed says nothing."""
    site, own = tmp_path / "site", tmp_path / "src"
    site.mkdir()
    own.mkdir()
    package = _fake_distribution(site, "fakedist", "1.0")
    mine = own / "mine.py"
    mine.write_text("")
    monkeypatch.syspath_prepend(str(site))
    for name, path in (("fakedist", package), ("mine", mine)):
        module = types.ModuleType(name)
        module.__file__ = str(path)
        monkeypatch.setitem(sys.modules, name, module)
    stamp = code_stamp(site=(str(site),))
    assert stamp["distributions"]["fakedist"][0] == "1.0" and str(package) not in stamp["files"]
    assert str(mine.resolve()) in stamp["files"]
    assert not any(path.startswith(os.path.dirname(os.__file__) + os.sep) for path in stamp["files"])  # the stdlib
    assert code_changed(stamp) == ""
    _fake_distribution(site, "fakedist", "2.0")  # pip install -U
    assert "fakedist 1.0 was upgraded" in code_changed(stamp)
    stamp = code_stamp(site=(str(site),))
    metadata = site / "fakedist-2.0.dist-info" / "METADATA"
    later = os.stat(metadata).st_mtime_ns + 10**9
    os.utime(metadata, ns=(later, later))  # pip install --force-reinstall of the same version
    assert "fakedist 2.0 was upgraded, removed or reinstalled" == code_changed(stamp)
    stamp = code_stamp(site=(str(site),))
    os.utime(mine, ns=(later, later))  # the user's own module edited
    assert code_changed(stamp) == f"{mine.resolve()} was modified"
    assert code_changed(None) == "" and code_changed({}) == ""


def test_the_evidence_of_cudas_initialisation_names_what_was_seen() -> None:
    """The warm process's log says why it dropped a preload: which device was open or mapped, beside
    which driver library, so a false alarm on another machine's driver can be told from a real one."""
    assert driver_evidence(TORCH, ["/dev/nvidia-uvm"]) == "/dev/nvidia-uvm open"
    assert driver_evidence(UVM_MAP, []) == "/dev/nvidia-uvm mapped"
    assert driver_evidence(LIBCUDA + GPU_NODE, []).startswith("/dev/nvidia0 mapped beside ")
    assert "libcuda.so" in driver_evidence(LIBCUDA + GPU_NODE, [])
    assert driver_evidence(TORCH + LIBCUDA, ["/dev/nvidiactl", "/dev/nvidia0"]) == ""
