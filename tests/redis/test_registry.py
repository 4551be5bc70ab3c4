"""One GPU of one machine is served by one slot only, decided in Redis: a second
worker under another node name, or with an overlapping inherited CUDA_VISIBLE_DEVICES, is refused,
even when both start at the same moment; the claim lives and ends with the slot's registration."""
from __future__ import annotations

import threading
from dataclasses import replace

import redis

from workers.state import keys, registry
from workers.state.registry import claim_gpu, register_slot
from workers.device.slot import Slot

GiB = 2**30
CUDA_SLOT = Slot("gpu-host", 1, "cuda", 80 * GiB, "10.0.0.9", 8, (), "w1@gpu-host", cuda_index=3,
                 host="m1", gpu_uuid="GPU-3333")
CPU_SLOT = Slot("n1", 2, "cpu", 3 * GiB, "10.0.0.5", 4, (4, 5, 6, 7), "w2@n1")
TWIN = replace(CUDA_SLOT, node="alias", worker="w9@alias", cuda_index=0)  # same machine, same UUID


def test_a_second_slot_for_the_same_gpu_is_told_who_serves_it(client: redis.Redis) -> None:
    assert claim_gpu(client, CUDA_SLOT) is None
    assert claim_gpu(client, TWIN) == {"queue": "gpu-host.gpu1", "worker": "w1@gpu-host"}
    assert claim_gpu(client, CUDA_SLOT) is None  # its own restarted worker takes over
    assert claim_gpu(client, replace(TWIN, host="m2")) is None  # another machine's GPU
    assert claim_gpu(client, replace(TWIN, gpu_uuid="GPU-4444")) is None  # another GPU
    assert claim_gpu(client, CPU_SLOT) is None and claim_gpu(client, replace(CPU_SLOT, node="alias")) is None


def test_workers_starting_at_once_cannot_both_claim_a_gpu(client: redis.Redis, redis_socket: str) -> None:
    """Eight workers of eight node names for one GPU, released together, fifty times: one wins each."""
    for round_ in range(50):
        client.delete(keys.gpu_claim("m1", "GPU-3333"))
        start = threading.Barrier(8)
        refused: list[dict | None] = []

        def start_worker(node: str) -> None:
            own = redis.Redis(unix_socket_path=redis_socket)
            start.wait()
            refused.append(claim_gpu(own, replace(CUDA_SLOT, node=node)))
            own.close()

        threads = [threading.Thread(target=start_worker, args=(f"n{i}",)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert refused.count(None) == 1, (round_, refused)


def test_the_claim_lives_and_ends_with_the_registration(client: redis.Redis, monkeypatch) -> None:
    monkeypatch.setattr(registry, "TTL_S", 0.5)
    monkeypatch.setattr(registry, "HEARTBEAT_S", 0.1)
    assert claim_gpu(client, CUDA_SLOT) is None
    beat = register_slot(client, CUDA_SLOT)
    try:
        threading.Event().wait(1.2)  # past two TTLs: renewed with the slot's key
        assert claim_gpu(client, TWIN) is not None
    finally:
        beat.stop()
    assert client.exists(keys.slot(CUDA_SLOT.queue), keys.gpu_claim("m1", "GPU-3333")) == 0
    assert claim_gpu(client, TWIN) is None  # a clean stop frees the GPU at once
    client.delete(keys.gpu_claim("m1", "GPU-3333"))
    assert claim_gpu(client, CUDA_SLOT) is None
    threading.Event().wait(0.7)  # a worker killed without a clean stop: its claim expires with its TTL
    assert claim_gpu(client, TWIN) is None
