"""What a tuning job leaves behind, in DeepSpeed's layout and more.

    <exps_dir>/<name>.json          each experiment's description (DeepSpeed's format)
    <results_dir>/<name>/...        each experiment's folder (written by the slots and the callback)
    <results_dir>/summary.txt       DeepSpeed's table, plus wall time and failures per class and
                                    the experiments' start-up share (scheduler.report.startup)
    <results_dir>/results.jsonl     one line per experiment: name, config, status, metrics, timings
    <results_dir>/results.csv       the same, one row per experiment, for a spreadsheet
    <results_dir>/ds_config_optimal.json   the winner's config without the autotuning section
    <results_dir>/cmd_optimal.txt   a shell-quoted command that trains with ds_config_optimal.json,
                                    with the CPU threads per rank the winner was measured with
    <results_dir>/hostfile_optimal  the nodes the winner ran on, when it used more than one or the tuning had a
                                    resource pool (--hostfile/--include/--exclude); cmd_optimal.txt names it
    <results_dir>/tuning.png        every experiment: micro-batch size against the metric (scheduler.report.plot)
    <results_dir>/timeline.png      every experiment on its slots over time, coloured by outcome,
                                    its start-up (launch to engine ready) hatched
    <results_dir>/model_fit.png     each config's reading against what the cost model fitted to its
                                    stage's other configs predicts (scheduler.report.model_fit; the
                                    same rows close summary.txt)

An interrupted search is not a search that found an optimum: its experiments that were running or
queued get `cancelled` lines in results.jsonl/results.csv, summary.txt says "interrupted", and the
best measured config is written as ds_config_best_partial.json / cmd_best_partial.txt, never under
the "optimal" names. It draws no plots (and removes an earlier run's): matplotlib's import and
drawing took most of a Ctrl-C's 10-20 s on a busy machine; the run that finishes the search draws them.

Every name above is taken from `workers.files.layout` (`result_file` refuses one it does not list), the
list `"overwrite": true` checks a folder against: a file written here that it did not know would
make overwrite refuse the folder this module just filled.
"""
from __future__ import annotations

import datetime
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tabulate import tabulate

from scheduler.search.confirm import (
    ALONE, MIN_NOISE, PRIOR_NOISE, READ_ONCE, SEPARATED, SEPARATION_Z, Readings, Verdict, step_noise, verdict,
)
from scheduler.search.global_batch import KEPT_NOTE
from scheduler.search.ceilings import FLOOR as CEILING_FLOOR
from scheduler.search.ranking import (
    best, config_key, curve_ceilings, metric_value, pooled_best, pooled_value, pooled_word, status_counts,
    status_word,
)
from scheduler.report.model_fit import fit_text, write_fit_plot
from scheduler.report.rows import (  # OFF_PATH, RECORD_KEYS, cancelled_record: named here for the report's callers
    OFF_PATH, RECORD_KEYS, CancelledRecord, Row, cancelled_record, results_csv, results_jsonl, row_of,
)
from scheduler.report.startup import startup_text
from scheduler.search.fit_check import fit_checks
from scheduler.search.space import PROFILE, Experiment, optimal_config
from workers.in_rank.failure import Status
from workers.files.layout import (MODEL_PLOT, OPTIMAL_FILES, PARTIAL_FILES, RESULTS_CSV, RESULTS_JSONL, SUMMARY,
                            TIMELINE_PLOT, TUNING_PLOT, result_file)
from workers.files.paths import safe_child, write_atomic, write_json
from workers.slot.records import ExperimentRecord

#: The classes an experiment's record can have (`gpu_busy` is a rank's "not started": never recorded).
FAILURE_CLASSES = [s.value for s in Status if s not in (Status.OK, Status.GPU_BUSY)]


def write_experiment_descriptions(exps_dir: Path, experiments: list[Experiment]) -> None:
    for exp in experiments:
        write_json(safe_child(exps_dir, f"{exp.name}.json"), {
            "name": exp.name, "ds_config": exp.ds_config,
            "num_gpus": exp.num_gpus, "num_nodes": exp.num_nodes,
        })


def summary_text(experiments: list[Experiment], records: Mapping[str, dict[str, Any]], metric: str,
                 maximize: bool, elapsed_s: float, cancelled: list[str] | None = None,
                 notes: Sequence[str] = ()) -> str:
    """DeepSpeed's summary table (one row per ZeRO stage, then global) and our extra columns. The best
    value is the pooled value the winner was picked on (a re-measured config: "(mean of 2)" or "(median
    of 3)" after its name: `scheduler.search.ranking.pooled_value`).
    With `cancelled` (an interrupted search) the closing line says so and names what was cut off.
    `notes` (`scheduler.search.fast_search.search_notes`: the global batch kept or not, how the
    winner is named) follow the table."""
    spaces: dict[str, list[ExperimentRecord]] = {}
    for exp in experiments:
        if exp.name in records and exp.space != PROFILE:
            spaces.setdefault(exp.space, []).append(ExperimentRecord.from_json(records[exp.name]))
    tuned = [r for space_records in spaces.values() for r in space_records]
    rows = []
    for space, space_records in [*spaces.items(), ("global", tuned)]:
        winner, pooled, measured = pooled_best(space_records, metric, maximize)
        counts = status_counts(space_records)
        rows.append([space, len(space_records), pooled,
                     f"{winner.name} ({pooled_word(measured)} of {measured})" if winner and measured > 1
                     else winner.name if winner else None,
                     round(sum(r.wall_s or 0.0 for r in space_records), 1),
                     ", ".join(f"{k}={counts[k]}" for k in FAILURE_CLASSES if counts[k]) or "-"])
    table = tabulate(rows, headers=["tuning_space", "num_experiments", "best_metric_val",
                                    "best_exp_name", "experiment_s", "failures"], tablefmt="pipe")
    elapsed = datetime.timedelta(seconds=round(elapsed_s))
    kept = any(note.startswith(KEPT_NOTE) for note in notes)
    table += ("\n\n" + "".join(f"{note}.\n" for note in notes) + space_text(experiments, kept)
              + winner_text(tuned, metric, maximize) + startup_text(tuned)
              + fit_text(fit_checks(experiments, records, metric, maximize)))
    if cancelled is None:
        return (f"{table}\nTuning completed in {elapsed}. Total number of experiments: {len(tuned)}."
                f" Metric: {metric} ({'max' if maximize else 'min'}).\n")
    return (f"{table}\nTuning interrupted after {elapsed}: the search is partial. Experiments measured: "
            f"{len(tuned)}; cancelled while running or queued: {len(cancelled)}"
            + (f" ({', '.join(cancelled)})" if cancelled else "")
            + f". Metric: {metric} ({'max' if maximize else 'min'}). "
            + (f"The best measured config is in {PARTIAL_FILES[0]} (partial: not an optimum); "
               if any(metric_value(r, metric) is not None for r in tuned) else "No experiment succeeded yet; ")
            + "run the same command to finish the search.\n")


def space_text(experiments: list[Experiment], kept: bool = False) -> str:
    """The space searched, per ZeRO stage: the micro-batch sizes measured, the samples per GPU per
    optimizer step they fill (gas = that // size) and where that limit came from (`kept`: the user's
    global batch, which every experiment keeps)."""
    stages: dict[int, list[Experiment]] = {}
    for exp in experiments:
        if exp.space != PROFILE and not exp.tuning_space:
            stages.setdefault(exp.stage, []).append(exp)
    if not stages:
        return ""
    lines = ["Space searched (per ZeRO stage):"]
    for stage, exps in sorted(stages.items()):
        sizes = [e.micro_batch_size for e in exps]
        step = max(e.micro_batch_size * e.gradient_accumulation_steps for e in exps)
        autotuning = exps[0].ds_config.get("autotuning") or {}
        user_gas = min(e.gradient_accumulation_steps for e in exps)
        if kept:
            source = f"the global batch kept: {exps[0].ds_config.get('train_batch_size')} per step, every experiment"
        elif autotuning.get("max_train_batch_size"):
            source = f"from max_train_batch_size {autotuning['max_train_batch_size']}"
        else:
            source = f"without max_train_batch_size: DeepSpeed's rule, the stage's top size times gas {user_gas}"
        bound = "" if kept else "up to "
        lines.append(f"  z{stage}: micro-batch {min(sizes)}-{max(sizes)}, {bound}{step} samples per GPU per step "
                     f"({source}); gas = samples per step // micro-batch")
    return "\n".join(lines) + "\n"


def winner_text(records: Sequence[ExperimentRecord], metric: str, maximize: bool) -> str:
    """The winner and the runner-up as pooled value (the mean, the median from three readings), spread and
    number of readings, and whether the gap between them is more than the measured noise
    (scheduler.search.confirm)."""
    groups: dict[str, tuple[str, list[float], list[Any]]] = {}
    configs: dict[str, Any] = {}
    for record in records:
        value = metric_value(record, metric)
        if value is not None:
            name, values, steps = groups.setdefault(config_key(record), (record.name, [], []))
            values.append(value)
            steps.append(record.step_seconds)
            configs.setdefault(config_key(record), record.ds_config)
    caps = curve_ceilings({key: (configs[key], values) for key, (_, values, _) in groups.items()}, maximize)
    decided = verdict([Readings(name, tuple(values), step_noise(steps), caps.get(key))
                       for key, (name, values, steps) in groups.items()], maximize)
    if decided is None:
        return ""

    def described(readings: Readings) -> str:
        low, high = min(readings.values), max(readings.values)
        within = ("" if readings.step_noise is None else
                  f", {100 * readings.step_noise:.1f} % error of one reading from its step times")
        capped = ("" if readings.ceiling is None else
                  f"; ranked at {readings.value:.6g}, what its stage's other sizes predict: its readings beat "
                  f"that curve by over {100 * CEILING_FLOOR:.0f} %, a lucky run's mark")
        return (f"{readings.key}: {pooled_value(readings.values):.6g} {metric}, {pooled_word(readings.count)} of "
                f"{readings.count} reading{'s' if readings.count > 1 else ''} (range {low:.6g}-{high:.6g}{within}{capped})")

    lines = [f"Winner: {described(decided.winner)}"]
    if decided.runner_up is not None:
        lines.append(f"Runner-up: {described(decided.runner_up)}")
    lines.append(separation_sentence(decided))
    return "\n".join(lines) + "\n"


def separation_sentence(decided: Verdict) -> str:
    """Why the winner is or is not separated from the runner-up (`Verdict.reason`), with the gap and
    the standard error it was judged on, so the words and the figures beside them cannot disagree."""
    reason = decided.reason
    if reason == ALONE:
        return "No other config ran, so there is nothing to separate it from."
    source = (f"the configs read more than once spread {100 * decided.noise:.1f} % pooled; a config's noise is that, "
              f"at least {100 * MIN_NOISE:.0f} %, or its own spread where larger" if decided.noise is not None else
              f"no config was read twice: {100 * PRIOR_NOISE:.0f} % assumed, or a config's own spread where larger")
    winner_noise, runner_noise = decided.noises
    figures = (f"the gap, {100 * decided.gap:.1f} %, is {decided.standard_errors:.1f} standard errors of the "
               f"difference ({100 * decided.error:.1f} %, from a noise per reading of {100 * winner_noise:.1f} % "
               f"for the winner and {100 * runner_noise:.1f} % for the runner-up; {source})")
    if reason == READ_ONCE:
        return (f"Not confirmed, read once: the winner was measured once, so its own noise is unknown and "
                f"no gap separates it; {figures}.")
    if reason == SEPARATED:
        return f"Separated: {figures}, more than {SEPARATION_Z:g}."
    return (f"Not separated: {figures}, within {SEPARATION_Z:g}; both are sound choices, the winner by its "
            f"{pooled_word(decided.winner.count)}.")


def launch_command(script_argv: list[str], num_nodes: int, num_gpus: int, *, record: ExperimentRecord | None = None,
                   local_rank_arg: bool = True, hostfile: Path | None = None,
                   name_hosts: bool = False) -> tuple[list[str], str | None]:
    """DeepSpeed's launcher command that trains as the winner was tuned, and the hostfile it needs.

    On CUDA slots the command names the very GPUs the winner ran on (`--include node:ids`, nvidia-smi
    indices, with CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers them the same way), not every
    GPU of the node; more than one node needs a hostfile (DeepSpeed's runner
    refuses a multi-node launch without one): its text is returned for `hostfile`, one line per node
    the winner used, in rank order. `name_hosts` (a tuning bounded by a resource pool, whose winner may
    have run on another node than this one): the hostfile and the node names even for one node, as
    DeepSpeed's cmd_optimal.txt names its pool's hosts. `--no_local_rank` is passed exactly when the
    tuned runs did not get `--local_rank=N`, so the script sees the same arguments as during tuning.

    The command sets OMP_NUM_THREADS/MKL_NUM_THREADS to the threads each rank had on its slot: the
    winner was measured with them, and DeepSpeed's launcher otherwise leaves every rank's torch
    all cores (on a 2-core machine that made ZeRO-0 2-3x slower than tuned; CPU offload's Adam
    depends on them on GPU nodes too). A multi-node CUDA winner also gets the NCCL_SOCKET_IFNAME its
    ranks ran with (one interface name on every node; `workers.slot.rank` sets it across nodes only). Over
    pdsh DeepSpeed's runner forwards only some variables to other nodes, so a multi-node launch needs
    them in `.deepspeed_env` as well (docs/gpus.md, on `cmd_optimal.txt`).
    """
    by_node: dict[str, list[int]] = {}
    ranks = sorted(record.rank_records if record is not None else [], key=lambda r: r.rank or 0)
    for rank in ranks:
        device = rank.extra.get("cuda_index", rank.device)  # `workers.slot.rank_record`: a CUDA slot's GPU index
        if isinstance(rank.node, str) and isinstance(device, int):
            by_node.setdefault(rank.node, []).append(device)
    cuda = bool(ranks) and all(isinstance(r.extra.get("cuda_index"), int) for r in ranks) and len(by_node) == num_nodes
    argv, hostfile_text = ["deepspeed"], None
    if (num_nodes > 1 or name_hosts) and len(by_node) == num_nodes and hostfile is not None:
        hostfile_text = "".join(f"{node} slots={max(devices) + 1 if cuda else len(devices)}\n"
                                for node, devices in by_node.items())
        argv += ["--hostfile", str(hostfile)]
    if cuda:
        names = list(by_node) if hostfile_text else ["localhost"]
        argv += ["--include", "@".join(f"{name}:{','.join(map(str, devices))}"
                                       for name, devices in zip(names, by_node.values()))]
    else:
        argv += ["--num_nodes", str(num_nodes), "--num_gpus", str(num_gpus)]
    if not local_rank_arg:
        argv.append("--no_local_rank")
    interfaces = {rank.extra.get("nccl_socket_ifname") for rank in ranks}
    if cuda and num_nodes > 1 and len(interfaces) == 1 and isinstance(next(iter(interfaces)), str):
        argv = [f"NCCL_SOCKET_IFNAME={next(iter(interfaces))}", *argv]  # the network the winner was measured on
    if cuda:  # --include names nvidia-smi (PCI bus order) indices; CUDA's own default order may differ
        argv = ["CUDA_DEVICE_ORDER=PCI_BUS_ID", *argv]
    threads = {rank.threads for rank in ranks}
    if len(threads) == 1 and isinstance(next(iter(threads)), int):
        count = next(iter(threads))
        argv = [f"OMP_NUM_THREADS={count}", f"MKL_NUM_THREADS={count}", *argv]
    return [*argv, *script_argv], hostfile_text


def write_results(results_dir: Path, experiments: list[Experiment], records: Mapping[str, dict[str, Any]],
                  metric: str, maximize: bool, elapsed_s: float,
                  optimal_argv: Callable[[Experiment, Path], list[str]],
                  local_rank_arg: bool = True,
                  cancelled: Mapping[str, CancelledRecord] | None = None,
                  notes: Sequence[str] = (), name_hosts: bool = False,
                  off_path: Sequence[tuple[Experiment, dict[str, Any]]] = ()) -> ExperimentRecord | None:
    """Write every output file; returns the best record, typed (None if no experiment succeeded). `notes`
    go into summary.txt after its table (`summary_text`).

    `off_path`: experiments an earlier run of the job measured that this run's search did not reach
    (a resumed search that re-ran a lost experiment can take another path). They are listed in
    results.jsonl (with `"off_path": true`) and results.csv, so nothing measured is dropped, and named
    in a note; they are not in the summary's table nor candidates for the winner, which the search
    alone confirms.
    `cancelled` (an interrupted search: name -> its row, see `cancelled_record`) makes the outputs partial, as
    the module docstring says; `name_hosts`: see `launch_command`. The records come as JSON, read typed here."""
    results_dir.mkdir(parents=True, exist_ok=True)
    partial = cancelled is not None
    cancelled = cancelled or {}
    typed = {name: ExperimentRecord.from_json(record) for name, record in records.items()}
    ordered = [typed[e.name] for e in experiments if e.name in typed]
    listed: list[Row] = [typed.get(e.name) or cancelled[e.name] for e in experiments if e.name in typed or
                         e.name in cancelled] + [ExperimentRecord.from_json(record) for _, record in off_path]
    write_atomic(result_file(results_dir, RESULTS_JSONL), results_jsonl(listed, {e.name for e, _ in off_path}))
    by_name = {e.name: e for e in experiments} | {e.name: e for e, _ in off_path}
    write_atomic(result_file(results_dir, RESULTS_CSV), results_csv([(by_name[r.name], r) for r in listed], metric))
    if off_path:
        notes = [*notes, f"measured by an earlier run of this job, off this run's path (listed in "
                         f"{RESULTS_JSONL}, not ranked): {', '.join(e.name for e, _ in off_path)}"]
    write_atomic(result_file(results_dir, SUMMARY),
                 summary_text(experiments, records, metric, maximize, elapsed_s,
                              list(cancelled) if partial else None, notes))
    winner = best(ordered, metric, maximize)
    if partial:  # a Ctrl-C is not kept waiting for matplotlib (seconds on a busy machine)
        for stale in (TUNING_PLOT, TIMELINE_PLOT, MODEL_PLOT):
            result_file(results_dir, stale).unlink(missing_ok=True)
    else:
        from scheduler.report.plot import write_plot, write_timeline  # matplotlib is imported only when a job ends

        write_plot(result_file(results_dir, TUNING_PLOT), experiments, typed, metric, winner)
        write_timeline(result_file(results_dir, TIMELINE_PLOT), ordered, winner)
        write_fit_plot(result_file(results_dir, MODEL_PLOT), fit_checks(experiments, records, metric, maximize), metric)
    for stale in (*OPTIMAL_FILES, *PARTIAL_FILES):
        result_file(results_dir, stale).unlink(missing_ok=True)
    if winner is None:
        return None
    config_name, command_name, hostfile_name = PARTIAL_FILES if partial else OPTIMAL_FILES
    exp = by_name[winner.name]
    optimal_path = result_file(results_dir, config_name).resolve()
    write_json(optimal_path, optimal_config(winner.ds_config))
    hostfile = result_file(results_dir, hostfile_name).resolve()
    command, hostfile_text = launch_command(optimal_argv(exp, optimal_path), exp.num_nodes, exp.num_gpus,
                                            record=winner, local_rank_arg=local_rank_arg, hostfile=hostfile,
                                            name_hosts=name_hosts)
    if hostfile_text is not None:
        write_atomic(hostfile, hostfile_text)
    write_atomic(result_file(results_dir, command_name), shlex.join(command) + "\n")
    return winner


def print_table(console: Console, experiments: list[Experiment], records: Mapping[str, dict[str, Any] | Row],
                metric: str, winner: dict[str, Any] | Row | None) -> None:
    """The results table for the terminal: every experiment, its status and metric, the winner (one of
    `records`' values) marked. A record is its JSON or typed (`scheduler.report.rows.row_of`)."""
    table = Table(title=f"celery-autotune results ({metric})")
    for column in ("experiment", "stage", "mbs", "gas", "status", metric, "wall s", "peak PSS MiB"):
        table.add_column(column, justify="left" if column in ("experiment", "status") else "right")
    for exp in experiments:
        written = records.get(exp.name)
        if written is None:
            continue
        row = row_of(written)
        value = metric_value(row, metric)
        mark = " *" if winner is not None and written is winner else ""
        table.add_row(exp.name + mark, str(exp.stage), str(exp.micro_batch_size),
                      str(exp.gradient_accumulation_steps), status_word(row),
                      f"{value:,.2f}" if value is not None else "-",
                      f"{row.wall_s or 0:.1f}", f"{(row.peak_rss_bytes or 0) / 2**20:,.0f}")
    console.print(table)
