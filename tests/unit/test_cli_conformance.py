"""`celery-autotune` takes DeepSpeed's launcher command lines as DeepSpeed's own parser reads them.

The table is every launcher line of DeepSpeed's docs and tutorials for autotuning and launching
(docs/_tutorials/autotuning.md, getting-started.md, the Hugging Face Trainer's DeepSpeed page), with
their placeholders filled in. Each line is parsed by `deepspeed.launcher.runner.parse_args` and by
ours: the same script, arguments, autotuning mode and resource flags; the same resource pool
(DeepSpeed's `fetch_hostfile` + `parse_inclusion_exclusion` against `scheduler.launch.pool` over slots
registered as the hostfile says); the same DeepSpeed config (DeepSpeed's `Autotuner._get_user_config`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.cli import build_parser
from scheduler.errors import UsageError
from scheduler.inputs.arguments import config_argument
from scheduler.launch.hostfile import read_hostfile
from scheduler.launch.pool import PoolRequest, check_counts, registered, select_slots
from workers.device.slot import Slot


HOSTFILE = "worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=4\n"
LOCAL_NODE = "this-node"
CONFIG = {"train_micro_batch_size_per_gpu": 4, "autotuning": {"enabled": True}}

#: (where in DeepSpeed's docs, the command line after `deepspeed`)
LINES = [
    ("autotuning.md: tune, HF run_mlm", "--autotuning tune --num_nodes=1 --num_gpus=8 run_mlm.py --deepspeed "
     "ds_config.json --model_name_or_path bert-base-uncased --do_train"),
    ("autotuning.md: run, HF run_glue", "--autotuning=run --num_nodes=1 --num_gpus=2 run_glue.py --deepspeed "
     "ds_config.json --model_name_or_path gpt2 --task_name MRPC --do_train --output_dir out"),
    ("autotuning.md: general form", "--autotuning run train.py --deepspeed_config ds_config.json"),
    ("ours: hostfile tuning", "--autotuning tune --num_gpus 8 --hostfile hostfile train.py --deepspeed "
     "ds_config.json"),
    ("getting-started: single node", "train.py --epochs 2 --deepspeed --deepspeed_config ds_config.json"),
    ("getting-started: hostfile", "--hostfile=hostfile train.py --deepspeed --deepspeed_config ds_config.json"),
    ("getting-started: num_nodes", "--hostfile=hostfile --num_nodes=2 train.py --deepspeed "
     "--deepspeed_config ds_config.json"),
    ("getting-started: include", "--hostfile=hostfile --include=worker-2:0,1 train.py --deepspeed "
     "--deepspeed_config ds_config.json"),
    ("getting-started: exclude", "--hostfile=hostfile --exclude=worker-1:0 train.py --deepspeed "
     "--deepspeed_config ds_config.json"),
    ("getting-started: exclude a host", "--hostfile hostfile --exclude worker-0@worker-2:1,3 train.py "
     "--deepspeed_config ds_config.json"),
    ("getting-started: single GPU", "--num_gpus=1 train.py --deepspeed --deepspeed_config ds_config.json"),
    ("getting-started: launcher", "--hostfile=hostfile --launcher=openmpi train.py --deepspeed_config "
     "ds_config.json"),
    ("getting-started: launcher args", "--launcher slurm --launcher_args=--qos=high train.py "
     "--deepspeed_config ds_config.json"),
    ("HF: num_gpus", "--num_gpus=2 your_program.py --do_train --deepspeed ds_config.json"),
    ("HF: include localhost", "--include localhost:1 run_translation.py --deepspeed ds_config.json "
     "--model_name_or_path t5-small"),
    ("HF: master_port", "--master_port 29501 --num_gpus 2 your_program.py --deepspeed ds_config.json"),
    ("HF: multi-node", "--num_gpus 4 --num_nodes 2 --hostfile hostfile --master_addr worker-0 "
     "--master_port=9901 your_program.py --deepspeed ds_config.json"),
    ("autotuning on a selection", "--autotuning tune --include localhost:0,2 train.py --deepspeed "
     "ds_config.json --steps 50"),
]


@pytest.fixture(scope="module")
def runner():
    """DeepSpeed's launcher, imported where a test compares against it: importing DeepSpeed takes
    seconds, which every pytest-xdist worker would pay at collection."""
    return pytest.importorskip("deepspeed.launcher.runner")


@pytest.fixture(scope="module")
def autotuner():
    return pytest.importorskip("deepspeed.autotuning.autotuner")


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text(HOSTFILE)
    (tmp_path / "ds_config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def _ours_minus_default(value: object, default: object) -> object:
    """DeepSpeed's parser fills defaults (-1, "", 29500, pdsh, /job/hostfile) where ours leaves None."""
    return None if value == default else value


@pytest.mark.parametrize("where, line", LINES, ids=[where for where, _ in LINES])
def test_each_documented_line_parses_as_deepspeed_parses_it(workdir: Path, runner, autotuner, where: str,
                                                            line: str) -> None:
    argv = line.split()
    theirs = runner.parse_args(argv)
    ours = build_parser().parse_args(argv)
    assert ours.user_script == theirs.user_script
    assert ours.user_args == theirs.user_args
    assert ours.autotuning == (theirs.autotuning or None)
    assert ours.hostfile == _ours_minus_default(theirs.hostfile, runner.DLTS_HOSTFILE)
    assert (ours.include, ours.exclude) == (theirs.include, theirs.exclude)
    assert ours.num_nodes == _ours_minus_default(theirs.num_nodes, -1)
    assert ours.num_gpus == _ours_minus_default(theirs.num_gpus, -1)
    assert ours.master_port == _ours_minus_default(theirs.master_port, runner.TORCH_DISTRIBUTED_DEFAULT_PORT)
    assert ours.master_addr == theirs.master_addr
    assert ours.launcher == _ours_minus_default(theirs.launcher, "pdsh")
    assert ours.launcher_args == theirs.launcher_args
    # the config: DeepSpeed's autotuner reads the same file from the same argument
    path = config_argument(ours.user_args)
    assert path is not None
    assert json.loads(Path(path).read_text()) == autotuner.Autotuner._get_user_config(None, theirs.user_args)


@pytest.mark.parametrize("where, line", [(w, l) for w, l in LINES if "include" in l or "exclude" in l
                                         or "hostfile" in l], ids=lambda x: x if " " not in x else None)
def test_the_resource_pool_is_deepspeeds(workdir: Path, runner, where: str, line: str) -> None:
    """The slots experiments may use are the devices DeepSpeed's runner puts in its pool (before the
    --num_nodes/--num_gpus cut, which its autotuner does not apply: they size experiments)."""
    args = build_parser().parse_args(line.split())
    if args.hostfile:
        pool = runner.fetch_hostfile(args.hostfile)
        slots = [Slot(host, device, "cuda", 2**34, "10.0.0.1", 1, ())
                 for host, n in pool.items() for device in range(n)]
    else:
        pool = {"localhost": 4}
        slots = [Slot(LOCAL_NODE, device, "cuda", 2**34, "127.0.0.1", 1, ()) for device in range(4)]
    theirs = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    request = PoolRequest(read_hostfile(args.hostfile) if args.hostfile else None, args.hostfile,
                          args.include, args.exclude)
    selected = select_slots(slots, request, LOCAL_NODE)
    assert selected is not None
    ours = {("localhost" if node == LOCAL_NODE else node): devices
            for node, devices in registered(selected.slots).items()}
    assert ours == {host: list(devices) for host, devices in theirs.items()}
    assert sorted(selected.queues) == sorted(s.queue for s in selected.slots)


def test_sizes_and_a_filter_do_not_mix_as_in_deepspeed(workdir: Path, runner) -> None:
    argv = "--autotuning tune --num_gpus 2 --include worker-0:0,1 train.py --deepspeed ds_config.json".split()
    args = build_parser().parse_args(argv)
    with pytest.raises(UsageError, match="cannot be combined"):
        check_counts(PoolRequest(None, None, args.include, args.exclude), args.num_nodes, args.num_gpus)
    with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
        runner.main(argv)


def test_pip_install_puts_the_command_on_path() -> None:
    """pyproject's [project.scripts] names `celery-autotune` and it resolves to the command."""
    import importlib

    from scheduler import cli
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["celery-autotune"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main


def test_without_autotuning_it_launches_like_deepspeed(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from scheduler import cli
    (workdir / "train.py").write_text("")
    assert cli.main(["--slots", "2", "--dry_run", "train.py", "--deepspeed_config", "ds_config.json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["argv"] == ["train.py", "--deepspeed_config", "ds_config.json"] and len(shown["slots"][0]) == 2


@pytest.mark.parametrize("argv, needle", [
    (["--autotuning", "tune", "train.py", "--epochs", "2"], "name no DeepSpeed config"),
    (["--autotuning", "tune", "--timeout", "60", "train.py", "--deepspeed", "ds_config.json"], "--timeout"),
    (["--autotuning", "tune"], "needs the training script"),
    (["--autotuning", "tune", "absent.py", "--deepspeed", "ds_config.json"], "absent.py not found"),
    (["--autotuning", "walk", "train.py"], "--autotuning"),
])
def test_a_tuning_line_it_cannot_run_is_one_error(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                  argv: list[str], needle: str) -> None:
    from scheduler import cli
    (workdir / "train.py").write_text("")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
