"""A stand-in for a CUDA training script, for machines without a GPU: it checks what a real CUDA rank
needs from its environment, records it, and fails the way a real rank would when it is wrong.

A real rank calls `torch.cuda.set_device(LOCAL_RANK)` (DeepSpeed's init_distributed and engine do),
which fails with "invalid device ordinal" unless LOCAL_RANK indexes one of the devices in
CUDA_VISIBLE_DEVICES. This probe checks that the device it would pick is its own reserved GPU (the
slot's nvidia-smi index, named as the final deepspeed command names it), that DeepSpeed could read
CUDA_VISIBLE_DEVICES (it int()s every entry), that the numbering is the PCI bus order nvidia-smi
uses, that `--local_rank` (when given) agrees with LOCAL_RANK, and that the cluster's Redis
credentials did not leak into it.
It writes `<result_dir>/probe.rank<N>.json`, reports a device peak through
`workers.in_rank.device_memory.report_peak` and, on rank 0, the metrics file. A failed check exits 1.
`--leave-used RANK,MBS,MIB`: that rank, at that micro-batch, leaves MIB in use on its GPU when it
exits (appended to the fake nvidia-smi's $FAKE_NVIDIA_SMI_USED_FILE), as a child process it did not
take with it would.
"""
import argparse
import json
import os
import sys
from pathlib import Path

from workers.in_rank.device_memory import report_peak

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--local_rank", type=int)
parser.add_argument("--expect-cuda-index", default="", help="comma-separated reserved GPU index of each rank")
parser.add_argument("--leave-used", default="", help="RANK,MBS,MIB: left in use on that rank's GPU at exit")
args = parser.parse_args()

config_path = Path(args.deepspeed_config)
config = json.loads(config_path.read_text())
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
facts = {"rank": rank, "local_rank": local_rank, "local_rank_arg": args.local_rank,
         "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda_indices": ",".join(visible),
         "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
         "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["LOCAL_SIZE"]), "slot": os.environ.get("AUTOTUNE_SLOT"),
         "nccl_socket_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
         "redis_url_leaked": "AUTOTUNE_REDIS_URL" in os.environ}
(config_path.parent / f"probe.rank{rank}.json").write_text(json.dumps(facts))

problems = []
try:  # as DeepSpeed reads it (`CUDA_Accelerator._get_nvml_gpu_id`, ZeRO-1/2 with pynvml installed)
    list(map(int, visible))
except ValueError:
    problems.append(f"CUDA_VISIBLE_DEVICES={','.join(visible)}: DeepSpeed reads it as integers and would crash")
if not 0 <= local_rank < len(visible):
    problems.append(f"invalid device ordinal: LOCAL_RANK {local_rank} but CUDA_VISIBLE_DEVICES={visible}")
elif args.expect_cuda_index and visible[local_rank] != args.expect_cuda_index.split(",")[rank]:
    problems.append(f"rank {rank} would use GPU {visible[local_rank]}, reserved {args.expect_cuda_index}")
if len(visible) != facts["local_world_size"]:
    problems.append(f"sees {len(visible)} GPUs for {facts['local_world_size']} local ranks")
if facts["cuda_device_order"] != "PCI_BUS_ID":
    problems.append("CUDA numbers devices differently from nvidia-smi (CUDA_DEVICE_ORDER not PCI_BUS_ID)")
if args.local_rank is not None and args.local_rank != local_rank:
    problems.append(f"--local_rank={args.local_rank} but LOCAL_RANK={local_rank}")
if facts["redis_url_leaked"]:
    problems.append("the cluster's Redis URL (with its password) reached the training process")
if problems:
    sys.exit("cuda_rank_probe: " + "; ".join(problems))

mbs = config["train_micro_batch_size_per_gpu"]
report_peak((2 + mbs) * 2**30)  # what this model would hold on its GPU
autotuning = config.get("autotuning", {})
if rank == 0 and autotuning.get("enabled"):
    Path(autotuning["metric_path"]).write_text(json.dumps({"throughput": 10.0 * mbs, "latency": 1.0,
                                                           "FLOPS_per_gpu": 1e9}))
if args.leave_used:
    leave_rank, leave_mbs, leave_mib = map(int, args.leave_used.split(","))
    if (leave_rank, leave_mbs) == (rank, mbs):
        with open(os.environ["FAKE_NVIDIA_SMI_USED_FILE"], "a") as used:
            used.write(f"{visible[local_rank]}, {leave_mib}\n")
