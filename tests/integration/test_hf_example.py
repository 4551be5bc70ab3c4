"""The Hugging Face Trainer example (examples/train_hf.py, examples/cfg_hf.json) tuned end to end on
the embedded cluster: the batch flags set per experiment through arg_mappings, DeepSpeed's own
metrics under the Trainer, and an optimal command that gives the Trainer the same flags. Two
configs of one ZeRO stage (the flags and metrics do not depend on the stage; test_examples tunes
two stages), each launch a real Trainer run."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from integration_helpers import ROOT, run_autotune

pytestmark = pytest.mark.integration
EXAMPLES = ROOT / "examples"


def test_hf_trainer_example_tuned_through_arg_mappings(tmp_path: Path) -> None:
    data = json.loads((EXAMPLES / "cfg_hf.json").read_text())
    data["train_micro_batch_size_per_gpu"] = [2, 4]
    data["zero_optimization"]["stage"] = [0]
    data["autotuning"]["user_script"] = str(EXAMPLES / data["autotuning"]["user_script"])
    cfg = tmp_path / "cfg_hf.json"
    cfg.write_text(json.dumps(data))
    # one slot: the launches are short, each slot's warm interpreter preloads torch, DeepSpeed and
    # transformers (a third of the test's CPU with two), and nothing here depends on two at once;
    # its rank on one thread, as a user's OMP_NUM_THREADS has it: the slot would give it both cores,
    # and beside the suite's other busy processes a two-thread rank waits on whichever thread is
    # descheduled (under a bursty load: 38-42 s and 34-40 CPU-s, against 26-28 s and 21-22 on one)
    proc = run_autotune([str(cfg), "--slots", "1", "--num_gpus", "1", "--slot-memory", "3GiB"], tmp_path,
                        {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    for mbs, gas in ((2, 2), (4, 1)):
        folder = results / f"z0_gas{gas}_tmbspg{mbs}"
        argv = shlex.split((folder / "cmd.txt").read_text())
        assert argv[argv.index("--per_device_train_batch_size") + 1] == str(mbs)
        assert argv[argv.index("--gradient_accumulation_steps") + 1] == str(gas)
        assert argv[argv.index("--deepspeed") + 1] == str(folder / "ds_config.json")
        metrics = json.loads((folder / "metrics.json").read_text())  # written by DeepSpeed under the Trainer
        assert metrics["throughput"] > 0 and {"fwd", "bwd", "step"} <= set(metrics)
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    command = shlex.split((results / "cmd_optimal.txt").read_text())
    flag = command.index("--per_device_train_batch_size")
    assert command[flag + 1] == str(optimal["train_micro_batch_size_per_gpu"])
    assert command[command.index("--deepspeed") + 1] == str((results / "ds_config_optimal.json").resolve())
    # not a terminal: plain lines, and the command to paste on one line however long
    assert "\x1b[" not in proc.stdout
    assert f"run it: {(results / 'cmd_optimal.txt').read_text().strip()}" in proc.stdout.splitlines()
    # the two listed configs, and the winner measured again before it is named (<name>_r2, ...)
    repeats = [p.name for p in results.iterdir() if p.is_dir() and "_r" in p.name]
    assert repeats and {name.rsplit("_r", 1)[0] for name in repeats} <= {"z0_gas2_tmbspg2", "z0_gas1_tmbspg4"}
    assert f"Total number of experiments: {2 + len(repeats)}" in proc.stdout
