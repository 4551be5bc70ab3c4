"""Hostfile grammar and errors: the file DeepSpeed users already have must read the same here."""
from __future__ import annotations

import pytest

from scheduler.errors import HostfileError, UsageError
from scheduler.hostfile import LOCAL_HOSTNAME, local_pool, parse_hostfile, read_hostfile


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("worker-0 slots=4\nworker-1 slots=2\n", {"worker-0": 4, "worker-1": 2}),
        ("# cluster\n\nworker-0 slots=4 # trailing\n   \n  worker-1   slots=8  \n", {"worker-0": 4, "worker-1": 8}),
        ("worker-0 slots=2 max_slots=4", {"worker-0": 2}),
        ("worker-0 slots=0", {"worker-0": 0}),
        ("worker-0\tslots=3", {"worker-0": 3}),
        ("worker-0 slots=2#no space before the comment", {"worker-0": 2}),
        ("worker-0 slots=007", {"worker-0": 7}),
        ("worker-0 slots=1\r\nworker-1 slots=5\r\n", {"worker-0": 1, "worker-1": 5}),
        ("#worker-9 slots=8\n10.0.0.2 slots=16", {"10.0.0.2": 16}),
    ],
    ids=["plain", "comments-and-blanks", "extra-key", "zero-slots", "tab", "glued-comment", "leading-zeros", "crlf",
         "commented-host"],
)
def test_parse_hostfile_accepts_deepspeed_grammar(text: str, expected: dict[str, int]) -> None:
    assert parse_hostfile(text, "hf") == expected


def test_parse_hostfile_keeps_file_order() -> None:
    parsed = parse_hostfile("zeta slots=1\nalpha slots=2\nmid slots=3\n", "hf")
    assert list(parsed) == ["zeta", "alpha", "mid"]


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("worker-0 slots=4\nworker-0 slots=2", 2, "host 'worker-0' is already listed on line 1"),
        ("this is bad slots=1", 1, "cannot read 'this is bad slots=1'"),
        ("missingslots", 1, "cannot read 'missingslots'"),
        ("worker-1 slots = 2", 1, "cannot read"),
        ("worker-1 SLOTS=2", 1, "cannot read"),
        ("worker-1 slots=2extra", 1, "cannot read 'worker-1 slots=2extra'"),
        ("worker-1 slots=", 1, "cannot read"),
        ("worker-1 slots=-1", 1, "cannot read"),
        ("slots=4", 1, "cannot read"),
        ("a slots=1\n\nb slots=x\nc slots=1", 3, "cannot read 'b slots=x'"),
        ("a slots=1\nbroken\na slots=1", 2, "cannot read 'broken'"),
    ],
    ids=["duplicate", "spaces-in-host", "no-slots", "spaced-equals", "upper-case", "glued-text", "no-count",
         "negative", "no-host", "bad-after-good", "first-error-wins"],
)
def test_parse_hostfile_rejects_bad_lines_naming_file_and_line(text: str, line: int, fragment: str) -> None:
    with pytest.raises(HostfileError) as caught:
        parse_hostfile(text, "cluster.hosts")
    message = str(caught.value)
    assert message.startswith(f"hostfile cluster.hosts, line {line}: ")
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["", "\n\n  \n", "# only a comment\n   # another\n"], ids=["empty", "blank", "comments"])
def test_parse_hostfile_without_hosts_is_an_error(text: str) -> None:
    with pytest.raises(HostfileError, match=r"^hostfile hf: no host lines found .*worker-0 slots=8"):
        parse_hostfile(text, "hf")


def test_hostfile_error_is_a_usage_error() -> None:
    assert issubclass(HostfileError, UsageError)


def test_read_hostfile_parses_the_file(tmp_path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("b slots=2\na slots=1\n", encoding="utf-8")
    parsed = read_hostfile(path)
    assert list(parsed.items()) == [("b", 2), ("a", 1)]


def test_read_hostfile_names_the_path_in_grammar_errors(tmp_path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("a slots=1\na slots=2\n", encoding="utf-8")
    with pytest.raises(HostfileError, match=rf"^hostfile {path}, line 2: "):
        read_hostfile(path)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda tmp: tmp / "absent", "file not found"),
        (lambda tmp: tmp, "cannot be read"),
        (lambda tmp: _write_bytes(tmp / "latin1", b"caf\xe9 slots=1\n"), "not UTF-8"),
    ],
    ids=["missing", "directory", "not-utf8"],
)
def test_read_hostfile_unreadable_file_is_one_clear_line(tmp_path, make, fragment: str) -> None:
    path = make(tmp_path)
    with pytest.raises(HostfileError) as caught:
        read_hostfile(path)
    message = str(caught.value)
    assert message.startswith(f"hostfile {path}: ")
    assert fragment in message
    assert "\n" not in message


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("hostname", "count"), [(LOCAL_HOSTNAME, 4), ("node-7", 1)])
def test_local_pool_is_one_host_with_its_devices(hostname: str, count: int) -> None:
    assert local_pool(hostname, count) == {hostname: count}


@pytest.mark.parametrize(
    ("hostname", "count", "fragment"),
    [("localhost", 0, "reports 0 devices"), ("localhost", -2, "reports -2 devices"), ("", 4, "not a host name"),
     ("my host", 4, "not a host name")],
)
def test_local_pool_rejects_unusable_machines(hostname: str, count: int, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        local_pool(hostname, count)


def test_local_hostname_matches_deepspeed() -> None:
    assert LOCAL_HOSTNAME == "localhost"


# ---------------------------------------------------------------- found by mutation testing (bench/mutation.sh)


def test_a_hostfile_of_exactly_the_size_limit_is_read_whole(tmp_path) -> None:
    """The limit (MAX_HOSTFILE_BYTES) is inclusive, and a file at the limit is read to its last
    byte: the host line at its very end keeps its full slot count."""
    from scheduler.hostfile import MAX_HOSTFILE_BYTES

    line = "worker-1 slots=42"
    path = tmp_path / "hostfile"
    path.write_text("#" * (MAX_HOSTFILE_BYTES - len(line) - 1) + "\n" + line)
    assert path.stat().st_size == MAX_HOSTFILE_BYTES
    assert read_hostfile(path) == {"worker-1": 42}
    path.write_text("#" * (MAX_HOSTFILE_BYTES - len(line)) + "\n" + line)
    with pytest.raises(HostfileError, match="larger than 1 MiB"):
        read_hostfile(path)


def test_local_pool_accepts_exactly_the_per_host_maximum() -> None:
    """MAX_SLOTS_PER_HOST devices is allowed (the same bound a hostfile line has); one more is not."""
    from scheduler.hostfile import MAX_SLOTS_PER_HOST

    assert local_pool("h", MAX_SLOTS_PER_HOST) == {"h": MAX_SLOTS_PER_HOST}
    assert parse_hostfile(f"h slots={MAX_SLOTS_PER_HOST}") == {"h": MAX_SLOTS_PER_HOST}
    with pytest.raises(UsageError, match="more than one host can have"):
        local_pool("h", MAX_SLOTS_PER_HOST + 1)


@pytest.mark.parametrize(("total_workers", "expected"), [(0.5, 1), (1, 1), (2.5, 2), (10_000, 256)])
def test_max_local_slots_is_whole_workers_of_memory(monkeypatch, total_workers: float, expected: int) -> None:
    """One embedded slot worker per SLOT_WORKER_BYTES of RAM, whole workers only, at least 1 and at
    most MAX_LOCAL_SLOTS (256)."""
    import types

    from scheduler import hostfile

    total = int(total_workers * hostfile.SLOT_WORKER_BYTES)
    monkeypatch.setattr(hostfile.psutil, "virtual_memory", lambda: types.SimpleNamespace(total=total))
    slots = hostfile.max_local_slots()
    assert slots == expected and isinstance(slots, int)
