"""What every test process shares: a run token that dies with the run, and DeepSpeed ops of its own.

Why: the suite runs in several processes at once (pytest-xdist), and tests start real servers,
workers and training ranks, many of them in sessions of their own, so a signal to pytest reaches
none of them.
- **Nothing outlives the run.** The first pytest process (xdist's controller, or the only one) puts a
  token in the environment that every process a test starts inherits (`AUTOTUNE_TEST_RUN`), and
  starts `tests/run_watchdog.py` beside it: when that pytest process ends, however it ends (SIGKILL
  from a time limit included), the watchdog kills every process still carrying the token.
- **No shared build locks.** DeepSpeed's ops load under torch's build lock in `TORCH_EXTENSIONS_DIR`;
  tests in different processes sharing the venv's folder met each other's locks (and a test that
  kills ranks mid-load leaves one). Each test process gets its own copy of the prebuilt folder
  (`deploy/setup.sh` builds it once), so nothing compiles twice and no lock is shared.
- **Ctrl-C reaches the commands the tests interrupt.** A shell starts a background job (`bash .ci/run &`)
  with SIGINT ignored, every process it starts inherits that, and a Python started with SIGINT
  ignored never raises KeyboardInterrupt: each test that sends SIGINT then waited out its limit. Every
  pytest process takes Python's own handler back, so what the tests start takes Ctrl-C as from a
  terminal.
- **The longest tests start first, one pile per process.** xdist's worksteal hands each process an
  equal share of the collection, in order, and an idle process takes the back half of a busy one's
  share; a long test near the back of a share starts late and the run waits for it. The collection
  is reordered (`pytest_collection_modifyitems`): the files holding the tests `LONG_TESTS` names
  are dealt whole, longest first, each to the front of the share with the fewest seconds so far,
  and the rest fill the shares in their own order.
- **No test hands its environment to the next.** Every command a test starts inherits this
  process's environment, so a test that changed it (MLflow's `set_tracking_uri` writes
  MLFLOW_TRACKING_URI) made every later command in the same process log its job to MLflow, in a
  SQLite file created wherever it ran. The environment is put back after each test.
"""
from __future__ import annotations

import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RUN_TOKEN = "AUTOTUNE_TEST_RUN"
WATCHDOG = Path(__file__).with_name("run_watchdog.py")


def pytest_configure(config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # xdist's controller, or a run in one process
        _start_watchdog(config)
    _own_extensions_dir(config)


def _start_watchdog(config) -> None:
    if RUN_TOKEN in os.environ:  # a pytest run started by a test: the outer run's watchdog covers it
        return
    token = secrets.token_hex(8)
    os.environ[RUN_TOKEN] = token
    env = {key: value for key, value in os.environ.items() if key != RUN_TOKEN}
    config._autotune_watchdog = subprocess.Popen(
        [sys.executable, str(WATCHDOG), str(os.getpid()), token], env=env, start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _own_extensions_dir(config) -> None:
    """This process's TORCH_EXTENSIONS_DIR: a copy of the prebuilt one (lock files left out). A folder
    the user chose stands, as it does for the tool."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    from workers.slot.build_locks import default_extensions_dir

    own = Path(tempfile.mkdtemp(prefix="autotune-test-ext-"))
    prebuilt = Path(default_extensions_dir())
    if prebuilt.is_dir():
        shutil.copytree(prebuilt, own, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
    os.environ["TORCH_EXTENSIONS_DIR"] = str(own)
    config._autotune_extensions = own


def pytest_unconfigure(config) -> None:
    own = getattr(config, "_autotune_extensions", None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


#: The slowest tests: seconds each took in a run of the whole suite on a 2-core machine (rounded), by
#: path and name (every parameter alike). Only the order of the run follows from these: a test
#: missing here runs after them, in collection order.
LONG_TESTS = {
    "tests/integration/test_checkpointing_example.py::test_checkpointing_example_runs_a_larger_micro_batch_with_the_flag": 50,
    "tests/integration/test_partition.py::test_a_node_cut_off_for_twice_its_lease_is_not_counted_and_its_relaunch_is": 58,
    "tests/integration/test_deploy_two_hosts.py::test_up_status_cleanup_down_across_two_hosts": 43,
    "tests/integration/test_hf_example.py::test_hf_trainer_example_tuned_through_arg_mappings": 30,
    "tests/integration/test_faults.py::test_redis_restarted_mid_job": 42,
    "tests/integration/test_cuda_path.py::test_three_fake_gpus_give_three_cuda_slots_and_each_rank_its_own_device": 39,
    "tests/integration/test_two_nodes.py::test_node_lost_mid_experiment": 33,
    "tests/integration/test_deploy_two_hosts.py::test_node_lost_its_training_group_is_killed_over_ssh_and_the_experiment_reruns_on_node1": 32,
    "tests/integration/test_examples.py::test_deepspeed_example_through_the_embedded_cluster": 41,
    "tests/integration/test_faults.py::test_slot_worker_killed_mid_experiment": 28,
    "tests/integration/test_faults.py::test_a_pool_process_killed_mid_rank_leaves_one_training_group_and_no_busy_slot": 28,
    "tests/integration/test_overwrite.py::test_an_interrupted_then_a_finished_run_are_overwritten_and_a_users_file_is_refused_and_kept": 26,
    "tests/integration/test_tuning.py::test_full_mode_with_each_tuner": 26,
    "tests/integration/test_flower.py::test_flower_shows_slots_and_experiments_and_no_password_leaks": 25,
    "tests/integration/test_warm_start.py::test_the_memory_cap_and_the_figure_are_a_cold_ranks": 36,
    "tests/integration/test_examples.py::test_plain_torch_example_two_ranks": 22,
    "tests/integration/test_faults.py::test_a_slot_whose_worker_stopped_consuming_is_withdrawn_and_its_experiment_runs_elsewhere": 21,
    "tests/integration/test_cuda_path.py::test_cmd_optimal_launches_what_was_tuned": 20,
    "tests/integration/test_hand_cluster.py::test_every_failure_class_and_the_others_still_run": 19,
    "tests/integration/test_deploy.py::test_up_status_cleanup_down": 19,
    "tests/integration/test_mlflow.py::test_a_job_is_one_parent_run_with_a_child_per_experiment_and_its_resume_continues_it": 19,
    "tests/integration/test_tuning.py::test_fast_mode_all_stages": 18,
    "tests/integration/test_warm_start.py::test_a_deepspeed_rank_on_cpu_finds_the_ops_probed_and_the_communication_op_loaded": 18,
    "tests/integration/test_tls.py::test_a_job_runs_over_tls_and_plain_text_is_refused_by_the_server": 18,
    "tests/integration/test_tuning.py::test_running_the_command_again_attaches_to_the_running_job": 17,
    "tests/integration/test_live_and_endings.py::test_live_panel_in_a_terminal": 17,
    "tests/integration/test_tuning.py::test_the_job_goes_on_after_the_scheduler_is_killed": 17,
    "tests/integration/test_tuning.py::test_resume_after_the_job_is_interrupted": 17,
    "tests/integration/test_bad_input_corpus.py::test_an_op_the_config_names_is_built_before_the_script_and_a_failed_build_is_only_advice": 15,
    "tests/integration/test_mlflow.py::test_a_server_that_is_down_is_one_warning_and_the_next_run_logs_every_record": 15,
    "tests/integration/test_search_gpu_standin.py::test_the_search_on_a_gpu_like_script_through_the_cluster": 15,
    "tests/integration/test_live_and_endings.py::test_interrupted_run_says_so_in_a_log": 14,
    "tests/integration/test_shared_cluster.py::test_two_jobs_share_four_slots": 13,
    "tests/integration/test_warm_shutdown.py::test_the_warm_interpreter_ends_with_its_worker": 13,
    "tests/integration/test_secrets.py::test_no_secret_reaches_a_file_a_log_a_command_line_or_a_ranks_environment": 12,
    "tests/integration/test_embedded_cluster.py::test_interrupt_tears_everything_down": 12,
    "tests/integration/test_celery_autotune.py::test_workers_started_after_the_command_are_waited_for": 12,
    "tests/integration/test_warm_start.py::test_the_wait_for_the_warm_process_is_the_launchs_own": 12,
    "tests/integration/test_run.py::test_ctrl_c_stops_the_embedded_cluster_and_every_rank": 11,
    "tests/integration/test_bad_input_corpus.py::test_a_model_no_stage_holds_once_profiled_is_refused_saying_so_and_the_next_run_resumes": 10,
    "tests/integration/test_backfill_order.py::test_backfill_starts_the_short_one_beside_the_running_one": 10,
    "tests/integration/test_op_prebuild_child.py::test_a_build_past_its_time_limit_is_a_failure_naming_the_op_and_leaves_no_lock": 10,
    "tests/integration/test_warm_start.py::test_a_lock_in_the_ops_folder_leaves_the_op_to_the_rank": 9,
    "tests/integration/test_cuda_path.py::test_inherited_visible_devices_are_honoured": 9,
    "tests/integration/test_rank_endings.py::test_a_wrapper_script_that_hangs_after_measuring_keeps_its_measurement": 9,
    "tests/integration/test_embedded_cluster.py::test_stop_kills_every_worker_and_a_rank_recorded_as_running": 8,
    "tests/integration/test_warm_start.py::test_every_rank_of_a_real_job_runs_warm_by_default": 8,
    "tests/integration/test_bench_smoke.py::test_the_bench_prints_its_figures": 8,
    "tests/integration/test_two_nodes.py::test_two_node_experiments_meet_across_the_link": 7,
    "tests/integration/test_warm_start.py::test_a_forked_rank_is_what_a_cold_one_is": 7,
    "tests/integration/test_backfill_order.py::test_strict_fifo_keeps_the_short_one_behind_the_head": 7,
    "tests/integration/test_embedded_cluster.py::test_autotuner_killed_with_sigkill_leaves_nothing": 7,
    "tests/integration/test_shared_cluster.py::test_min_slot_memory_keeps_a_job_on_the_bigger_node": 7,
    "tests/integration/test_hand_cluster.py::test_two_rank_experiment_meets_through_redis": 7,
    "tests/integration/test_embedded_cluster.py::test_the_cluster_user_cannot_take_over_redis": 7,
    "tests/integration/test_warm_start.py::test_what_a_rank_imported_itself_is_preloaded_for_the_next": 6,
    "tests/integration/test_tuning.py::test_a_port_taken_before_rank_0_binds_it_is_launched_again_and_never_a_result": 6,
    "tests/integration/test_op_prebuild_child.py::test_an_op_that_cannot_be_built_is_reported_before_any_training": 8,
    "tests/integration/test_oom_entry_process.py::test_an_oom_is_read_from_stderr_only_as_the_last_tracebacks_exception": 6,
    "tests/integration/test_op_prebuild_child.py::test_a_child_that_loads_every_op_is_not_started_again": 5,
    "tests/integration/test_launch_polling.py::test_a_killed_group_is_gone_when_kill_group_returns": 5,
    "tests/unit/test_gpus.py::test_the_worker_reads_memory_in_use_and_bus_ids_through_a_real_subprocess": 4,
    "tests/unit/test_docs.py::test_each_readme_celery_command_parses": 4,
    "tests/integration/test_launch_polling.py::test_a_peak_between_the_slow_readings_is_in_the_figure": 3,
    "tests/unit/test_build_locks.py::test_an_aborted_launch_stops_the_rebuild_and_releases_the_lock": 3,
    "tests/unit/test_op_build.py::test_a_compile_error_inside_the_rank_is_an_op_that_cannot_be_built": 3,
    "tests/unit/test_tuners.py::test_model_based_finds_the_best_region_in_a_few_trials": 8,
    "tests/unit/test_tuners.py::test_model_based_still_explores_every_config": 4,
    "tests/unit/test_architecture.py::test_the_checks_see_a_planted_upward_import_and_cycle": 4,
    "tests/unit/test_run_cli.py::test_sigusr1_prints_every_threads_stack_and_the_run_goes_on": 3,
}


def pytest_collection_modifyitems(config, items) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    items[:] = dealt(items, workers, lambda item: LONG_TESTS.get(item.nodeid.split("[")[0], 0))


def dealt(items: list, workers: int, seconds) -> list:
    """`items` reordered for `workers` processes that each take the next equal share, in order, as
    worksteal hands them out. A file that holds a long test (seconds > 0) is dealt whole, so its
    module's fixtures start once and its tests keep their order: the files with the most seconds
    first, each to the front of the share with the fewest seconds so far; the other files fill the
    shares in collection order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    long_files = sorted((group for group in files.values() if any(seconds(item) > 0 for item in group)),
                        key=lambda group: sum(map(seconds, group)), reverse=True)
    sizes, left = [], len(items)
    for share in range(workers):
        sizes.append(left // (workers - share))
        left -= sizes[-1]
    shares: list[list] = [[] for _ in sizes]
    loads = [0.0] * workers
    for group in long_files:
        share = min(range(workers), key=lambda i: loads[i])
        shares[share].extend(group)
        loads[share] += sum(map(seconds, group))
    dealt_ids = {id(item) for share in shares for item in share}
    rest = iter([item for item in items if id(item) not in dealt_ids])
    for share, size in zip(shares, sizes):
        share.extend(itertools.islice(rest, max(0, size - len(share))))
    return [item for share in shares for item in share] + list(rest)


PYTEST_OWN = "PYTEST_CURRENT_TEST"  #: pytest's own, changed at every phase of every test


@pytest.fixture(autouse=True)
def _environment_put_back():
    saved = {key: value for key, value in os.environ.items() if key != PYTEST_OWN}
    yield
    now = {key: value for key, value in os.environ.items() if key != PYTEST_OWN}
    if now != saved:
        for key in now.keys() - saved.keys():
            del os.environ[key]
        os.environ.update(saved)
