"""The Redis keyspace is a contract between processes of different ages (a worker started before a
control worker, a Lua script, an operator's `redis-cli --scan`): every builder's string is held
here to the letter, and the module's own list of keys names every key it builds."""
from __future__ import annotations

import re

import pytest

from workers.state import keys

#: Every builder with sample arguments, and the exact string it must build.
BUILT = [
    (keys.slot, ("n0.gpu1",), "autotune:slot:n0.gpu1"),
    (keys.control, ("n0",), "autotune:control:n0"),
    (keys.gang, ("n0.gpu1",), "autotune:gang:n0.gpu1"),
    (keys.gpu_claim, ("m1", "GPU-3333"), "autotune:gpu:m1:GPU-3333"),
    (keys.withdrawn, ("n0.gpu1",), "autotune:withdrawn:n0.gpu1"),
    (keys.unhealthy, ("n0.gpu1",), "autotune:unhealthy:n0.gpu1"),
    (keys.rendezvous, ("a1",), "autotune:rdzv:a1"),
    (keys.measured, ("a1",), "autotune:measured:a1"),
    (keys.abort, ("a1",), "autotune:abort:a1"),
    (keys.pgid, ("n0.gpu1", "t1"), "autotune:pgid:n0.gpu1:t1"),
    (keys.pgid_pattern, (), "autotune:pgid:*:*"),
    (keys.pgid_pattern, ("n0.gpu1",), "autotune:pgid:n0.gpu1:*"),
    (keys.rank_claim, ("n0.gpu1", "t1"), "autotune:claim:n0.gpu1:t1"),
    (keys.rank_process, ("n0.gpu1", "t1"), "autotune:rankproc:n0.gpu1:t1"),
    (keys.rank_process_pattern, (), "autotune:rankproc:*:*"),
    (keys.rank_process_pattern, ("n0.gpu1",), "autotune:rankproc:n0.gpu1:*"),
    (keys.rank_index, ("n0.gpu1",), "autotune:rankkeys:n0.gpu1"),
    (keys.job_events, ("j",), "autotune:job:j:events"),
    (keys.job_attempts, ("j",), "autotune:job:j:attempts"),
    (keys.job_state, ("j",), "autotune:job:j:state"),
    (keys.job_settling, ("j",), "autotune:job:j:settling"),
    (keys.job_spec, ("j",), "autotune:job:j:spec"),
    (keys.job_queue, ("j",), "autotune:job:j:queue"),
    (keys.job_shapes, ("j",), "autotune:job:j:shapes"),
    (keys.job_queue_shape, ("j", "1x2:0"), "autotune:job:j:queue:1x2:0"),
    (keys.job_running, ("j",), "autotune:job:j:running"),
    (keys.job_walls, ("j",), "autotune:job:j:walls"),
    (keys.job_recorded, ("j",), "autotune:job:j:recorded"),
]

CONSTANTS = {"PREFIX": "autotune:", "SLOT_INDEX": "autotune:slots", "SLOT_EPOCH": "autotune:slots:epoch",
             "SERVER_EPOCH": "autotune:server", "JOB_STATE_PATTERN": "autotune:job:*:state",
             "SEQUENCE": "autotune:seq", "JOBS": "autotune:jobs", "DISPATCH_LOCK": "autotune:lock:dispatch",
             "RANK_SLOTS": "autotune:rankslots", "REDIS_USER_CHECK": "autotune:redis-user-check"}


def _builders() -> set[str]:
    """The module's public key builders, by name (`job_keys` builds a list, held below)."""
    return {name for name, value in vars(keys).items() if callable(value) and not name.startswith("_")
            and not isinstance(value, type) and name != "job_keys"}


@pytest.mark.parametrize(("build", "args", "expected"), BUILT, ids=[expected for _, _, expected in BUILT])
def test_each_builder_builds_its_string_to_the_letter(build, args, expected) -> None:
    assert build(*args) == expected


def test_every_builder_is_held_to_its_string() -> None:
    held = {id(build) for build, _, _ in BUILT}
    assert {name for name in _builders() if id(getattr(keys, name)) not in held} == set()


def test_the_constants_keep_their_strings() -> None:
    assert {name: getattr(keys, name) for name in CONSTANTS} == CONSTANTS


def test_a_builder_takes_its_values_by_name_too() -> None:
    assert keys.job_queue_shape(job="j", shape="1x2:0") == "autotune:job:j:queue:1x2:0"
    assert keys.pgid_pattern(queue="n0.gpu1") == "autotune:pgid:n0.gpu1:*"
    assert keys.gpu_claim("m1", gpu_uuid="GPU-3333") == "autotune:gpu:m1:GPU-3333"


@pytest.mark.parametrize("args", [(), ("n0.gpu1", "extra")])
def test_a_builder_refuses_a_missing_or_extra_value(args) -> None:
    with pytest.raises(TypeError):
        keys.slot(*args)


def test_a_jobs_active_keys_are_its_own() -> None:
    assert keys.job_keys("j") == ["autotune:job:j:spec", "autotune:job:j:queue", "autotune:job:j:running",
                                  "autotune:job:j:walls", "autotune:job:j:recorded", "autotune:job:j:state",
                                  "autotune:job:j:settling"]


def _listed(key: str) -> bool:
    """Whether the module docstring's keyspace has a line for this key; in `key` each value is a NUL
    and each pattern's `*` stands for one placeholder such as `<job>` or `<node>.gpu<i>`."""
    shape = re.escape(key).replace("\x00", r"\S+").replace(r"\*", r"\S+")
    return re.search(rf"^\s*{shape}\s", keys.__doc__ or "", re.MULTILINE) is not None


def test_the_module_lists_every_key_it_builds() -> None:
    built = [build(*["\x00"] * len(args)) for build, args, _ in BUILT]
    built += [value for name, value in CONSTANTS.items() if name != "PREFIX"]
    assert [key for key in built if not _listed(key)] == []
