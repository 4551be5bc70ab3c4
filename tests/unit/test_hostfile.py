"""Hostfile grammar and errors: the file DeepSpeed users already have must read the same here."""
from __future__ import annotations

import os

import pytest

from scheduler.errors import HostfileError, UsageError
from scheduler.launch.hostfile import LOCAL_HOSTNAME, local_pool, parse_hostfile, read_hostfile


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
    from scheduler.launch.hostfile import MAX_HOSTFILE_BYTES

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
    from scheduler.launch.hostfile import MAX_SLOTS_PER_HOST

    assert local_pool("h", MAX_SLOTS_PER_HOST) == {"h": MAX_SLOTS_PER_HOST}
    assert parse_hostfile(f"h slots={MAX_SLOTS_PER_HOST}") == {"h": MAX_SLOTS_PER_HOST}
    with pytest.raises(UsageError, match="more than one host can have"):
        local_pool("h", MAX_SLOTS_PER_HOST + 1)


@pytest.mark.parametrize(("total_workers", "expected"), [(0.5, 1), (1, 1), (2.5, 2), (10_000, 256)])
def test_max_local_slots_is_whole_workers_of_memory(monkeypatch, total_workers: float, expected: int) -> None:
    """One embedded slot worker per SLOT_WORKER_BYTES of RAM, whole workers only, at least 1 and at
    most MAX_LOCAL_SLOTS (256)."""
    import types

    from scheduler.launch import hostfile

    total = int(total_workers * hostfile.SLOT_WORKER_BYTES)
    monkeypatch.setattr(hostfile.psutil, "virtual_memory", lambda: types.SimpleNamespace(total=total))
    slots = hostfile.max_local_slots()
    assert slots == expected and isinstance(slots, int)


# ---------------------------------------------------------------- whole error lines: file, line, value and fix

EXAMPLE = "'worker-0 slots=8'"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a slots=1\n# b\na slots=2", "hostfile hf, line 3: host 'a' is already listed on line 1; "
                                      "list each host once with its total slots"),
        ("  x y  \n", "hostfile hf, line 1: cannot read 'x y'; write one host per line as 'HOSTNAME slots=N', "
                      f"e.g. {EXAMPLE}"),
        ("a slots=1\nb slots=1025", "hostfile hf, line 2: slots=1025 is more devices than one host can have "
                                    "(at most 1024); write the host's real count"),
        ("a slots=1234567890123", "hostfile hf, line 1: slots=123456789012... is more devices than one host can "
                                  "have (at most 1024); write the host's real count"),
        ("a slots=123456789012", "hostfile hf, line 1: slots=123456789012 is more devices than one host can "
                                 "have (at most 1024); write the host's real count"),
        ("a slots=" + "9" * 5000, "hostfile hf, line 1: slots=999999999999... is more devices than one host can "
                                  "have (at most 1024); write the host's real count"),
        ("# nothing\n", "hostfile hf: no host lines found (empty, or only blanks and comments); "
                        f"add one line per host such as {EXAMPLE}"),
    ],
    ids=["duplicate", "unreadable-line", "too-many-slots", "13-digits-cut", "12-digits-whole", "huge-count",
         "no-hosts"],
)
def test_parse_hostfile_error_lines(text: str, expected: str) -> None:
    with pytest.raises(HostfileError) as caught:
        parse_hostfile(text, "hf")
    assert str(caught.value) == expected


def test_parse_hostfile_names_an_unnamed_source() -> None:
    with pytest.raises(HostfileError, match=r"^hostfile <hostfile>: no host lines found"):
        parse_hostfile("")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a slots=1024", {"a": 1024}),
        ("a slots=000001", {"a": 1}),
        ("a slots=001024", {"a": 1024}),
        ("a\u00a0b slots=1", None),
    ],
    ids=["per-host-maximum", "six-digits-with-zeros", "maximum-with-zeros", "non-breaking-space"],
)
def test_parse_hostfile_slot_counts(text: str, expected: dict[str, int] | None) -> None:
    if expected is None:
        with pytest.raises(HostfileError, match="cannot read"):
            parse_hostfile(text, "hf")
    else:
        assert parse_hostfile(text, "hf") == expected


def test_read_hostfile_error_lines(tmp_path) -> None:
    from scheduler.launch.hostfile import MAX_HOSTFILE_BYTES

    cases = []
    absent = tmp_path / "absent"
    cases.append((absent, f"hostfile {absent}: file not found; pass the path of an existing hostfile, "
                          "or leave the hostfile out to use only this machine"))
    cases.append((tmp_path, f"hostfile {tmp_path}: cannot be read (Is a directory); pass a readable file"))
    latin = _write_bytes(tmp_path / "latin1", b"caf\xe9 slots=1\n")
    cases.append((latin, f"hostfile {latin}: not UTF-8 text; save it as plain text lines such as {EXAMPLE}"))
    big = tmp_path / "big"
    big.write_text("#" * (MAX_HOSTFILE_BYTES + 1))
    cases.append((big, f"hostfile {big}: larger than 1 MiB; pass a hostfile, one line per host"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases.append((fifo, f"hostfile {fifo}: not a regular file; pass the path of a text file with lines such as "
                        f"{EXAMPLE}"))
    for path, expected in cases:
        with pytest.raises(HostfileError) as caught:
            read_hostfile(path)
        assert str(caught.value) == expected
        with pytest.raises(HostfileError) as caught:
            read_hostfile(str(path))
        assert str(caught.value) == expected


def test_read_hostfile_unreadable_permissions(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text("a slots=1\n")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything
        pytest.skip("running as root: the file stays readable")
    with pytest.raises(HostfileError) as caught:
        read_hostfile(path)
    assert str(caught.value) == f"hostfile {path}: cannot be read (Permission denied); pass a readable file"


@pytest.mark.parametrize(
    ("hostname", "count", "expected"),
    [
        ("", 4, "local host name '' is not a host name; pass a name without spaces"),
        ("a\tb", 4, "local host name 'a\\tb' is not a host name; pass a name without spaces"),
        ("box", 1025, "1025 devices on box is more than one host can have (at most 1024); give a real device count"),
        ("box", 0, "no hostfile given and this machine (box) reports 0 devices; pass a hostfile or a device "
                   "count of at least 1"),
    ],
)
def test_local_pool_error_lines(hostname: str, count: int, expected: str) -> None:
    with pytest.raises(UsageError) as caught:
        local_pool(hostname, count)
    assert str(caught.value) == expected


def test_a_zero_padded_count_is_its_number_as_deepspeed_reads_it() -> None:
    """DeepSpeed's parser takes int("0000004") = 4; the guard against huge counts counts significant
    digits only, so padding is not mistaken for a count above the per-host limit."""
    assert parse_hostfile("a slots=0000004\nb slots=00000000000000001024", "hf") == {"a": 4, "b": 1024}
