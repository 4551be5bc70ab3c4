"""A stand-in training script for integration tests: its behaviour is chosen per micro-batch size.

`--behaviour 1=ok,2=oom,3=crash` makes the experiment with micro-batch size 2 allocate memory
until the slot's cap stops it, the one with 3 exit with status 3, and so on. Modes:
ok (metrics written; with WORLD_SIZE > 1 a real gloo all-reduce first; with --law, memory and
throughput follow a synthetic law so the fast search has something to find), oom (grows RSS),
memory_error (raises MemoryError), crash (exit 3), no_metrics (exit 0, no file), hang (sleeps),
slow<N> (sleeps N seconds, then ok). `--hold DIR --hold-after K`: every experiment after the K-th
to start (counted in DIR) waits until DIR/release exists, so a test interrupts while one is running.
Every rank writes `<result_dir>/started.rank<N>` with its pid as soon as it starts (not with
--quiet-folder: then, as a real training script, it writes nothing there but the metrics). In DeepSpeed's
model-info profile mode it writes model_info.json for a tiny model and exits. Without an enabled
autotuning section (a real training run) it writes trained.rank<N> instead of metrics.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--behaviour", default="")
parser.add_argument("--law", action="store_true",
                    help="memory grows 24 MiB per sample; throughput peaks at micro-batch 16, best at ZeRO-1")
parser.add_argument("--per_device_train_batch_size", type=int)
parser.add_argument("--gradient_accumulation_steps", type=int)
parser.add_argument("--local_rank", type=int, help="given by DeepSpeed's launcher and by tuned runs")
parser.add_argument("--take-port-once", metavar="FILE",
                    help="while FILE does not exist, rank 0 creates it and holds MASTER_PORT before the process "
                         "group binds it: another process took the port rank 0 was given (EADDRINUSE)")
parser.add_argument("--hold", metavar="DIR", help="experiments after --hold-after wait for DIR/release")
parser.add_argument("--hold-after", type=int, default=0)
parser.add_argument("--quiet-folder", action="store_true",
                    help="write no started.rank<N> (a file of the script's own) into the experiment folder")
args = parser.parse_args()

config_path = Path(args.deepspeed_config)
config = json.loads(config_path.read_text())
autotuning = config.get("autotuning", {})
if autotuning.get("model_info", {}).get("profile"):  # DeepSpeed's model-info profile run
    if int(os.environ["RANK"]) == 0:
        Path(autotuning["model_info_path"]).write_text(json.dumps(
            {"num_params": 1000, "trainable_num_params": 1000, "activation_mem_per_gpu": 24 * 2**20, "rank": 0}))
    sys.exit(0)
mbs = config["train_micro_batch_size_per_gpu"]
modes = dict(item.split("=") for item in args.behaviour.split(",") if item)
mode = modes.get(str(mbs), "ok")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if not args.quiet_folder:
    (config_path.parent / f"started.rank{rank}").write_text(str(os.getpid()))

if args.hold and autotuning.get("enabled") and rank == 0:
    hold = Path(args.hold)
    hold.mkdir(parents=True, exist_ok=True)
    (hold / f"start.{os.getpid()}").touch()
    if len(list(hold.glob("start.*"))) > args.hold_after:
        (hold / f"holding.{os.getpid()}").touch()
        while not (hold / "release").exists():
            time.sleep(0.1)

if args.law and autotuning.get("enabled"):
    ballast = b"\x01" * (24 * 2**20 * mbs)  # activations: the slot's memory cap decides what fits
    time.sleep(0.3)
if mode == "oom":
    hog = []
    while True:
        hog.append(b"\x01" * (128 * 2**20))
        time.sleep(0.02)
if mode == "memory_error":
    raise MemoryError("simulated allocation failure")
if mode == "crash":
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)
if mode.startswith("slow"):  # slow<seconds>: a run long enough to be interrupted, then ok
    time.sleep(float(mode[4:] or 4))
    mode = "ok"

if world > 1:
    import socket

    import torch
    import torch.distributed as dist

    if args.take_port_once and rank == 0 and not Path(args.take_port_once).exists():
        Path(args.take_port_once).write_text(os.environ["MASTER_PORT"])
        taken = socket.socket()
        taken.bind((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        taken.listen()
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2, total
    dist.destroy_process_group()
if not autotuning.get("enabled"):  # a real training run: no metrics, just proof that it trained
    (config_path.parent / f"trained.rank{rank}").write_text(json.dumps(config))
elif mode == "ok" and rank == 0:
    stage = config["zero_optimization"]["stage"]
    throughput = mbs * 100.0 / (1 + stage)
    if args.law:
        throughput = 1000.0 * mbs / (mbs + 4) * (1.0 - abs(mbs - 16) / 64) * (1.2 if stage == 1 else 1.0)
        throughput *= 1.1 if config["zero_optimization"].get("overlap_comm") else 1.0
    metrics = {"throughput": throughput, "latency": 1000.0 / mbs,
               "FLOPS_per_gpu": 1e9, "rank": 0, "world_size": world,
               "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
               "argv": sys.argv[1:]}
    Path(autotuning["metric_path"]).write_text(json.dumps(metrics))
