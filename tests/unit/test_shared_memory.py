"""workers.process.shared_memory: only the ending rank's own DeepSpeed all-reduce segment is removed."""
from __future__ import annotations

from pathlib import Path

from workers.process.shared_memory import remove_rank_segment, segment_name


def test_the_name_is_deepspeeds() -> None:
    # deepspeed/ops/csrc/cpu/comm/shm.cpp: "%s_%d_%s_%s" (prefix, uid, MASTER_ADDR, MASTER_PORT), then "_%d" rank
    assert segment_name("127.0.0.1", 29500, 1, uid=0) == "deepspeed_allreduce_buffer_0_127.0.0.1_29500_1"


def test_only_the_ranks_own_segment_goes(tmp_path: Path) -> None:
    mine = tmp_path / segment_name("127.0.0.1", 40001, 0)
    other_rank = tmp_path / segment_name("127.0.0.1", 40001, 1)
    other_job = tmp_path / segment_name("127.0.0.1", 40002, 0)
    for path in (mine, other_rank, other_job):
        path.write_bytes(b"x")
    assert remove_rank_segment("127.0.0.1", 40001, 0, shm_dir=tmp_path)
    assert not mine.exists() and other_rank.exists() and other_job.exists()
    assert not remove_rank_segment("127.0.0.1", 40001, 0, shm_dir=tmp_path)  # already gone: nothing to do
    assert not remove_rank_segment("../x", 40001, 0, shm_dir=tmp_path)  # never outside the folder
