"""Resource selection: DeepSpeed's include/exclude/num_nodes/num_gpus rules, with real device ids kept."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.errors import ResourceFilterError, UsageError
from scheduler.launch.resources import (
    ResourceRequest,
    Resources,
    apply_visible_devices,
    filter_devices,
    parse_node_specs,
    resolve_resources,
)
from workers.device.gpus import Gpu

ROOT = Path(__file__).resolve().parents[2]
POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}
ALL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


def resolve(**request: object) -> Resources:
    return resolve_resources(POOL, ResourceRequest(**request), hostfile="hf")


def ordered(mapping: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    return list(mapping.items())


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("a", {"a": None}),
        ("a:1,0", {"a": (0, 1)}),
        ("a:0@a:1", {"a": (0, 1)}),
        ("a:1,1@a:1", {"a": (1,)}),
        ("a@a:1", {"a": None}),
        ("a:1@a", {"a": None}),
        ("b:2@a:0", {"b": (2,), "a": (0,)}),
        (" a : 0 , 1 @ b ", {"a": (0, 1), "b": None}),
        ("a:10,2", {"a": (2, 10)}),
    ],
    ids=["bare", "sorted", "merged", "deduplicated", "bare-wins", "bare-wins-later", "two-hosts", "blanks",
         "numeric-sort"],
)
def test_parse_node_specs(spec: str, expected: dict[str, tuple[int, ...] | None]) -> None:
    parsed = parse_node_specs(spec)
    assert list(parsed.items()) == list(expected.items())


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("a:", "an empty device id in 'a:'"),
        ("a:x", "device id 'x' in 'a:x' is not a non-negative integer"),
        ("a:1:2", "more than one ':' in 'a:1:2'"),
        ("a:1,,2", "an empty device id"),
        ("@a", "an empty node"),
        ("a@", "an empty node"),
        ("a@@b", "an empty node"),
        (":1", "no host name before ':'"),
        ("a:-1", "device id '-1'"),
        ("a:+1", "device id '+1'"),
    ],
)
def test_parse_node_specs_grammar_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ResourceFilterError) as caught:
        parse_node_specs(spec, "--exclude")
    message = str(caught.value)
    assert message.startswith(f"--exclude {spec!r}: ")
    assert fragment in message
    assert "expected NODE[:ID[,ID...]]" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("include", "expected"),
    [
        ("worker-1", {"worker-1": [0, 1, 2, 3]}),
        ("worker-0:0,1@worker-1:3", {"worker-0": [0, 1], "worker-1": [3]}),
        ("worker-1:3@worker-0:1", {"worker-0": [1], "worker-1": [3]}),
        ("worker-0:0@worker-0:1", {"worker-0": [0, 1]}),
        ("worker-0:2,0,2", {"worker-0": [0, 2]}),
        ("worker-0@worker-0:1", {"worker-0": [0, 1, 2, 3]}),
        ("worker-2:1@worker-0:3", {"worker-0": [3], "worker-2": [1]}),
    ],
    ids=["whole-host", "slots", "hostfile-order", "merged", "dedup-sorted", "bare-merged-is-whole", "real-ids"],
)
def test_include(include: str, expected: dict[str, list[int]]) -> None:
    assert ordered(resolve(include=include).hosts) == ordered(expected)


@pytest.mark.parametrize(
    ("exclude", "expected"),
    [
        ("worker-1", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-0:0,3", {"worker-0": [1, 2], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-2:0@worker-2:1", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ("worker-0:1@worker-0:1", {"worker-0": [0, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-1:0@worker-1", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-2@worker-0:0", {"worker-0": [1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ],
    ids=["whole-host", "slots", "emptied-host-dropped", "duplicate", "bare-merged-is-whole", "mixed"],
)
def test_exclude(exclude: str, expected: dict[str, list[int]]) -> None:
    assert ordered(resolve(exclude=exclude).hosts) == ordered(expected)


@pytest.mark.parametrize(
    ("request_kwargs", "expected"),
    [
        ({}, ALL),
        ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"num_nodes": 3}, ALL),
        ({"num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}),
        ({"num_nodes": 1, "num_gpus": 3}, {"worker-0": [0, 1, 2]}),
    ],
    ids=["everything", "first-two-hosts", "all-hosts", "first-two-devices", "both"],
)
def test_num_nodes_and_num_gpus(request_kwargs: dict[str, int], expected: dict[str, list[int]]) -> None:
    assert ordered(resolve(**request_kwargs).hosts) == ordered(expected)


@pytest.mark.parametrize(
    ("request_kwargs", "fragment"),
    [
        ({"include": "worker-9"}, "--include 'worker-9': host 'worker-9' is not in hostfile hf "
                                  "(hosts: worker-0, worker-1, worker-2)"),
        ({"include": "worker-0:4"}, "--include 'worker-0:4': host 'worker-0' has no device id 4 (its ids: 0,1,2,3)"),
        ({"include": "worker-0:7,4"}, "has no device id 4,7"),
        ({"exclude": "worker-2:2"}, "--exclude 'worker-2:2': host 'worker-2' has no device id 2 (its ids: 0,1)"),
        ({"exclude": "nobody:0"}, "host 'nobody' is not in hostfile hf"),
        ({"include": "worker-0", "exclude": "worker-1"}, "--include and --exclude cannot be used together"),
        ({"include": "worker-0", "num_nodes": 1}, "--num_nodes/--num_gpus cannot be combined with --include/--exclude"),
        ({"exclude": "worker-0", "num_gpus": 1}, "cannot be combined with --include/--exclude"),
        ({"num_nodes": 0}, "--num_nodes must be at least 1, got 0"),
        ({"num_gpus": -1}, "--num_gpus must be at least 1, got -1"),
        ({"num_nodes": 4}, "--num_nodes 4 but hostfile hf has only 3 hosts with devices"),
        ({"num_gpus": 3}, "--num_gpus 3 but host 'worker-2' has only 2 devices"),
        ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no devices on hostfile hf"),
    ],
    ids=["unknown-include-host", "unknown-include-slot", "unknown-slots-sorted", "unknown-exclude-slot",
         "unknown-exclude-host", "include-and-exclude", "num_nodes-with-include", "num_gpus-with-exclude",
         "zero-nodes", "negative-gpus", "too-many-nodes", "too-many-gpus", "everything-excluded"],
)
def test_selection_errors(request_kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ResourceFilterError) as caught:
        resolve(**request_kwargs)
    message = str(caught.value)
    assert fragment in message
    assert "\n" not in message
    assert isinstance(caught.value, UsageError)


ZERO_SLOT_POOL = {"empty": 0, "b": 2, "c": 1}


@pytest.mark.parametrize(
    ("request_kwargs", "expected"),
    [
        ({}, {"b": [0, 1], "c": [0]}),
        ({"num_nodes": 1}, {"b": [0, 1]}),
        ({"include": "empty@c"}, {"c": [0]}),
        ({"exclude": "b:0"}, {"b": [1], "c": [0]}),
    ],
    ids=["dropped", "not-counted-as-node", "included-empty-dropped", "exclude"],
)
def test_hosts_without_devices_are_dropped(request_kwargs: dict[str, object], expected: dict[str, list[int]]) -> None:
    resources = resolve_resources(ZERO_SLOT_POOL, ResourceRequest(**request_kwargs), hostfile="hf")
    assert ordered(resources.hosts) == ordered(expected)


@pytest.mark.parametrize(
    ("pool", "request_kwargs", "fragment"),
    [
        ({"empty": 0}, {}, "hostfile hf offers no devices"),
        (ZERO_SLOT_POOL, {"include": "empty"}, "--include 'empty' selects no devices"),
        (ZERO_SLOT_POOL, {"include": "empty:0"}, "host 'empty' has no device id 0 (its ids: none)"),
    ],
)
def test_selection_with_no_devices_is_an_error(pool, request_kwargs, fragment: str) -> None:
    with pytest.raises(ResourceFilterError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        resolve_resources(pool, ResourceRequest(**request_kwargs), hostfile="hf")


LOCAL = {"localhost": 4}


@pytest.mark.parametrize(
    ("visible", "request_kwargs", "expected", "note"),
    [
        ("2,3", {}, [2, 3], "CUDA_VISIBLE_DEVICES=2,3 read as --include localhost:2,3"),
        ("3,1", {}, [1, 3], "read as --include localhost:3,1"),
        ("1,1", {}, [1], "read as --include localhost:1,1"),
        (" 0 , 2 ", {}, [0, 2], "read as --include localhost:0,2"),
        ("", {}, [0, 1, 2, 3], None),
        (None, {}, [0, 1, 2, 3], None),
        ("2,3", {"num_gpus": 1}, [0], "CUDA_VISIBLE_DEVICES=2,3 ignored because"),
        ("2,3", {"num_nodes": 1}, [0, 1, 2, 3], "ignored because"),
        ("2,3", {"include": "localhost:1"}, [1], "ignored because"),
        ("2,3", {"exclude": "localhost:0"}, [1, 2, 3], "ignored because"),
    ],
    ids=["applied", "sorted", "deduplicated", "blanks", "empty", "unset", "num_gpus-wins", "num_nodes-wins",
         "include-wins", "exclude-wins"],
)
def test_cuda_visible_devices_on_the_local_machine(visible, request_kwargs, expected: list[int], note) -> None:
    resources = resolve_resources(LOCAL, ResourceRequest(**request_kwargs), visible_devices=visible)
    assert resources.hosts == {"localhost": expected}
    if note is None:
        assert resources.notes == ()
    else:
        assert len(resources.notes) == 1 and note in resources.notes[0]


def test_cuda_visible_devices_targets_the_local_host_by_its_given_name() -> None:
    resources = resolve_resources({"node-7": 8}, visible_devices="5")
    assert resources.hosts == {"node-7": [5]}


def test_cuda_visible_devices_is_ignored_with_a_hostfile() -> None:
    resources = resolve_resources({"worker-0": 2}, hostfile="hf", visible_devices="1")
    assert resources.hosts == {"worker-0": [0, 1]}
    assert resources.notes == ("CUDA_VISIBLE_DEVICES=1 ignored: a hostfile was given, devices come from it",)


@pytest.mark.parametrize(
    ("visible", "request_kwargs", "fragment"),
    [
        ("GPU-8d2c,1", {}, "CUDA_VISIBLE_DEVICES='GPU-8d2c,1': 'GPU-8d2c' is not an integer device id"),
        ("-1", {}, "'-1' is not an integer device id"),
        ("0,", {}, "'' is not an integer device id"),
        ("4,5", {}, "CUDA_VISIBLE_DEVICES=4,5 (read as --include) 'localhost:4,5': host 'localhost' has no device id 4,5"),
        (None, {"num_nodes": 2}, "--num_nodes 2 needs a hostfile"),
    ],
    ids=["uuid", "minus-one", "trailing-comma", "beyond-device-count", "num_nodes-without-hostfile"],
)
def test_local_selection_errors(visible, request_kwargs, fragment: str) -> None:
    with pytest.raises(ResourceFilterError) as caught:
        resolve_resources(LOCAL, ResourceRequest(**request_kwargs), visible_devices=visible)
    assert fragment in str(caught.value)


def test_apply_visible_devices_builds_an_include_request() -> None:
    request, notes = apply_visible_devices(ResourceRequest(), "2,3", hostfile_given=False, local_host="box")
    assert (request.include, request.exclude, request.num_nodes, request.num_gpus) == ("box:2,3", "", None, None)
    assert notes == ("CUDA_VISIBLE_DEVICES=2,3 read as --include box:2,3",)


def test_filter_devices_keeps_real_ids_of_a_partial_pool() -> None:
    available = {"a": [2, 5, 7], "b": [1]}
    assert filter_devices(available, exclude="a:5") == {"a": [2, 7], "b": [1]}
    with pytest.raises(ResourceFilterError, match=r"has no device id 0 \(its ids: 2,5,7\)"):
        filter_devices(available, include="a:0")


def test_resources_is_frozen_hashable_and_json_serialisable() -> None:
    resources = Resources.from_mapping({"b": [0, 1], "a": [3]}, notes=["n"])
    assert json.loads(json.dumps(resources.to_json_dict())) == {
        "hosts": {"b": [0, 1], "a": [3]}, "num_nodes": 2, "num_devices": 3, "notes": ["n"],
    }
    assert list(resources.hosts) == ["b", "a"]
    assert hash(resources) == hash(Resources.from_mapping({"b": [0, 1], "a": [3]}, notes=["n"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        resources.notes = ()  # type: ignore[misc]


def run_cli(*args: str, visible: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = str(ROOT)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(
        [sys.executable, "-m", "scheduler.resources", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.fixture
def hostfile(tmp_path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=2 # small\n", encoding="utf-8")
    return path


def test_cli_prints_the_selection_as_json(hostfile: Path) -> None:
    completed = run_cli("--hostfile", str(hostfile), "--include", "worker-1:1@worker-0:2,0")
    assert completed.returncode == 0, completed.stderr
    printed = json.loads(completed.stdout)
    assert list(printed["hosts"].items()) == [("worker-0", [0, 2]), ("worker-1", [1])]
    assert (printed["num_nodes"], printed["num_devices"], printed["hostfile"]) == (2, 3, str(hostfile))
    assert completed.stderr == ""


def test_cli_without_hostfile_uses_local_devices_and_cuda_visible_devices() -> None:
    completed = run_cli("--local_devices", "4", visible="3,1")
    assert completed.returncode == 0, completed.stderr
    printed = json.loads(completed.stdout)
    assert printed["hosts"] == {"localhost": [1, 3]}
    assert printed["hostfile"] is None
    assert printed["num_devices"] == 2


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--include", "worker-9"], "host 'worker-9' is not in hostfile"),
        (["--include", "worker-0", "--exclude", "worker-1"], "cannot be used together"),
        (["--num_nodes", "x"], "invalid int value: 'x'"),
        (["--local_devices", "2"], "--local_devices only applies without --hostfile"),
    ],
    ids=["unknown-host", "include-and-exclude", "argparse-error", "local-devices-with-hostfile"],
)
def test_cli_usage_error_is_one_line_and_exit_2(hostfile: Path, args: list[str], fragment: str) -> None:
    completed = run_cli("--hostfile", str(hostfile), *args)
    assert completed.returncode == 2
    assert completed.stdout == ""
    lines = completed.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert fragment in lines[0]
    assert "Traceback" not in completed.stderr


def test_cli_missing_hostfile_is_one_line_and_exit_2(tmp_path) -> None:
    completed = run_cli("--hostfile", str(tmp_path / "absent"))
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        f"error: hostfile {tmp_path / 'absent'}: file not found; pass the path of an existing hostfile, "
        f"or leave the hostfile out to use only this machine"
    ]


# ---------------------------------------------------------------- the CLI, in process (main(argv))

from scheduler import resources as resources_module  # noqa: E402


@pytest.fixture
def no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def run_main(argv: list[str], capsys) -> tuple[int | str | None, str, str]:
    """main(argv) in this process: (exit status, stdout, stderr); argparse's SystemExit is caught."""
    try:
        status: int | str | None = resources_module.main(argv)
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err


def test_main_prints_the_selection_as_two_space_indented_json(hostfile, capsys, no_visible_devices) -> None:
    status, out, err = run_main(["--hostfile", str(hostfile), "--include", "worker-1:1@worker-0:2,0"], capsys)
    assert (status, err) == (0, "")
    assert json.loads(out) == {
        "hostfile": str(hostfile), "hosts": {"worker-0": [0, 2], "worker-1": [1]},
        "num_nodes": 2, "num_devices": 3, "notes": [],
    }
    lines = out.splitlines()
    assert lines[0] == "{"
    assert lines[1] == f'  "hostfile": {json.dumps(str(hostfile))},'
    assert lines[-1] == "}"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["-i", "worker-1"], {"worker-1": [0, 1]}),
        (["-e", "worker-0:0,1,2"], {"worker-0": [3], "worker-1": [0, 1]}),
        (["--num_nodes", "1"], {"worker-0": [0, 1, 2, 3]}),
        (["--num_gpus", "1"], {"worker-0": [0], "worker-1": [0]}),
        (["--num_accelerators", "2"], {"worker-0": [0, 1], "worker-1": [0, 1]}),
        (["--num_nodes", "1", "--num_gpus", "3"], {"worker-0": [0, 1, 2]}),
        ([], {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}),
    ],
    ids=["short-include", "short-exclude", "num_nodes", "num_gpus", "num_accelerators-alias", "both-counts",
         "nothing"],
)
def test_main_flags_select_like_deepspeed(hostfile, capsys, no_visible_devices, flags, expected) -> None:
    status, out, err = run_main(["-H", str(hostfile), *flags], capsys)
    assert (status, err) == (0, "")
    printed = json.loads(out)
    assert list(printed["hosts"].items()) == list(expected.items())
    assert printed["num_nodes"] == len(expected)
    assert printed["num_devices"] == sum(len(ids) for ids in expected.values())


def test_main_without_hostfile_counts_local_devices_and_says_how(capsys, no_visible_devices) -> None:
    status, out, err = run_main(["--local_devices", "3"], capsys)
    assert (status, err) == (0, "")
    assert json.loads(out) == {
        "hostfile": None, "hosts": {"localhost": [0, 1, 2]}, "num_nodes": 1, "num_devices": 3,
        "notes": ["localhost has 3 devices according to --local_devices"],
    }


def test_main_reads_cuda_visible_devices_after_the_count_note(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    status, out, err = run_main(["--local_devices", "4"], capsys)
    assert (status, err) == (0, "")
    printed = json.loads(out)
    assert printed["hosts"] == {"localhost": [1, 3]}
    assert printed["notes"] == ["localhost has 4 devices according to --local_devices",
                                "CUDA_VISIBLE_DEVICES=3,1 read as --include localhost:3,1"]


def test_main_with_a_hostfile_notes_that_cuda_visible_devices_is_ignored(hostfile, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    status, out, _ = run_main(["--hostfile", str(hostfile)], capsys)
    assert status == 0
    printed = json.loads(out)
    assert printed["hosts"] == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}
    assert printed["notes"] == ["CUDA_VISIBLE_DEVICES=1 ignored: a hostfile was given, devices come from it"]


@pytest.mark.parametrize(
    ("gpus", "cpus", "expected_count", "counted_by"),
    [([Gpu(0, "GPU-a", 2**34), Gpu(1, "GPU-b", 2**34)], 16, 2, "nvidia-smi"), ([], 6, 6, "os.cpu_count()"), ([], None, 1, "os.cpu_count()")],
    ids=["gpus", "cpus", "cpu-count-unknown"],
)
def test_main_detects_local_devices(capsys, monkeypatch, no_visible_devices, gpus, cpus, expected_count,
                                    counted_by) -> None:
    monkeypatch.setattr(resources_module, "local_gpus", lambda: gpus)
    monkeypatch.setattr(resources_module.os, "cpu_count", lambda: cpus)
    status, out, err = run_main([], capsys)
    assert (status, err) == (0, "")
    printed = json.loads(out)
    assert printed["hosts"] == {"localhost": list(range(expected_count))}
    assert printed["notes"] == [f"localhost has {expected_count} devices according to {counted_by}"]


def test_main_gpu_listing_error_is_a_usage_error_line(capsys, monkeypatch, no_visible_devices) -> None:
    from workers.device.gpus import GpuListingError

    def broken():
        raise GpuListingError("nvidia-smi printed a line this tool cannot read")

    monkeypatch.setattr(resources_module, "local_gpus", broken)
    status, out, err = run_main([], capsys)
    assert (status, out) == (2, "")
    assert err == "error: nvidia-smi printed a line this tool cannot read\n"


@pytest.mark.parametrize(
    ("args", "expected_line"),
    [
        (["--include", "worker-0", "--exclude", "worker-1"],
         "error: --include and --exclude cannot be used together; keep only one of them"),
        (["--local_devices", "2"], "error: --local_devices only applies without --hostfile; drop one of them"),
        (["--num_nodes", "3"], "error: --num_nodes 3 but hostfile {hf} has only 2 hosts with devices; "
                               "lower --num_nodes or add hosts"),
    ],
    ids=["include-and-exclude", "local-devices-with-hostfile", "too-many-nodes"],
)
def test_main_usage_error_is_one_stderr_line_and_status_2(hostfile, capsys, no_visible_devices, args,
                                                          expected_line) -> None:
    status, out, err = run_main(["--hostfile", str(hostfile), *args], capsys)
    assert (status, out) == (2, "")
    assert err == expected_line.format(hf=hostfile) + "\n"


def test_main_joins_a_multi_line_error_into_one_line(capsys, monkeypatch) -> None:
    def failing(args, environ):
        raise UsageError("first line\nsecond line")

    monkeypatch.setattr(resources_module, "_resolve_from_args", failing)
    status, out, err = run_main([], capsys)
    assert (status, out, err) == (2, "", "error: first line second line\n")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--num_nodes", "x"], "argument --num_nodes: invalid int value: 'x'"),
        (["--num_gpus", "1.5"], "argument --num_gpus/--num_accelerators: invalid int value: '1.5'"),
        (["--local_devices", "two"], "argument --local_devices: invalid int value: 'two'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_main_argparse_error_is_one_line_and_status_2(capsys, argv, fragment) -> None:
    status, out, err = run_main(argv, capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("error: ") and err.endswith(" (see --help)\n")
    assert fragment in err


def test_main_help_names_the_command_and_every_option(capsys) -> None:
    status, out, _ = run_main(["--help"], capsys)
    assert status == 0
    assert out.startswith("usage: python -m scheduler.resources ")
    assert "Show which hosts and device ids a run would use; runs nothing." in out
    for option in ("-H HOSTFILE, --hostfile HOSTFILE", "-i INCLUDE, --include INCLUDE",
                   "-e EXCLUDE, --exclude EXCLUDE", "--num_nodes NUM_NODES",
                   "--num_gpus NUM_GPUS, --num_accelerators NUM_GPUS", "--local_devices LOCAL_DEVICES"):
        assert option in out
    import re

    flat = " ".join(out.split())
    for words in ("MPI-style hostfile: 'HOSTNAME slots=N' per line", "NODE[:ID[,ID...]][@NODE...]: use only these",
                  "NODE[:ID[,ID...]][@NODE...]: use all but these", "use the first N hosts",
                  "use the first G devices of each host",
                  "without --hostfile: device count of this machine (default: the GPUs nvidia-smi lists, else "
                  "CPU count)", "Show which hosts and device ids a run would use; runs nothing."):
        assert re.search(r"(^| )" + re.escape(words) + r"( |$)", flat), words


def test_main_defaults_mean_not_given(capsys, monkeypatch) -> None:
    seen = {}

    def record(args, environ):
        seen.update(vars(args))
        return Resources.from_mapping({"localhost": [0]})

    monkeypatch.setattr(resources_module, "_resolve_from_args", record)
    status, _, _ = run_main([], capsys)
    assert status == 0
    assert seen == {"hostfile": None, "include": "", "exclude": "", "num_nodes": None, "num_gpus": None,
                    "local_devices": None}


def test_main_passes_the_process_environment(capsys, monkeypatch) -> None:
    seen = {}

    def record(args, environ):
        seen["environ"] = environ
        return Resources.from_mapping({"localhost": [0]})

    monkeypatch.setattr(resources_module, "_resolve_from_args", record)
    run_main([], capsys)
    assert seen["environ"] is os.environ


def test_main_without_hostfile_still_applies_the_counts(capsys, no_visible_devices) -> None:
    status, out, err = run_main(["--local_devices", "4", "--num_gpus", "2"], capsys)
    assert (status, err) == (0, "")
    assert json.loads(out)["hosts"] == {"localhost": [0, 1]}


def test_default_labels_name_include_and_the_hostfile() -> None:
    from scheduler.launch.resources import first_nodes

    with pytest.raises(ResourceFilterError) as caught:
        parse_node_specs("a@")
    assert str(caught.value) == ("--include 'a@': an empty node (check the '@' separators); "
                                 "expected NODE[:ID[,ID...]][@NODE[:ID...]]..., e.g. worker-0:0,1@worker-1")
    with pytest.raises(ResourceFilterError) as caught:
        first_nodes({"a": [0]}, 2)
    assert str(caught.value) == "--num_nodes 2 but the hostfile has only 1 hosts with devices; lower --num_nodes or add hosts"


@pytest.mark.parametrize(
    ("kwargs", "prefix"),
    [
        ({"include": "a:x", "include_label": "CUDA_VISIBLE_DEVICES=x (read as --include)"},
         "CUDA_VISIBLE_DEVICES=x (read as --include) 'a:x': device id 'x'"),
        ({"include": "a:x"}, "--include 'a:x': device id 'x'"),
        ({"exclude": "a:x", "include_label": "ignored for an exclude"}, "--exclude 'a:x': device id 'x'"),
    ],
)
def test_grammar_errors_carry_the_flag_they_came_from(kwargs: dict[str, str], prefix: str) -> None:
    with pytest.raises(ResourceFilterError) as caught:
        filter_devices({"a": [0]}, **kwargs)
    assert str(caught.value).startswith(prefix)


@pytest.mark.parametrize(
    ("count", "listed"),
    [(8, "h0, h1, h2, h3, h4, h5, h6, h7"), (9, "h0, h1, h2, h3, h4, h5, h6, h7, ... (9 in all)")],
)
def test_an_unknown_host_error_lists_at_most_8_hosts(count: int, listed: str) -> None:
    available = {f"h{i}": [0] for i in range(count)}
    with pytest.raises(ResourceFilterError) as caught:
        filter_devices(available, include="zz", where="hostfile hf")
    assert str(caught.value) == f"--include 'zz': host 'zz' is not in hostfile hf (hosts: {listed}); use one of those names"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: filter_devices({"a": [0]}, include="b"),
         "--include 'b': host 'b' is not in the hostfile (hosts: a); use one of those names"),
        (lambda: resolve_resources({"localhost": 2}, ResourceRequest(exclude="zz")),
         "--exclude 'zz': host 'zz' is not in the local machine (hosts: localhost); use one of those names"),
        (lambda: resolve_resources({"a": 2}, ResourceRequest(include="a", num_gpus=1), hostfile="hf"),
         "--num_nodes/--num_gpus cannot be combined with --include/--exclude; "
         "name the hosts and device ids in --include instead"),
        (lambda: resolve_resources({"a": 2, "b": 2}, ResourceRequest(num_nodes=2)),
         "--num_nodes 2 needs a hostfile: without one only this machine (a, b) is used; "
         "pass a hostfile or drop --num_nodes"),
        # a pool of two hosts without a hostfile: CUDA_VISIBLE_DEVICES names the local host, not the first one
        (lambda: resolve_resources({"a": 2, "b": 2}, visible_devices="1"),
         "CUDA_VISIBLE_DEVICES=1 (read as --include) 'localhost:1': host 'localhost' is not in the local machine "
         "(hosts: a, b); use one of those names"),
    ],
    ids=["filter-defaults", "local-machine", "counts-with-filter", "nodes-need-hostfile", "visible-on-two-hosts"],
)
def test_whole_error_lines(call, expected: str) -> None:
    with pytest.raises(ResourceFilterError) as caught:
        call()
    assert str(caught.value) == expected
