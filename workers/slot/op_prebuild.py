"""DeepSpeed's ops built on the node before an experiment's script starts, outside its limits.

Why: DeepSpeed compiles an op the first time a run needs it (FusedAdam for `"optimizer": "Adam"`
without `torch_adam`, CPUAdam with an offloaded optimizer, ...), inside the first experiments on each
node: the compiler's gigabyte then counts against the slot's memory cap (a false `oom` that bounds
the search), its minutes against the experiment's time limit (a false `timeout`), and every rank of
the node waits on torch's build lock meanwhile. So the slot worker works out from
the experiment's DeepSpeed config which ops its engine will load (`needed_op_builders`, pure, read
from DeepSpeed 0.19's `_configure_basic_optimizer` and ZeRO-3's init) and, before the script starts,
builds each one the node's extension folder lacks (`prebuild_ops`): in a child interpreter with the
rank's environment (its accelerator, its GPUs, its TORCH_EXTENSIONS_DIR, MAX_JOBS = its cores), with
no memory cap, under torch's own build lock, so the ranks of one node build it once and every later
experiment only loads it. The dispatcher adds `PREBUILD_TIMEOUT_S` to such a launch's deadlines, and
the ranks of a multi-rank experiment start their scripts together once every node has its ops.

The config cannot prove the script uses the op (a script may hand `deepspeed.initialize` an
optimizer of its own, which overrides the config's), so a failed prebuild is advisory: the record
keeps it as `op_prebuild_failed` and the script runs; if the script really needs the op, it fails
to build it itself and `workers.in_rank.op_build` stops the job with the op and the fix.

`python -m workers.slot.op_prebuild REPORT BUILDER...` is that child: it loads each builder through
`deepspeed.accelerator.get_accelerator().create_op_builder`, printing the build's output, and writes
`{"failed": "<op>: <error>"}` or `{}` to REPORT.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from workers.slot.build_locks import clear_stale_locks, run_to_end

#: DeepSpeed's builder class for each op and the folder name its JIT build gets (the builder's NAME).
OP_NAMES = {
    "FusedAdamBuilder": "fused_adam", "CPUAdamBuilder": "cpu_adam", "CPUAdagradBuilder": "cpu_adagrad",
    "FusedLambBuilder": "fused_lamb", "FusedLionBuilder": "fused_lion", "CPULionBuilder": "cpu_lion",
    "AsyncIOBuilder": "async_io", "QuantizerBuilder": "quantizer",
    "ShareMemCommBuilder": "deepspeed_shm_comm",  # the CPU all-reduce: deploy/setup.sh builds it
}
#: The longest the builds before one experiment may take (FusedAdam with nvcc: a few minutes).
PREBUILD_TIMEOUT_S = 900.0

#: Ops this process has seen load without a JIT folder (installed with DS_BUILD_OPS=1): not asked again.
_LOADED_HERE: set[tuple[str, str]] = set()
#: Ops this process saw fail to build, with the failure: not built again before every experiment.
_FAILED_HERE: dict[tuple[str, str], str] = {}


def needed_op_builders(ds_config: Mapping[str, Any]) -> list[str]:
    """The builder classes DeepSpeed's engine will load for this config, as its
    `_configure_basic_optimizer` chooses them: Adam, AdamW and Muon's Adam take torch's optimizer
    with a true `torch_adam`, CPUAdam with the optimizer offloaded to cpu or nvme, FusedAdam
    otherwise; Adagrad and Lion their CPU op when offloaded; Lamb FusedLamb; ZeRO-3 async I/O when
    it offloads to NVMe and the quantizer with quantized weights. A config without an optimizer
    section brings its own optimizer: none for it."""
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    optimizer_offloaded = _device(zero.get("offload_optimizer")) in ("cpu", "nvme") or zero.get("cpu_offload") is True
    needed = []
    optimizer = ds_config.get("optimizer")
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("type"), str):
        name = optimizer["type"].lower()
        params = optimizer.get("params")
        torch_adam = isinstance(params, Mapping) and bool(params.get("torch_adam"))
        if name in ("adam", "adamw", "muon") and not torch_adam:
            needed.append("CPUAdamBuilder" if optimizer_offloaded else "FusedAdamBuilder")
        elif name == "adagrad" and optimizer_offloaded:
            needed.append("CPUAdagradBuilder")
        elif name == "lamb":
            needed.append("FusedLambBuilder")
        elif name == "lion":
            needed.append("CPULionBuilder" if optimizer_offloaded else "FusedLionBuilder")
    if zero.get("stage") == 3:
        if "nvme" in {_device(zero.get(key)) for key in ("offload_optimizer", "offload_param")}:
            needed.append("AsyncIOBuilder")
        if zero.get("zero_quantized_weights") is True or zero.get("zero_quantized_nontrainable_weights") is True:
            needed.append("QuantizerBuilder")
    return needed


def _device(offload: object) -> str | None:
    return offload.get("device") if isinstance(offload, Mapping) else None


def missing_ops(builders: list[str], extensions_dir: str | os.PathLike[str]) -> list[str]:
    """The builders whose op has no built library in `extensions_dir` and has not loaded in this process."""
    root = Path(extensions_dir)
    return [builder for builder in builders
            if not (root / OP_NAMES[builder] / f"{OP_NAMES[builder]}.so").is_file()
            and (str(root), builder) not in _LOADED_HERE]


def prebuild_ops(builders: list[str], env: Mapping[str, str], log_path: Path,
                 keep_alive: Callable[[], bool] | None = None, timeout_s: float = PREBUILD_TIMEOUT_S,
                 on_start: Callable[[int], None] | None = None) -> str | None:
    """Build or load, in a child interpreter with the rank's `env`, each of `builders` the node does
    not have yet (see the module). Returns None when every op loads (or the launch was stopped),
    else the failure as "<op>: <error>". `keep_alive` is called every second (the rank renews its
    lease there); when it says stop, the build is stopped. `on_start` gets the child's process
    group (the rank records it, so a revoked task or a restarted worker kills the build too)."""
    extensions_dir = str(Path(env["TORCH_EXTENSIONS_DIR"]))
    missing = missing_ops(builders, extensions_dir)
    known = [_FAILED_HERE[(extensions_dir, builder)] for builder in missing if (extensions_dir, builder) in _FAILED_HERE]
    todo = [builder for builder in missing if (extensions_dir, builder) not in _FAILED_HERE]
    if not todo:
        return known[0] if known else None
    report = log_path.with_suffix(".json")
    report.unlink(missing_ok=True)
    started = time.time()
    code = run_to_end([sys.executable, "-m", "workers.slot.op_prebuild", str(report), *todo], log_path,
                      keep_alive, timeout_s, env=dict(env), on_start=on_start)
    ops = ", ".join(OP_NAMES[builder] for builder in todo)
    if code is None:  # killed: its lock would make the node's next build wait forever
        clear_stale_locks(extensions_dir, fresh_s=0.0, since=started)
        return None if keep_alive is not None and keep_alive() else f"{ops}: not built within {timeout_s:g}s"
    try:
        failed = json.loads(report.read_text()).get("failed")
    except (OSError, ValueError, AttributeError):
        failed = f"{ops}: the build exited {code} without a report; see {log_path.name}"
    if failed:
        for builder in todo:
            if str(failed).startswith(f"{OP_NAMES[builder]}: "):
                _FAILED_HERE[(extensions_dir, builder)] = str(failed)
        return str(failed)
    _LOADED_HERE.update((extensions_dir, builder) for builder in todo)
    return known[0] if known else None


def _build_all(builders: list[str]) -> str | None:
    """Load each builder on this process's accelerator: the failure text of the first that fails."""
    from deepspeed.accelerator import get_accelerator

    from workers.in_rank.op_build import op_build_failure

    for builder_name in builders:
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None or builder.name == "deepspeed_not_implemented":
            continue  # this accelerator has no such op: the script fails as DeepSpeed makes it
        try:
            builder.load(verbose=True)
        except BaseException as exc:  # noqa: BLE001 - any failure of a build is this op's failure
            traceback.print_exc()  # the compiler's output, for the log the record names
            found = op_build_failure(exc)
            return found or f"{builder.name}: {type(exc).__name__}: {exc}"[:1000]
    return None


def main(argv: list[str]) -> int:
    report, *builders = argv
    failed = _build_all(builders)
    Path(report).write_text(json.dumps({"failed": failed} if failed else {}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
