#!/usr/bin/env bash
# The README example on real GPUs: the CUDA path end to end, to run wherever a machine with NVIDIA
# GPUs is available (no GPU is lent to CI). Usage, from the repository root:
#
#     bash bench/gpu_smoke.sh            # examples/cfg.json: the GPT example, ZeRO 0-3
#
# It sets up the venv (deploy/setup.sh; pip's torch is the CUDA build there), tunes the example on an
# embedded cluster of one slot per GPU, 4 ranks per experiment on a node of 4-8 GPUs (two gangs side
# by side on 8), 2 on 2-3 GPUs, 1 on one (GPU_SMOKE_RANKS overrides), then checks what CPU tests cannot:
#   1. every slot is a CUDA slot and every experiment ran on as many distinct GPUs as it has ranks
#      (ranks' cuda_index);
#   2. no experiment crashed: a rank whose LOCAL_RANK named a device it could not see would crash
#      in DeepSpeed's init_distributed / set_device ("invalid device ordinal");
#   3. every successful experiment carries peak_device_bytes measured inside its ranks; the allocated
#      peak grows with the micro-batch among configs of one stage and one gas (across gas levels it
#      need not: on one H100 a ZeRO-1 run of mbs 2 x gas 24 peaked above mbs 8 x gas 6, DeepSpeed's
#      ~2 GB of fixed buffers dwarfing a small model's activations);
#   4. OOMs, if any, are classed `oom` (never `crashed`) and are the larger sizes of their stage;
#   5. every rank checked its GPU for others' memory before it started (device_wait_s; printed with the
#      most others held, device_foreign_bytes: workers/device/device_idle.py, and the ranks whose GPU was not
#      free a wait after they ended, device_foreign_after_bytes: workers/state/slot_health.py), and every successful
#      experiment has the engine's build peak apart from training's (peak_device_init_bytes); with 2
#      GPUs or more, each record names its gang's slowest GPU link (gpu_link, nvidia-smi topo -m);
#   6. cmd_optimal.txt names the winner's GPUs (--include localhost:a,b) and, run as written by
#      DeepSpeed's own launcher, trains to the end with exit status 0;
#   7. what a real node's configs add (GPU_SMOKE_SKIP_EXTRAS=1 skips it), three short jobs of the same
#      script: FusedAdam (no torch_adam: DeepSpeed JIT-builds it), ZeRO-2 with the optimizer offloaded
#      to the CPU (CPUAdam), and a micro-batch far beyond any GPU's memory. Each either runs, or stops
#      with the one-line op refusal (exit 2, workers/in_rank/op_build.py) when an op cannot be built there;
#      none hangs, no probe is `crashed` but the one a refusal names, and the huge size is `oom`;
#      and no experiment compiled an op inside itself (no "Emitting ninja build file" in a rank's
#      stderr): the slot worker built the ops the config needs before the script
#      (workers/slot/op_prebuild.py; its log is op_prebuild.log).
#      On one H200 (bench/README.md): FusedAdam refused in one line; the other two not yet run.
#   8. `warm_kill` (an extra too): bench/strike_warm.py tunes a short list job (micro-batch [2, 8],
#      ZeRO-1) and SIGKILLs, once, the warm process a running rank was forked from; the launch must
#      be recorded lost and run again (its own files, its stderr saying so), the experiment `ok` or
#      `oom`, never `crashed`, and the job exit 0. It runs on CPU too (bench/README.md).
# GPU_SMOKE_EXTRAS names which of the four extras to run (default all: fused_adam cpu_offload
# forced_oom warm_kill).
# GPU_SMOKE_CONFIG and GPU_SMOKE_ARGS override the config and the autotuner's extra flags;
# GPU_SMOKE_SKIP_FINAL=1 skips step 6 (for a dry run of the checks with tests/fake_gpu on PATH and
# FAKE_NVIDIA_SMI_USED_FILE naming a "index, MiB" listing of used memory);
# GPU_SMOKE_SKIP_SETUP=1 uses the .venv already there (a machine that cannot reach PyPI or apt:
# bench/gpu_offline.sh makes one there).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
config=$(realpath "${GPU_SMOKE_CONFIG:-examples/cfg.json}")

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_smoke: no nvidia-smi on this machine; run it where GPUs are" >&2
    exit 2
fi
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | grep -c . || true)
if [ "$gpus" -lt 1 ]; then
    echo "gpu_smoke: nvidia-smi lists no GPU" >&2
    exit 2
fi
ranks=${GPU_SMOKE_RANKS:-$(( gpus >= 4 ? 4 : gpus >= 2 ? 2 : 1 ))}
if ! [[ "$ranks" =~ ^[1-9][0-9]*$ ]] || [ "$ranks" -gt "$gpus" ]; then
    echo "gpu_smoke: GPU_SMOKE_RANKS=$ranks: give a whole number from 1 to $gpus (the GPUs listed)" >&2
    exit 2
fi
[ "${GPU_SMOKE_SKIP_SETUP:-0}" = 1 ] || bash deploy/setup.sh
export PATH="$root/.venv/bin:$PATH"  # its redis-server too, where bench/gpu_offline.sh put one there
work=$(mktemp -d /tmp/gpu_smoke.XXXXXX)
echo "gpu_smoke: tuning $config on $gpus GPUs, $ranks ranks per experiment, in $work"
cd "$work"
# shellcheck disable=SC2086
"$root/.venv/bin/python" -m scheduler.autotune "$config" --num_gpus "$ranks" ${GPU_SMOKE_ARGS:-} | tee tune.log

"$root/.venv/bin/python" - "$work/autotuning_results" "$ranks" <<'EOF'
import json, shlex, sys
from collections import defaultdict
from pathlib import Path

results = Path(sys.argv[1])
world = int(sys.argv[2])
problems = []
records = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()]
by_stage = defaultdict(list)
waits, foreign, after, links = [], [], [], set()
for line in records:
    record = json.loads((results / line["name"] / "result.json").read_text())
    ranks = record.get("ranks", [])
    gpus = [r.get("cuda_index") for r in ranks]
    if len(ranks) != world or None in gpus or len(set(gpus)) != world:
        problems.append(f"{record['name']}: ranks ran on GPUs {gpus}, not {world} distinct CUDA slots")
    if record["status"] == "crashed":
        problems.append(f"{record['name']}: crashed ({record.get('cause')})")
    if world > 1 and not record.get("gpu_link"):
        problems.append(f"{record['name']}: no gpu_link ({world} GPUs: `nvidia-smi topo -m` was not read)")
    links.add(record.get("gpu_link") or "-")
    for rank in ranks:
        if "device_wait_s" not in rank:
            problems.append(f"{record['name']} rank {rank.get('rank')}: no device_wait_s (nvidia-smi's memory.used "
                            "unreadable: the GPU-free check before launch did not run)")
        waits.append(rank.get("device_wait_s") or 0.0)
        foreign.append(rank.get("device_foreign_bytes") or 0)
        after.append(rank.get("device_foreign_after_bytes") or 0)
    if record["status"] == "ok":
        if not record.get("peak_device_bytes"):
            problems.append(f"{record['name']}: no peak_device_bytes in an ok record")
        if "peak_device_init_bytes" not in record:
            problems.append(f"{record['name']}: no peak_device_init_bytes (the engine's build was not seen)")
    mbs = record["ds_config"]["train_micro_batch_size_per_gpu"]
    gas = record["ds_config"].get("gradient_accumulation_steps", 1)
    stage = record["ds_config"]["zero_optimization"]["stage"]
    by_stage[stage].append((mbs, gas, record["status"], record.get("peak_device_bytes") or 0,
                            record.get("peak_device_allocated_bytes") or 0))
for stage, runs in sorted(by_stage.items()):
    runs.sort()
    for gas in sorted({g for _, g, _, _, _ in runs}):
        allocated = [a for _, g, status, _, a in runs if status == "ok" and g == gas]
        if allocated != sorted(allocated):
            problems.append(f"stage {stage} gas {gas}: allocated peaks do not grow with the micro-batch: {runs}")
    ok_sizes = [m for m, _, status, _, _ in runs if status == "ok"]
    oom_sizes = [m for m, _, status, _, _ in runs if status == "oom"]
    if ok_sizes and oom_sizes and min(oom_sizes) <= max(ok_sizes):
        problems.append(f"stage {stage}: an OOM at a size below one that fit: {runs}")
    print(f"stage {stage}: " + ", ".join(f"mbs {m} gas {g} {s} reserved {p / 2**30:.2f} allocated {a / 2**30:.2f} GiB"
                                         for m, g, s, p, a in runs))
print(f"GPU links of the gangs (nvidia-smi topo -m): {', '.join(sorted(links))}")
print(f"GPU-free check: waited at most {max(waits, default=0):.1f} s before a rank; others held at most "
      f"{max(foreign, default=0) / 2**30:.2f} GiB at a rank's start; {sum(1 for a in after if a)} rank(s) left their "
      f"GPU used (at most {max(after, default=0) / 2**30:.2f} GiB) a wait after they ended: slot out of tuning")
command = shlex.split((results / "cmd_optimal.txt").read_text())
while command and "=" in command[0] and not command[0].startswith("-"):
    command.pop(0)  # OMP_NUM_THREADS=... and the like, set for the launch
if command[:2] != ["deepspeed", "--include"] or not command[2].startswith("localhost:"):
    problems.append(f"cmd_optimal.txt does not name the winner's GPUs: {command[:4]}")
if problems:
    print("gpu_smoke: FAILED\n  " + "\n  ".join(problems))
    sys.exit(1)
print(f"gpu_smoke: {len(records)} experiments checked; cmd_optimal: {' '.join(command[:3])}")
EOF

# a preload the warm process dropped (its ranks then import torch and DeepSpeed themselves: seconds each)
grep -h "initialised CUDA" autotuning_results/cluster/*.log 2>/dev/null | head -3 || true

if [ "${GPU_SMOKE_SKIP_FINAL:-0}" != 1 ]; then
    echo "gpu_smoke: running cmd_optimal.txt with DeepSpeed's launcher"
    bash -c "$(cat autotuning_results/cmd_optimal.txt)" > final.log 2>&1 \
        || { tail -40 final.log; echo "gpu_smoke: FAILED: cmd_optimal.txt did not train"; exit 1; }
    grep "final loss" final.log || { echo "gpu_smoke: FAILED: no final loss in final.log"; exit 1; }
fi
if [ "${GPU_SMOKE_SKIP_EXTRAS:-0}" != 1 ]; then
    for extra in ${GPU_SMOKE_EXTRAS:-fused_adam cpu_offload forced_oom warm_kill}; do
        mkdir -p "$work/$extra" && cd "$work/$extra"
        "$root/.venv/bin/python" - "$config" "$extra" "$root/examples/train_gpt.py" > cfg.json <<'EOF'
import json, sys
config, extra, script = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
config["autotuning"]["user_script"] = script
if extra == "fused_adam":
    config["optimizer"]["params"].pop("torch_adam", None)
    config.update(train_micro_batch_size_per_gpu=[2, 8], zero_optimization={"stage": [1]})
elif extra == "cpu_offload":
    config["optimizer"]["params"].pop("torch_adam", None)
    config.update(train_micro_batch_size_per_gpu=[2, 8],
                  zero_optimization={"stage": [2], "offload_optimizer": {"device": "cpu"}})
elif extra == "forced_oom":
    config.update(train_micro_batch_size_per_gpu=[65536], zero_optimization={"stage": [0]})
# warm_kill: as it is; bench/strike_warm.py narrows it to micro-batch [2, 8], ZeRO-1
print(json.dumps(config))
EOF
        set +e
        if [ "$extra" = warm_kill ]; then  # it runs the autotuner itself (tune.log, tune.err) and strikes
            timeout 1800 "$root/.venv/bin/python" "$root/bench/strike_warm.py" cfg.json --num_gpus "$ranks" \
                --work . --timeout 1780
        else
            timeout 1800 "$root/.venv/bin/python" -m scheduler.autotune cfg.json --num_gpus "$ranks" > tune.log 2> tune.err
        fi
        code=$?
        set -e
        "$root/.venv/bin/python" - "$extra" "$code" <<'EOF'
import json, sys
from pathlib import Path
extra, code = sys.argv[1], int(sys.argv[2])
errors = Path("tune.err").read_text()
records = [json.loads(p.read_text()) for p in Path("autotuning_results").glob("*/result.json")]
statuses = {r["name"]: r["status"] for r in records}
problems = []
if code == 124:
    problems.append("still running after 30 minutes (a build lock or a teardown hanging?)")
elif code == 2 and "could not build or load an op DeepSpeed needs" in errors:
    print(f"gpu_smoke {extra}: an op cannot be built here, refused in one line: {errors.strip().splitlines()[-1][:300]}")
elif code != 0 and not (extra == "forced_oom" and code == 1):  # its one config oom: no winner, exit 1
    problems.append(f"exit {code}: {errors.strip()[-500:]}")
refused = code == 2 and "could not build or load an op DeepSpeed needs" in errors
# the probe that found the op unbuildable is recorded `crashed` and named in the refusal: that is the design
problems += [f"{r['name']} crashed: {r.get('cause')}" for r in records
             if r["status"] == "crashed" and not (refused and f"error: {r['name']} could not build" in errors)]
built_inside = sorted(str(log.parent.name) for log in Path("autotuning_results").glob("*/*stderr.log")
                      if "Emitting ninja build file" in log.read_text(errors="replace"))
if built_inside:
    problems.append(f"an op was compiled inside the experiment (not pre-built by the slot worker): {built_inside}")
prebuilt = sorted(str(log.parent.name) for log in Path("autotuning_results").glob("*/*op_prebuild.log"))
print(f"gpu_smoke {extra}: op pre-build logs in {prebuilt or 'no experiment (nothing to build, or built before)'}")
if extra == "forced_oom" and code in (0, 1) and statuses.get("z0_gas1_tmbspg65536") != "oom":
    problems.append(f"micro-batch 65536 is not `oom`: {statuses}")
print(f"gpu_smoke {extra}: exit {code}, " + ", ".join(f"{n} {s}" for n, s in sorted(statuses.items())))
if problems:
    print(f"gpu_smoke {extra}: FAILED\n  " + "\n  ".join(problems))
    sys.exit(1)
EOF
    done
    cd "$work"
fi
echo "gpu_smoke: passed (results in $work)"
