"""A job's spec as JSON (`scheduler.cluster.jobs`), the refusal of shapes no slot can take
(`scheduler.cluster.dispatch.refusal`), and replay from a lookup (`scheduler.search.phases.replay`)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from scheduler.cluster.dispatch import refusal
from scheduler.cluster.jobs import JobSpec, TuneSpec, job_id_for
from scheduler.search.phases import Phase, replay
from scheduler.search.space import Experiment
from workers.device.slot import Slot

GiB = 2**30


def slot(node: str, device: int, memory: int) -> Slot:
    return Slot(node=node, device=device, kind="cpu", memory_bytes=memory, address="10.0.0.1",
                threads=1, cpus=(), worker=f"w{device}@{node}")


def exp(name: str, nodes: int = 1, gpus: int = 1, min_memory: int = 0) -> dict:
    return Experiment(name, 0, 1, 1, {"train_micro_batch_size_per_gpu": 1}, nodes, gpus,
                      min_memory=min_memory).to_json()


def test_spec_round_trips_through_json() -> None:
    tune = TuneSpec(config_path="cfg.json", ds_config={"zero_optimization": {"stage": "all"}},
                    exps_dir="/r/exps", script="/s/train.py", base_args=["--steps", "5"],
                    mappings={"train_micro_batch_size_per_gpu": "--bs"}, capacity_bytes=GiB, num_nodes=1,
                    num_gpus=2, device_kind="cpu", concurrency=1)
    spec = JobSpec(job="j", results_root="/r", cwd="/w", timeout_s=60.0, tune=tune, min_memory=GiB,
                   pinned=[["n.gpu0"]], submitted_at=12.5)
    again = JobSpec.from_json(spec.to_json())
    assert again == spec and again.tune == tune and again.submitted_at == 12.5
    fixed = JobSpec(job="k", results_root="/r", cwd="/w", timeout_s=1.0, experiments=[{**exp("a"), "argv": ["x"]}])
    assert JobSpec.from_json(fixed.to_json()) == fixed


def test_submission_time_does_not_make_a_job_different() -> None:
    first = JobSpec(job="j", results_root="/r", cwd="/w", timeout_s=1.0, submitted_at=1.0)
    assert first == JobSpec(job="j", results_root="/r", cwd="/w", timeout_s=1.0, submitted_at=2.0)
    assert first != JobSpec(job="j", results_root="/r", cwd="/w", timeout_s=2.0, submitted_at=1.0)


def test_job_id_is_one_per_results_folder(tmp_path: Path) -> None:
    assert job_id_for(tmp_path / "a") == job_id_for(tmp_path / "x" / ".." / "a")
    assert job_id_for(tmp_path / "a") != job_id_for(tmp_path / "b")


def test_refusal_names_the_largest_shape_that_fits() -> None:
    slots = [slot("a", 0, GiB), slot("a", 1, GiB), slot("b", 0, 2 * GiB)]
    assert refusal(exp("e", gpus=3), slots).endswith("use --num_nodes 1 --num_gpus 2 or fewer")
    assert "at most 1 slot(s) each of 1.5 GiB" in refusal(exp("e", gpus=2, min_memory=int(1.5 * GiB)), slots)
    too_big = refusal(exp("e", min_memory=3 * GiB), slots)
    assert "needs slots with 3.0 GiB but the largest slot has 2.0 GiB" in too_big
    assert refusal(exp("e"), []).startswith("no live slot workers")


def test_refusal_names_the_kind_and_loopback_problems() -> None:
    cpu = [slot("a", 0, GiB), slot("b", 0, GiB)]
    assert "sized for CUDA slots but the cluster has only CPU slots" in refusal(exp("e"), cpu, "cuda")
    local = [replace(s, address="127.0.0.1") if s.node == "b" else s for s in cpu]
    assert "node(s) b advertise a loopback address" in refusal(exp("e", nodes=2), local, "cpu")
    assert "AUTOTUNE_ADDRESS" in refusal(exp("e", nodes=2), local)


def test_replay_stops_where_the_lookup_has_no_record() -> None:
    one, two = (Experiment(n, 0, 1, 1, {}) for n in ("one", "two"))

    def search():
        first = yield Phase("p1", (one,))
        assert first == {"one": {"status": "ok"}}
        yield Phase("p2", (two,))

    answered, current = replay(search(), lambda e: {"status": "ok"} if e.name == "one" else None)
    assert [p.name for p in answered] == ["p1"] and current is not None and current.name == "p2"
    answered, current = replay(search(), lambda e: {"status": "ok"})
    assert [p.name for p in answered] == ["p1", "p2"] and current is None
