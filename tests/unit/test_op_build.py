"""An op that cannot be built: recognised from the exception the rank holds
(`workers.in_rank.op_build`), carried into the record, and the job stopped with one line at its first such
experiment; a resumed job launches that experiment again.

The failures are real: torch compiling a C++ extension that does not compile, and DeepSpeed's own
FusedAdam builder on this machine without CUDA."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scheduler.search.fast_search import PROFILE, fast_search
from scheduler.search.session import SearchAborted, refuse_unbuildable_op
from scheduler.search.space import Experiment
from tests.unit.test_fast_search import settings
from workers.in_rank.device_memory import read_exit_report
from workers.in_rank.op_build import op_build_failure
from workers.slot.records import aggregate

ROOT = Path(__file__).resolve().parents[2]

BROKEN_OP = """
    import pathlib, torch.utils.cpp_extension as cpp
    source = pathlib.Path(__file__).with_name("broken_op.cpp")  # a header only the CUDA toolkit has: it stops at once
    source.write_text("#include <cuda_runtime_not_installed.h>\\nint f() { return 1; }\\n")
    cpp.load(name="broken_op", sources=[str(source)])
"""


def test_a_compile_error_inside_the_rank_is_an_op_that_cannot_be_built(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(BROKEN_OP))
    report = tmp_path / "exit.json"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT),
           "AUTOTUNE_EXIT_REPORT": str(report), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MAX_JOBS": "1"}
    done = subprocess.run([sys.executable, "-m", "workers.in_rank.entry", str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 1  # still a crash: the status is unchanged, the record says why
    failure = read_exit_report(report)["op_build_failed"]
    assert failure.startswith("broken_op: RuntimeError: Error building extension 'broken_op'")
    assert "workers.in_rank.entry: an op could not be built or loaded: broken_op" in done.stderr


def test_deepspeeds_fused_adam_without_cuda_names_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, as on a GPU node

    for arch in (None, "8.0"):  # no GPU seen; then, told the architecture, no CUDA toolkit
        if arch:
            monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
        with pytest.raises(BaseException) as caught:
            FusedAdamBuilder().jit_load(verbose=False)
        failure = op_build_failure(caught.value)
        assert failure is not None and failure.startswith("fused_adam: ")


def test_only_an_exception_raised_inside_a_builder_counts() -> None:
    try:
        raise RuntimeError("Error building extension 'fused_adam'")  # a script's own text
    except RuntimeError as exc:
        assert op_build_failure(exc) is None
    assert op_build_failure(None) is None


def test_a_build_failure_the_script_wrapped_in_its_own_error_is_found_in_the_chain() -> None:
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    try:
        try:
            FusedAdamBuilder().jit_load(verbose=False)
        except BaseException:
            raise ValueError("could not set up the optimizer")
    except ValueError as exc:
        failure = op_build_failure(exc)
    assert failure is not None and failure.startswith("fused_adam: ")


def test_the_record_carries_any_ranks_build_failure() -> None:
    ranks = [{"rank": 0, "status": "aborted", "ended_at": 2.0},
             {"rank": 1, "status": "crashed", "ended_at": 1.0, "op_build_failed": "fused_adam: OSError: no CUDA_HOME"}]
    record = aggregate({"name": "z1_gas1_tmbspg2", "world_size": 2}, ranks)
    assert record["status"] == "crashed" and record["op_build_failed"] == "fused_adam: OSError: no CUDA_HOME"
    clean = aggregate({"name": "z1_gas1_tmbspg2", "world_size": 1}, [{"rank": 0, "status": "crashed", "ended_at": 1.0}])
    assert "op_build_failed" not in clean


FAILED = {"status": "crashed", "op_build_failed": "fused_adam: OSError: CUDA_HOME environment variable is not set",
          "cause": {"slot": "gpu3"}}


def test_the_profile_run_that_cannot_build_an_op_stops_the_job_with_the_op_and_the_fix() -> None:
    search = fast_search(settings())
    next(search)
    with pytest.raises(SearchAborted) as caught:
        search.send({PROFILE: {"name": PROFILE, **FAILED}})
    message = str(caught.value)
    assert message.startswith(f"{PROFILE} could not build or load an op DeepSpeed needs on slot gpu3 (fused_adam: ")
    assert "nvcc" in message and '"torch_adam": true' in message and "\n" not in message


def test_a_search_experiment_that_cannot_build_an_op_stops_the_job() -> None:
    search = fast_search(settings(stages=(1,)))
    next(search)
    phase = search.send({PROFILE: {"name": PROFILE, "status": "ok",
                                   "metrics": {"num_params": 10**8, "trainable_num_params": 10**8,
                                               "activation_mem_per_gpu": 10**8}}})
    first = phase.experiments[0]
    with pytest.raises(SearchAborted, match=f"^{first.name} could not build"):
        search.send({first.name: {"name": first.name, **FAILED}})


def test_a_full_mode_point_that_cannot_build_an_op_only_fails_that_point() -> None:
    point = Experiment("z2_rbs5e8_olc", 2, 4, 1, {}, 1, 2, tuning_space="z2_rbs_olc")
    refuse_unbuildable_op(point, FAILED)  # no exception: other points may not need the op
    for exp in (Experiment("z2_gas1_tmbspg4", 2, 4, 1, {}, 1, 2), Experiment(PROFILE, 3, 1, 1, {}, 1, 2, tuning_space=PROFILE)):
        with pytest.raises(SearchAborted):
            refuse_unbuildable_op(exp, FAILED)
    refuse_unbuildable_op(Experiment("z2_gas1_tmbspg4", 2, 4, 1, {}, 1, 2), {"status": "crashed"})
