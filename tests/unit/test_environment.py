"""DeepSpeed's export rules, `.deepspeed_env` parsing and precedence, and quoting that survives a shell."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from scheduler.launch.environment import (
    collect_exports,
    env_file_paths,
    export_statement,
    exports_from_environ,
    is_secret,
    launch_pythonpath,
    parse_env_file,
    read_env_file,
    render_exports,
)
from scheduler.errors import UsageError

CWD = "/work/job"


@pytest.mark.parametrize(
    ("name", "exported"),
    [
        ("NCCL_DEBUG", True),
        ("NCCLX", True),
        ("PYTHONHASHSEED", True),
        ("MV2_USE_CUDA", True),
        ("UCX_TLS", True),
        ("MLFLOW_RUN_ID", True),
        ("PATH", False),
        ("HOME", False),
        ("CUDA_VISIBLE_DEVICES", False),
        ("MY_NCCL_DEBUG", False),
        ("nccl_debug", False),
        ("LD_LIBRARY_PATH", False),
        ("NCCL-DEBUG", False),
        ("PYTHON.X", False),
    ],
)
def test_prefix_rule(name: str, exported: bool) -> None:
    assert (name in exports_from_environ({name: "v"}, CWD)) is exported


def test_environ_order_kept_and_pythonpath_appended_last_when_absent() -> None:
    environ = {"UCX_TLS": "tcp", "PATH": "/bin", "NCCL_DEBUG": "INFO"}
    assert list(exports_from_environ(environ, CWD).items()) == [
        ("UCX_TLS", "tcp"), ("NCCL_DEBUG", "INFO"), ("PYTHONPATH", CWD),
    ]


def test_existing_pythonpath_keeps_its_position_with_cwd_in_front() -> None:
    environ = {"PYTHONPATH": "/lib/a:/lib/b", "NCCL_DEBUG": "INFO"}
    assert list(exports_from_environ(environ, CWD).items()) == [
        ("PYTHONPATH", f"{CWD}:/lib/a:/lib/b"), ("NCCL_DEBUG", "INFO"),
    ]


@pytest.mark.parametrize(
    ("existing", "expected"), [(None, CWD), ("", CWD), ("/x", f"{CWD}:/x"), ("/x:/y", f"{CWD}:/x:/y")]
)
def test_launch_pythonpath(existing: str | None, expected: str) -> None:
    environ = {} if existing is None else {"PYTHONPATH": existing}
    assert launch_pythonpath(environ, CWD) == expected


@pytest.mark.parametrize(
    ("aisc", "expected_names"),
    [
        (False, {"NCCL_IB_HCA", "UCX_NET_DEVICES", "NCCL_IB_HCA_X", "PYTHONPATH"}),
        (True, {"NCCL_IB_HCA_X", "PYTHONPATH"}),
    ],
)
def test_aisc_exclusions_are_exact_names(aisc: bool, expected_names: set[str]) -> None:
    environ = {"NCCL_IB_HCA": "mlx5_0", "UCX_NET_DEVICES": "eth0", "NCCL_IB_HCA_X": "1"}
    if aisc:
        environ["AISC_JOB_NAME"] = "job"
    assert set(exports_from_environ(environ, CWD)) == expected_names


def test_environ_values_are_not_stripped() -> None:
    assert exports_from_environ({"NCCL_X": "  padded \n"}, CWD)["NCCL_X"] == "  padded \n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=1\n", {"A": "1"}),
        ("A = 1 \n", {"A": "1"}),
        ("A=x=y\n", {"A": "x=y"}),
        ("A=\n", {"A": ""}),
        ("# comment\n\n   \nA=1\n  # indented comment\n", {"A": "1"}),
        ("A=1\nA=2\n", {"A": "2"}),
        ("A=1\r\nB=2\r\n", {"A": "1", "B": "2"}),
        ("A=a b # not a comment\n", {"A": "a b # not a comment"}),
        ("A=it's \"q\" $HOME\n", {"A": "it's \"q\" $HOME"}),
        ("", {}),
    ],
)
def test_parse_env_file(text: str, expected: dict[str, str]) -> None:
    assert parse_env_file(text, "f") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("A=1\nNOEQUALS\n", r"envfile, line 2: 'NOEQUALS' has no '='"),
        ("export A=1\n", r"envfile, line 1: 'export A' is not a variable name"),
        ("1A=1\n", "'1A' is not a variable name"),
        ("=1\n", "'' is not a variable name"),
    ],
)
def test_parse_env_file_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_env_file(text, "envfile")


def _reader(files: dict[str, str], asked: list[str]):
    def read(path: str) -> str | None:
        asked.append(path)
        return files.get(path)

    return read


def test_precedence_environ_then_home_then_cwd() -> None:
    files = {
        "/home/u/.deepspeed_env": "NCCL_DEBUG=WARN\nSHARED=home\nHOME_ONLY=h\n",
        f"{CWD}/.deepspeed_env": "SHARED=cwd\n",
    }
    asked: list[str] = []
    exports = collect_exports(
        {"NCCL_DEBUG": "INFO", "PATH": "/bin"}, home_dir="/home/u", cwd=CWD, read_text=_reader(files, asked)
    )
    assert asked == ["/home/u/.deepspeed_env", f"{CWD}/.deepspeed_env"]
    assert list(exports.items()) == [
        ("NCCL_DEBUG", "WARN"), ("PYTHONPATH", CWD), ("SHARED", "cwd"), ("HOME_ONLY", "h"),
    ]


def test_ds_env_file_names_the_files() -> None:
    asked: list[str] = []
    environ = {"DS_ENV_FILE": "custom.env"}
    collect_exports(environ, home_dir="/home/u", cwd=CWD, read_text=_reader({}, asked))
    assert asked == ["/home/u/custom.env", f"{CWD}/custom.env"]
    assert env_file_paths({}, "/h", "/c") == ("/h/.deepspeed_env", "/c/.deepspeed_env")


def test_missing_files_leave_environ_exports() -> None:
    exports = collect_exports({"UCX_TLS": "tcp"}, home_dir="/h", cwd=CWD, read_text=lambda path: None)
    assert exports == {"UCX_TLS": "tcp", "PYTHONPATH": CWD}


def test_file_error_names_the_path() -> None:
    with pytest.raises(UsageError, match=f"{CWD}/.deepspeed_env, line 1"):
        collect_exports({}, home_dir="/h", cwd=CWD, read_text=lambda path: "BAD\n" if path.startswith(CWD) else None)


def test_read_env_file_from_disk(tmp_path) -> None:
    (tmp_path / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\n", encoding="utf-8")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "latin1").write_bytes(b"A=\xe9\xff\n")
    assert read_env_file(str(tmp_path / ".deepspeed_env")) == "NCCL_DEBUG=INFO\n"
    assert read_env_file(str(tmp_path / "missing")) is None
    assert read_env_file(str(tmp_path / "a_dir")) is None
    with pytest.raises(UsageError, match="not UTF-8"):
        read_env_file(str(tmp_path / "latin1"))


def test_collect_exports_reads_real_files(tmp_path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n", encoding="utf-8")
    (work / ".deepspeed_env").write_text("B=work\n", encoding="utf-8")
    exports = collect_exports({}, home_dir=str(home), cwd=str(work))
    assert exports == {"PYTHONPATH": str(work), "A": "home", "B": "work"}


NASTY_VALUES = [
    "plain",
    "/usr/local/lib/python3.9/site-packages",
    "a b",
    "  leading and trailing  ",
    "it's",
    'say "hi"',
    "$HOME",
    "${PATH}",
    "`id`",
    "$(id)",
    "a;b",
    "a && b",
    "line1\nline2",
    "",
    "back\\slash",
    "*",
    "~",
    "64(x2)",
    "'\"'\"'",
    "tab\there",
]


@pytest.mark.parametrize("value", NASTY_VALUES)
def test_export_statement_round_trips_through_shlex(value: str) -> None:
    assert shlex.split(export_statement("K", value)) == ["export", f"K={value};"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_rendered_exports_survive_bash() -> None:
    exports = {f"V{index}": value for index, value in enumerate(NASTY_VALUES)}
    printer = " ".join(f'printf "%s\\0" "${name}";' for name in exports)
    script = f"{render_exports(exports)} {printer}"
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"},
        check=True,
    )
    assert result.stdout.decode("utf-8").split("\0")[:-1] == NASTY_VALUES


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_rendered_exports_reach_child_processes() -> None:
    script = f"{render_exports({'NCCL_DEBUG': 'a b;c', 'PYTHONPATH': '/x y'})} env"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
                            check=True)
    assert "NCCL_DEBUG=a b;c" in result.stdout.splitlines()
    assert "PYTHONPATH=/x y" in result.stdout.splitlines()


def test_render_format_and_order() -> None:
    assert render_exports({"B": "1", "A": "x y"}) == "export B=1; export A='x y';"
    assert render_exports({}) == ""


def test_export_statement_rejects_bad_names() -> None:
    with pytest.raises(UsageError, match="not a shell variable name"):
        export_statement("A-B", "1")


@pytest.mark.parametrize(("name", "value", "secret"), [
    ("MLFLOW_TRACKING_PASSWORD", "x", True),
    ("MLFLOW_TRACKING_TOKEN", "x", True),
    ("HF_TOKEN", "x", True),
    ("WANDB_API_KEY", "x", True),
    ("AWS_SECRET_ACCESS_KEY", "x", True),
    ("MLFLOW_TRACKING_URI", "https://user:pass@mlflow.example", True),  # a URL with a password
    ("MLFLOW_TRACKING_URI", "https://mlflow.example:5000", False),
    ("MLFLOW_TRACKING_URI", "https://user@mlflow.example", False),  # a user name alone
    ("PYTHONPATH", "/work/job:/lib", False),
    ("NCCL_SOCKET_IFNAME", "=eth0", False),
    ("MLFLOW_EXPERIMENT_NAME", "gpt", False),
])
def test_secrets_are_credential_names_or_urls_with_a_password(name: str, value: str, secret: bool) -> None:
    assert is_secret(name, value) is secret
