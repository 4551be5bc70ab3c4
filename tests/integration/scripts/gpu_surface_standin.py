"""A GPU training script without a GPU: its device memory and speed follow a bench surface.

Why: the search's quality on GPU-like scripts is measured in bench/search_quality.py by replay; this
stand-in lets the same kind of script run through the real cluster (slot workers, CUDA slots of a
fake nvidia-smi, device-memory records), so the figures can be checked end to end.

`--surface` is a JSON object of `bench.surfaces.Surface` fields. From the ds_config it is given
(ZeRO stage, micro-batch, gradient accumulation) the script computes its device peak (reported with
`workers.in_rank.device_memory.report_peak`) and its throughput, with the surface's noise drawn from a name
made of that config, so a replayed or repeated config measures the same. When the peak does not fit
the device it fails as a real script does: `--oom torch` raises a real `torch.OutOfMemoryError`,
`--oom traceback` prints a CUDA OOM traceback and exits 1. The model-info profile run writes
model_info.json (num_params and the forward-only activation figure) like DeepSpeed's; rank 0 of a
measured run writes the metrics file at ds_config["autotuning"]["metric_path"].
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/ is not installed; the repository is

from bench.surfaces import Surface  # noqa: E402
from workers.in_rank.device_memory import report_peak  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--local_rank", type=int)
parser.add_argument("--surface", required=True, help="JSON object of bench.surfaces.Surface fields")
parser.add_argument("--oom", choices=("torch", "traceback"), default="torch")
args = parser.parse_args()

fields = json.loads(args.surface)
surface = Surface(**{key: tuple(value) if isinstance(value, list) else value for key, value in fields.items()})
config = json.loads(Path(args.deepspeed_config).read_text())
autotuning = config.get("autotuning", {})
rank = int(os.environ["RANK"])
profile = bool(autotuning.get("model_info", {}).get("profile"))
record = surface.run(f"z{(config.get('zero_optimization') or {}).get('stage', 0)}"
                     f"_mbs{config['train_micro_batch_size_per_gpu']}"
                     f"_gas{config.get('gradient_accumulation_steps', 1)}", config, profile=profile)

if record["status"] != "ok":
    message = f"CUDA out of memory. Tried to allocate 2.00 GiB (GPU {os.environ.get('LOCAL_RANK', 0)}; " \
              f"{surface.capacity / 2**30:.2f} GiB total capacity)"
    if args.oom == "torch":
        import torch

        raise torch.OutOfMemoryError(message)
    print("Traceback (most recent call last):\n  File \"train.py\", line 1, in <module>\n"
          f"torch.OutOfMemoryError: {message}", file=sys.stderr)
    sys.exit(1)

if "peak_device_bytes" in record:
    report_peak(record["peak_device_bytes"])
if rank == 0 and profile:
    Path(autotuning["model_info_path"]).write_text(json.dumps(record["metrics"]))
elif rank == 0 and autotuning.get("enabled"):
    Path(autotuning["metric_path"]).write_text(json.dumps(record["metrics"]))
