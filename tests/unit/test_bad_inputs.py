"""The bad-input corpus: every case is refused before anything starts, as docs/config.md promises.

Each case calls the command's own `main()` in process (what `python -m` runs, minus interpreter
start-up) inside a sandbox: a working folder with the user's files, a home folder, a data folder.
Each asserts exit status 2, exactly one `error:` line on stderr naming the field, no traceback, and
that no file in the sandbox changed (nothing created, deleted or rewritten). Starting a cluster or
submitting a job fails the case: bad input must be caught first.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scheduler import autotune

from scheduler import run
from scheduler.inputs.folders import MARKER

SCRIPT = Path(__file__).resolve().parents[1] / "integration" / "scripts" / "fake_train.py"
DELETE = object()


@dataclass
class Sandbox:
    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def data(self) -> Path:
        return self.root / "data"

    def config(self, autotuning: dict[str, Any] | None = None, name: str = "cfg.json",
               folder: Path | None = None, **top: Any) -> str:
        """A valid config with `autotuning` keys and top-level keys overridden (DELETE removes one)."""
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": [1], "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0},
            "autotuning": {"enabled": True, "metric": "throughput", "user_script": str(SCRIPT)},
        }
        for key, value in (autotuning or {}).items():
            config["autotuning"].pop(key, None) if value is DELETE else config["autotuning"].__setitem__(key, value)
        for key, value in top.items():
            config.pop(key, None) if value is DELETE else config.__setitem__(key, value)
        path = (folder or self.work) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config))
        return str(path)

    def text(self, text: str | bytes, name: str = "cfg.json") -> str:
        path = self.work / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(path)


@dataclass
class Case:
    """argv for the command, extra environment, words the error line must hold (and must not)."""

    argv: list[str]
    needles: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    absent: tuple[str, ...] = ()
    command: str = "autotune"


Make = Callable[[Sandbox], Case]
CASES: list[tuple[str, Make]] = []


def case(case_id: str, make: Make) -> None:
    CASES.append((case_id, make))


# ---------------------------------------------------------------- the config file itself

case("file-missing", lambda s: Case(["nope.json"], ("nope.json", "no such file")))
case("file-is-folder", lambda s: Case([str(s.data)], (str(s.data), "cannot read")))
case("file-is-device", lambda s: Case(["/dev/zero"], ("/dev/zero", "not a regular file")))
case("file-not-utf8", lambda s: Case([s.text(b"\xff\xfe{\x00")], ("cfg.json", "cannot read")))
case("file-empty", lambda s: Case([s.text("")], ("cfg.json", "autotuning")))
case("json-unclosed", lambda s: Case([s.text('{"autotuning": {"enabled": true}')], ("cfg.json:1:",)))
case("json-trailing-comma", lambda s: Case([s.text('{"autotuning": {"enabled": true,,}}')], ("invalid JSON",)))
case("json-list", lambda s: Case([s.text("[1, 2]")], ("must be a JSON object",)))
case("json-number", lambda s: Case([s.text("42")], ("must be a JSON object",)))
case("json-null", lambda s: Case([s.text("null")], ("must be a JSON object",)))
case("json-duplicate-key", lambda s: Case([s.text('{"autotuning": {"metric": "latency", "metric": "x"}}')],
                                          ('duplicate key "metric"',)))
case("json-nested-10k", lambda s: Case([s.text('{"autotuning": {"enabled": true}, "x": '
                                               + "[" * 10000 + "]" * 10000 + "}")], ("nested more than",)))
case("json-nested-100", lambda s: Case([s.text('{"autotuning": {"enabled": true}, "x": '
                                               + "[" * 100 + "]" * 100 + "}")], ("nested more than",)))
case("json-nan-in-optimizer", lambda s: Case([s.text('{"autotuning": {}, "optimizer": {"params": {"lr": NaN}}}')],
                                             ("optimizer.params.lr", "nan")))
case("json-infinity", lambda s: Case([s.text('{"autotuning": {}, "gradient_clipping": Infinity}')],
                                     ("gradient_clipping",)))
case("json-too-large", lambda s: Case([_sparse(s.work / "big.json", 17 * 2**20)], ("too large",)))
case("no-autotuning", lambda s: Case([s.text('{"train_micro_batch_size_per_gpu": 4}')], ('no "autotuning" section',)))
case("autotuning-null", lambda s: Case([s.text('{"autotuning": null}')], ('no "autotuning" section',)))
case("autotuning-list", lambda s: Case([s.text('{"autotuning": ["enabled"]}')], ('no "autotuning" section',)))
case("unknown-key", lambda s: Case([s.config({"metrc": "latency"})], ('"metrc"', 'did you mean "metric"')))
case("unknown-keys", lambda s: Case([s.config({"enabeld": True, "fsat": True})], ('"enabeld"', '"fsat"')))


def _sparse(path: Path, size: int) -> str:
    with open(path, "wb") as handle:
        handle.truncate(size)
    return str(path)


# ---------------------------------------------------------------- booleans: JSON true/false only

for key in ("enabled", "fast", "overwrite"):
    for value in ("false", "true", 0, 1, None, [], {}, "no"):
        case(f"bool-{key}-{json.dumps(value)}",
             lambda s, key=key, value=value: Case([s.config({key: value})], (f"autotuning.{key}", "true or false")))

case("enabled-false", lambda s: Case([s.config({"enabled": False})],
                                     ("autotuning.enabled is false", 'set "enabled": true')))

# ---------------------------------------------------------------- integers in documented ranges

INTEGER_KEYS = {
    "start_profile_step": (0, 100_000), "end_profile_step": (0, 100_000), "tuner_early_stopping": (0, 10_000),
    "tuner_num_trials": (1, 10_000), "tuner_seed": (0, 2**32 - 1), "max_train_batch_size": (1, 2**31 - 1),
    "min_train_batch_size": (1, 2**31 - 1), "min_train_micro_batch_size_per_gpu": (1, 65536),
    "max_train_micro_batch_size_per_gpu": (1, 65536), "num_tuning_micro_batch_sizes": (1, 1024),
    "mp_size": (1, 4096),
}
for key, (low, high) in INTEGER_KEYS.items():
    for label, value in (("huge", 10**30), ("above", high + 1), ("below", low - 1), ("string", "5"),
                         ("float", 2.5), ("bool", True)):
        case(f"int-{key}-{label}",
             lambda s, key=key, value=value: Case([s.config({key: value})], (f"autotuning.{key}", "integer")))

for label, value in (("huge", 10**30), ("above-max", 65537), ("zero", 0), ("negative", -1), ("string", "8"),
                     ("float", 8.0), ("bool", True), ("null", None), ("empty-list", []), ("list-huge", [4, 10**30]),
                     ("auto", "auto"), ("object", {"a": 1})):
    case(f"mbs-{label}", lambda s, value=value: Case([s.config(train_micro_batch_size_per_gpu=value)],
                                                     ("train_micro_batch_size_per_gpu",)))
for label, value in (("huge", 10**30), ("zero", 0), ("string", "2"), ("null", None), ("bool", True), ("float", 1.5)):
    case(f"gas-{label}", lambda s, value=value: Case([s.config(gradient_accumulation_steps=value)],
                                                     ("gradient_accumulation_steps",)))
for label, value in (("string", "64"), ("zero", 0), ("huge", 10**30), ("bool", False)):
    case(f"train-batch-{label}", lambda s, value=value: Case([s.config(train_batch_size=value)],
                                                             ("train_batch_size",)))
for label, value in (("null", None), ("int", 1), ("stage-7", {"stage": 7}), ("stage-null", {"stage": None}),
                     ("stage-string", {"stage": "all "}), ("stage-bool", {"stage": True})):
    case(f"zero-{label}", lambda s, value=value: Case([s.config(zero_optimization=value)], ("zero_optimization",)))
for section, label, value in (("fp16", "string-enabled", {"enabled": "false"}), ("fp16", "int-enabled", {"enabled": 1}),
                              ("bf16", "string", "yes"), ("bf16", "null-enabled", {"enabled": None})):
    case(f"{section}-{label}", lambda s, section=section, value=value: Case([s.config(**{section: value})], (section,)))

# ---------------------------------------------------------------- strings, paths, objects

for label, value in (("null", None), ("number", 5), ("unknown", "speed"), ("list", ["throughput"])):
    case(f"metric-{label}", lambda s, value=value: Case([s.config({"metric": value})], ("autotuning.metric",)))
for label, value in (("null", None), ("unknown", "grid"), ("number", 3)):
    case(f"tuner-type-{label}", lambda s, value=value: Case([s.config({"tuner_type": value})], ("autotuning.tuner_type",)))
for key in ("metric_path", "model_info_path", "results_dir", "exps_dir", "user_script"):
    for label, value in (("number", 5), ("null", None), ("empty", ""), ("list", ["a"]), ("newline", "a\nport 1"),
                         ("nul", "a\x00b"), ("tab", "a\tb"), ("long", "x" * 5000)):
        case(f"path-{key}-{label}",
             lambda s, key=key, value=value: Case([s.config({key: value})], (f"autotuning.{key}",)))
for label, value in (("string", "--steps 5"), ("bool-item", [True]), ("null-item", [None]), ("object-item", [{"a": 1}]),
                     ("object", {"steps": 5})):
    case(f"user-args-{label}", lambda s, value=value: Case([s.config({"user_args": value})], ("autotuning.user_args",)))
for label, value in (("number", 5), ("non-string-flag", {"train_micro_batch_size_per_gpu": 1}),
                     ("flag-not-in-args", {"train_micro_batch_size_per_gpu": "--bs"})):
    case(f"arg-mappings-{label}", lambda s, value=value: Case([s.config({"arg_mappings": value})],
                                                              ("autotuning.arg_mappings",)))
for label, value in (("string", "x"), ("negative-params", {"num_params": -5}), ("string-params", {"num_params": "1e9"}),
                     ("huge-params", {"num_params": 10**30}), ("negative-activation", {"activation_mem_per_gpu": -1}),
                     ("profile-string", {"profile": "yes"}), ("float-layers", {"num_layers": 2.5})):
    case(f"model-info-{label}", lambda s, value=value: Case([s.config({"model_info": value})], ("autotuning.model_info",)))
case("profile-steps-reversed", lambda s: Case([s.config({"start_profile_step": 6, "end_profile_step": 2})],
                                              ("start_profile_step",)))
case("script-missing", lambda s: Case([s.config({"user_script": "absent.py"})], ("absent.py", "not found")))
case("script-missing-after-dashes", lambda s: Case([s.config(), "--", "absent.py"], ("absent.py", "not found")))
case("script-not-executable", lambda s: Case([s.config({"user_script": str(s.work / "train.sh")})],
                                             ("train.sh", "not executable")))
case("script-is-folder", lambda s: Case([s.config({"user_script": str(s.data)})], ("not found",)))
case("no-script", lambda s: Case([s.config({"user_script": DELETE})], ("no training script",)))

# ---------------------------------------------------------------- results folders: never lose a file


def _marked_with_foreign_file(s: Sandbox) -> Case:
    results = s.root / "marked"
    return Case([s.config({"results_dir": str(results), "overwrite": True})], ("not written by", str(results)))


for label, make_dir, needle in (
        ("dot", lambda s: ".", "the working folder"),
        ("dot-slash", lambda s: "./", "the working folder"),
        ("parent", lambda s: "..", "the working folder"),
        ("cwd-absolute", lambda s: str(s.work), "the working folder"),
        ("home", lambda s: str(s.home), "the home folder"),
        ("root", lambda s: "/", "the root folder"),
        ("unmarked-data", lambda s: str(s.data), "not created by celery-autotune")):
    for key in ("results_dir", "exps_dir"):
        case(f"overwrite-{key}-{label}", lambda s, key=key, make_dir=make_dir, needle=needle: Case(
            [s.config({key: make_dir(s), "overwrite": True})], (f"autotuning.{key}", needle)))
case("overwrite-config-folder", lambda s: Case(
    [s.config({"results_dir": str(s.root / "configs"), "overwrite": True}, folder=s.root / "configs")],
    ("the config's folder",)))
case("overwrite-marked-with-foreign-file", _marked_with_foreign_file)
case("overwrite-string-false", lambda s: Case([s.config({"results_dir": str(s.root / "marked"), "overwrite": "false"})],
                                              ("autotuning.overwrite",)))
case("overwrite-one", lambda s: Case([s.config({"results_dir": str(s.data), "overwrite": 1})], ("autotuning.overwrite",)))
for key in ("results_dir", "exps_dir"):
    case(f"{key}-is-a-file", lambda s, key=key: Case([s.config({key: str(s.work / "notes.txt")})],
                                                     (f"autotuning.{key}", "is a file")))
    case(f"{key}-under-a-file", lambda s, key=key: Case([s.config({key: str(s.work / "notes.txt" / "out")})],
                                                        (f"autotuning.{key}", "is a file")))
    case(f"{key}-under-proc", lambda s, key=key: Case([s.config({key: "/proc/celery_autotune_corpus"})],
                                                      (f"autotuning.{key}", "cannot create")))
    case(f"{key}-under-sys", lambda s, key=key: Case([s.config({key: "/sys/celery_autotune_corpus/x"})],
                                                     (f"autotuning.{key}", "cannot create")))

# ---------------------------------------------------------------- flags

for flag, value, needle in (
        ("--slots", "0", "--slots"), ("--slots", "-1", "--slots"), ("--slots", "10000", "at most"),
        ("--slots", "x", "--slots"), ("--slots", "1.5", "--slots"), ("--slots", "10" * 30, "at most"),
        ("--num_gpus", "0", "--num_gpus"), ("--num_gpus", "5000", "--num_gpus"), ("--num_gpus", "two", "--num_gpus"),
        ("--num_nodes", "0", "--num_nodes"), ("--num_nodes", "1000000000", "--num_nodes"),
        ("--exp-timeout", "nan", "--exp-timeout"), ("--exp-timeout", "inf", "--exp-timeout"),
        ("--exp-timeout", "-inf", "--exp-timeout"), ("--exp-timeout", "0", "--exp-timeout"),
        ("--exp-timeout", "-5", "--exp-timeout"), ("--exp-timeout", "1e9", "--exp-timeout"),
        ("--exp-timeout", "soon", "--exp-timeout"), ("--slot-memory", "lots", "--slot-memory"),
        ("--slot-memory", "1e999", "--slot-memory"), ("--slot-memory", "9" * 400, "--slot-memory"),
        ("--slot-memory", "1KiB", "--slot-memory"), ("--slot-memory", "0", "--slot-memory"),
        ("--slot-memory", "-1GiB", "--slot-memory"), ("--min-slot-memory", "x", "--min-slot-memory"),
        ("--min-slot-memory", "0", "--min-slot-memory"), ("--host-memory-cap", "lots", "--host-memory-cap"),
        ("--host-memory-cap", "1KiB", "--host-memory-cap"), ("--host-memory-cap", "9" * 400, "--host-memory-cap")):
    case(f"flag{flag}-{value[:12]}", lambda s, flag=flag, value=value, needle=needle: Case(
        [s.config(), f"{flag}={value}" if value.startswith("-") else flag, *([] if value.startswith("-") else [value])],
        (needle,)))
case("flag-unknown", lambda s: Case([s.config(), "--bogus"], ("unrecognized arguments: --bogus",)))
case("flag-missing-value", lambda s: Case([s.config(), "--slots"], ("--slots", "expected one argument")))
case("no-config", lambda s: Case([], ("give the config",)))
case("status-without-redis", lambda s: Case(["--status"], ("AUTOTUNE_REDIS_URL",)))

# ---------------------------------------------------------------- decided by the search and the slots
# Each was refused only after the folders were marked and the embedded cluster had started; now the
# command's input check (scheduler.preflight) predicts the embedded cluster's slots (CPU slots here) and
# takes the search's first, pure step before anything exists.

CPU = {"AUTOTUNE_DEVICE_KIND": "cpu"}
case("search-unknown", lambda s: Case([s.config({"search": "grid"})], ("autotuning.search", "sampled"), env=CPU))
case("search-null", lambda s: Case([s.config({"search": None})], ("autotuning.search",), env=CPU))
case("mp-size-not-dividing", lambda s: Case([s.config({"mp_size": 3}), "--slots", "2"],
                                            ("autotuning.mp_size (3)", "must divide", "(2)"), env=CPU))
case("mp-size-above-ranks", lambda s: Case([s.config({"mp_size": 4}), "--slots", "2", "--num_gpus", "1"],
                                           ("autotuning.mp_size (4)", "(1)"), env=CPU))
case("min-above-max-micro-batch", lambda s: Case(
    [s.config({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4})],
    ("min_train_micro_batch_size_per_gpu (8)", "make min <= max"), env=CPU))
case("min-slot-memory-above-every-slot", lambda s: Case(
    [s.config(), "--slots", "1", "--slot-memory", "1GiB", "--min-slot-memory", "2GiB"],
    ("--min-slot-memory 2GiB", "no slot has that much", "1.00 GiB"), env=CPU))
case("min-slot-memory-above-env-slot-memory", lambda s: Case(
    [s.config(), "--slots", "1", "--min-slot-memory", "2GiB"], ("--min-slot-memory 2GiB", "1.00 GiB"),
    env={**CPU, "AUTOTUNE_SLOT_MEMORY": "1GiB"}))
case("env-slot-memory-not-a-size", lambda s: Case([s.config(), "--slots", "1"], ("AUTOTUNE_SLOT_MEMORY",),
                                                  env={**CPU, "AUTOTUNE_SLOT_MEMORY": "lots"}))
case("num-gpus-above-embedded-slots", lambda s: Case([s.config(), "--slots", "2", "--num_gpus", "4"],
                                                     ("2 slot(s)", "--num_gpus 2 or fewer"), env=CPU))
case("num-nodes-above-embedded-node", lambda s: Case([s.config(), "--slots", "2", "--num_nodes", "2"],
                                                     ("2 slot(s)", "--num_nodes 1"), env=CPU))
case("model-info-fits-no-stage", lambda s: Case(
    [s.config({"model_info": {"num_params": 10**10, "activation_mem_per_gpu": 1024}}), "--slots", "1",
     "--slot-memory", "1GiB"], ("no allowed ZeRO stage fits micro-batch 1", "1.00 GiB"), env=CPU))
# On a GPU machine (the fake nvidia-smi: three 16 GiB GPUs) the embedded cluster's slots are the GPUs.
FAKE_GPU_DIR = Path(__file__).resolve().parents[1] / "fake_gpu"


def _gpus() -> dict[str, str]:
    return {"PATH": f"{FAKE_GPU_DIR}{os.pathsep}{os.environ['PATH']}", "AUTOTUNE_DEVICE_KIND": ""}


case("gpu-min-slot-memory-above-every-gpu", lambda s: Case([s.config(), "--min-slot-memory", "20GiB"],
                                                           ("--min-slot-memory 20GiB", "16.00 GiB"), env=_gpus()))
case("gpu-mp-size-not-dividing-the-gpus", lambda s: Case([s.config({"mp_size": 2})], ("mp_size (2)", "(3)"),
                                                         env=_gpus()))
case("gpu-num-gpus-above-the-gpus", lambda s: Case([s.config(), "--slots", "2", "--num_gpus", "3"],
                                                   ("--num_gpus 2 or fewer",), env=_gpus()))
case("gpu-model-info-fits-no-stage", lambda s: Case(
    [s.config({"model_info": {"num_params": 10**12, "activation_mem_per_gpu": 1024}})],
    ("no allowed ZeRO stage fits micro-batch 1 in the slots' ",), env=_gpus()))
case("no-redis-server", lambda s: Case([s.config()], ("redis-server not found", "apt-get install"),
                                       env={**CPU, "PATH": str(s.data)}))

# ---------------------------------------------------------------- environment

for label, url, needle in (
        ("not-a-url", "not a url", "blank"), ("no-scheme", "localhost:6379", "scheme"),
        ("http", "http://h:1/0", "scheme"), ("port-too-big", "redis://:s3cretpw@h:99999/0", "Port"),
        ("port-zero", "redis://h:0/0", "port 0"), ("port-text", "redis://:s3cretpw@h:abc/0", "not a valid URL"),
        ("db-text", "redis://h:1/x", "database"), ("db-query", "redis://h:1/0?db=x", "db="),
        ("no-host", "redis://", "no host"), ("unix-no-path", "unix://", "socket path"),
        ("newline", "redis://h:1/0\nx", "control"), ("ipv6-broken", "redis://[::1:6379/0", "not a valid URL")):
    case(f"redis-url-{label}", lambda s, url=url, needle=needle: Case(
        [s.config()], ("AUTOTUNE_REDIS_URL", needle), env={"AUTOTUNE_REDIS_URL": url}, absent=("s3cretpw",)))
    case(f"run-redis-url-{label}", lambda s, url=url, needle=needle: Case(
        [str(SCRIPT)], ("AUTOTUNE_REDIS_URL", needle), env={"AUTOTUNE_REDIS_URL": url}, absent=("s3cretpw",),
        command="run"))
for name, value in (("AUTOTUNE_LEASE_S", "x"), ("AUTOTUNE_LEASE_S", "nan"), ("AUTOTUNE_LEASE_S", "-1"),
                    ("AUTOTUNE_LOST_GRACE_S", "inf"), ("AUTOTUNE_MAX_ATTEMPTS", "0"),
                    ("AUTOTUNE_MAX_ATTEMPTS", "1.5"), ("AUTOTUNE_VISIBILITY_TIMEOUT", "inf"),
                    ("AUTOTUNE_SLOTS_PER_NODE", "-3"), ("AUTOTUNE_HOST_MEMORY_CAP", "lots"),
                    ("AUTOTUNE_HOST_MEMORY_CAP", "1KiB")):
    case(f"env-{name}-{value}", lambda s, name=name, value=value: Case([s.config()], (name,), env={name: value}))

# ---------------------------------------------------------------- scheduler.run and hostfiles


def _hostfile(s: Sandbox, text: str | bytes) -> str:
    path = s.work / "hostfile"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


for label, argv, needle in (
        ("timeout-nan", ["--timeout", "nan"], "--timeout"), ("timeout-inf", ["--timeout", "inf"], "--timeout"),
        ("timeout-zero", ["--timeout", "0"], "--timeout"), ("timeout-negative", ["--timeout=-1"], "--timeout"),
        ("timeout-huge", ["--timeout", "1e12"], "--timeout"), ("timeout-text", ["--timeout", "x"], "--timeout"),
        ("slots-zero", ["--slots", "0"], "--slots"), ("slots-huge", ["--slots", "10000"], "at most"),
        ("slots-text", ["--slots", "x"], "--slots"), ("num-gpus-zero", ["--num_gpus", "0"], "--num_gpus"),
        ("num-nodes-zero", ["--num_nodes", "0"], "--num_nodes"), ("unknown-flag", ["--bogus"], "--bogus"),
        ("launcher-unknown", ["--launcher", "ssh"], "--launcher"), ("master-port-text", ["--master_port", "x"],
                                                                    "--master_port")):
    case(f"run-{label}", lambda s, argv=argv, needle=needle: Case([*argv, str(SCRIPT)], (needle,), command="run"))
case("run-no-script", lambda s: Case([], ("user_script",), command="run"))
case("run-script-missing", lambda s: Case(["absent.py"], ("absent.py", "not found"), command="run"))
case("run-script-not-executable", lambda s: Case([str(s.work / "train.sh")], ("not executable",), command="run"))
for label, text, needle in (
        ("slots-billion", "h slots=1000000000\n", "at most 1024"), ("slots-10e20", f"h slots={10**20}\n", "at most 1024"),
        ("slots-4400-digits", "h slots=" + "9" * 4400 + "\n", "at most 1024"), ("slots-text", "h slots=x\n", "line 1"),
        ("slots-glued", "h slots=2extra\n", "line 1"), ("no-slots", "h\n", "line 1"), ("empty", "", "no host lines"),
        ("comments-only", "# nothing\n", "no host lines"), ("duplicate", "h slots=1\nh slots=2\n", "already listed"),
        ("not-utf8", b"h slots=1\xff\n", "not UTF-8")):
    case(f"hostfile-{label}", lambda s, text=text, needle=needle: Case(
        ["--hostfile", _hostfile(s, text), str(SCRIPT)], ("hostfile", needle), command="run"))
case("hostfile-missing", lambda s: Case(["--hostfile", "nope", str(SCRIPT)], ("hostfile nope", "not found"),
                                        command="run"))
case("hostfile-folder", lambda s: Case(["--hostfile", str(s.data), str(SCRIPT)], ("hostfile",), command="run"))
case("hostfile-device", lambda s: Case(["--hostfile", "/dev/zero", str(SCRIPT)], ("not a regular file",),
                                       command="run"))


# ---------------------------------------------------------------- the harness


def snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every path under root with its kind and content hash: any change to the user's files shows."""
    seen: dict[str, tuple[str, str]] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink():
            seen[relative] = ("link", os.readlink(path))
        elif path.is_dir():
            seen[relative] = ("dir", oct(path.stat().st_mode))
        else:
            with open(path, "rb") as handle:
                seen[relative] = ("file", hashlib.sha256(handle.read(2**20)).hexdigest() + str(path.stat().st_size))
    return seen


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    box = Sandbox(tmp_path)
    for folder in (box.work, box.home, box.data, box.root / "marked"):
        folder.mkdir()
    (box.work / "notes.txt").write_text("the user's notes")
    (box.work / "train.sh").write_text("#!/bin/sh\nexit 0\n")
    (box.work / "train.sh").chmod(0o644)
    (box.home / ".bashrc").write_text("export X=1")
    (box.data / "dataset.csv").write_text("a,b\n1,2\n")
    (box.root / "marked" / MARKER).write_text("{}")
    (box.root / "marked" / "summary.txt").write_text("ours")
    (box.root / "marked" / "thesis.tex").write_text("theirs")
    monkeypatch.chdir(box.work)
    monkeypatch.setenv("HOME", str(box.home))
    for name in ("AUTOTUNE_REDIS_URL", "AUTOTUNE_LEASE_S", "AUTOTUNE_LOST_GRACE_S", "AUTOTUNE_MAX_ATTEMPTS",
                 "AUTOTUNE_VISIBILITY_TIMEOUT", "AUTOTUNE_SLOTS_PER_NODE", "AUTOTUNE_SLOT_MEMORY", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def must_not_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("bad input reached the cluster: it must be refused before anything starts")

    for module in (autotune, run):
        monkeypatch.setattr(module, "LocalCluster", must_not_start)
    monkeypatch.setattr(autotune, "tune", must_not_start)
    monkeypatch.setattr(run, "run_experiment", must_not_start)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield box
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("make", [make for _, make in CASES], ids=[case_id for case_id, _ in CASES])
def test_bad_input(make: Make, sandbox: Sandbox, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    bad = make(sandbox)
    for name, value in bad.env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    before = snapshot(sandbox.root)
    main = autotune.main if bad.command == "autotune" else run.main
    code = main(bad.argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in bad.needles:
        assert needle in lines[0], lines[0]
    for secret in bad.absent:
        assert secret not in err, err
    assert snapshot(sandbox.root) == before, "bad input changed files"


def test_corpus_size() -> None:
    assert len(CASES) >= 150 and len({case_id for case_id, _ in CASES}) == len(CASES)
