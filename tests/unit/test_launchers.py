"""Every backend's argv for DeepSpeed's two-host fixture, quoting that survives, and backend errors."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from scheduler.launch.elastic import ElasticSettings
from scheduler.errors import UsageError
from scheduler.launch.launch_spec import (LaunchSpec, decode_world_info, encode_world_info, local_command,
                                          needs_multinode)
from scheduler.launch.launchers import get_launcher, require_backend
from scheduler.launch.mpi_launchers import MvapichLauncher
from scheduler.launch.pdsh_launcher import PdshLauncher, private_file_exports
from scheduler.launch.environment import write_private_file
from scheduler.launch.resources import ResourceRequest, Resources

PY = "/usr/bin/python3"
TWO_HOSTS = Resources.from_mapping({"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]})
WORLD_INFO = "eyJ3b3JrZXItMCI6IFswLCAxLCAyLCAzXSwgIndvcmtlci0xIjogWzAsIDEsIDIsIDNdfQ=="
EXPORTS = {"PYTHONPATH": "/work/job", "NCCL_DEBUG": "INFO"}


def fixture_spec(**changes: object) -> LaunchSpec:
    base = LaunchSpec(
        resources=TWO_HOSTS, user_script="train.py", user_args=("--lr", "0.1"), master_addr="10.0.0.1",
        cwd="/work/job", exports=EXPORTS, python=PY, hostfile="/job/hostfile",
    )
    return dataclasses.replace(base, **changes)


def test_world_info_matches_deepspeed_encoding() -> None:
    assert encode_world_info(TWO_HOSTS) == WORLD_INFO
    assert encode_world_info({"worker-0": [0, 1, 2, 3], "worker-1": (0, 1, 2, 3)}) == WORLD_INFO


def test_world_info_keeps_real_ids_and_order() -> None:
    resources = Resources.from_mapping({"b": [2, 3], "a": [5]})
    assert list(decode_world_info(encode_world_info(resources)).items()) == [("b", [2, 3]), ("a", [5])]


PDSH_FIXTURE = [
    "pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1",
    "export PYTHONPATH=/work/job; export NCCL_DEBUG=INFO;", "cd /work/job;",
    PY, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={WORLD_INFO}", "--node_rank=%n",
    "--master_addr=10.0.0.1", "--master_port=29500", "--enable_each_rank_log=None", "train.py", "--lr", "0.1",
]


def test_pdsh_fixture_argv() -> None:
    assert get_launcher("pdsh").command(fixture_spec()) == PDSH_FIXTURE


def test_pdsh_optional_flags_in_deepspeed_order() -> None:
    spec = fixture_spec(
        venv_script="/opt/my env/activate", module=True, no_local_rank=True, save_pid=4242, each_rank_log="/logs",
        bind_cores_to_rank=True, bind_core_list="0-3", exports={}, launcher_args="-R ssh -l 'svc user'",
    )
    assert PdshLauncher().command(spec) == [
        "pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh", "-l", "svc user",
        "source '/opt/my env/activate';", "cd /work/job;",
        PY, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={WORLD_INFO}", "--node_rank=%n",
        "--master_addr=10.0.0.1", "--master_port=29500", "--module", "--no_local_rank", "--save_pid", "4242",
        "--enable_each_rank_log=/logs", "--bind_cores_to_rank", "--bind_core_list=0-3", "train.py", "--lr", "0.1",
    ]


def test_pdsh_quotes_each_remote_word_once() -> None:
    spec = fixture_spec(user_args=("--name", "a b", "it's"), exports={"NCCL_X": "$HOME"})
    words = PdshLauncher().remote_words(spec)
    assert words[0] == "export NCCL_X='$HOME';"
    assert words[-3:] == ["--name", "'a b'", "'it'\"'\"'s'"]


USER_ARGS = (
    "--name", "two words", "it's", 'say "hi"', "$HOME", "`id`", "a;b", "x\ny", "", "back\\slash", "*", "--flag=a b",
)

PRINTER = """#!{python}
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(),
                  "env": {{k: os.environ.get(k) for k in ("NCCL_DEBUG", "PYTHONPATH", "UCX_WEIRD")}}}}))
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pdsh_remote_command_survives_a_shell(tmp_path) -> None:
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    printer = tmp_path / "fake python"
    printer.write_text(PRINTER.format(python=sys.executable), encoding="utf-8")
    printer.chmod(printer.stat().st_mode | stat.S_IXUSR)
    exports = {"NCCL_DEBUG": "INFO", "PYTHONPATH": f"{workdir}:/lib", "UCX_WEIRD": "a 'b' \"c\" $d;e"}
    spec = fixture_spec(python=str(printer), cwd=str(workdir), user_args=USER_ARGS, exports=exports)
    remote = PdshLauncher().remote_command(spec).replace("%n", "1")
    result = subprocess.run(["bash", "-c", remote], capture_output=True, text=True, check=True,
                            env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"})
    seen = json.loads(result.stdout)
    assert seen["cwd"] == str(workdir)
    assert seen["env"] == exports
    assert seen["argv"] == [
        "-u", "-m", "deepspeed.launcher.launch", f"--world_info={WORLD_INFO}", "--node_rank=1",
        "--master_addr=10.0.0.1", "--master_port=29500", "--enable_each_rank_log=None", "train.py", *USER_ARGS,
    ]


def test_pdsh_per_node_arguments_parse_in_deepspeed_launcher(monkeypatch) -> None:
    launch = pytest.importorskip("deepspeed.launcher.launch")
    remote = PdshLauncher().remote_command(fixture_spec(user_args=("--name", "a b"))).replace("%n", "1")
    words = shlex.split(remote)
    monkeypatch.setattr(sys, "argv", ["launch", *words[words.index("deepspeed.launcher.launch") + 1:]])
    parsed = launch.parse_args()
    assert (parsed.node_rank, parsed.master_addr, parsed.master_port) == (1, "10.0.0.1", 29500)
    assert decode_world_info(parsed.world_info) == TWO_HOSTS.hosts
    assert (parsed.training_script, parsed.training_script_args) == ("train.py", ["--name", "a b"])


@pytest.mark.parametrize(
    ("ssh_port", "existing", "expected"),
    [
        (None, None, {"PDSH_RCMD_TYPE": "ssh"}),
        (2222, None, {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}),
        (2222, "-o X=1", {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-o X=1 -p 2222"}),
    ],
)
def test_pdsh_launch_env(ssh_port, existing, expected) -> None:
    environ = {} if existing is None else {"PDSH_SSH_ARGS_APPEND": existing}
    assert PdshLauncher().launch_env(fixture_spec(ssh_port=ssh_port), environ) == expected


def test_pdsh_elastic_runs_torchrun_with_real_ids() -> None:
    resources = Resources.from_mapping({"worker-0": [2, 3], "worker-1": [2, 3]})
    spec = fixture_spec(resources=resources, exports={}, elastic=ElasticSettings(1, 2, run_id="r1"))
    assert PdshLauncher().remote_words(spec) == [
        "export CUDA_VISIBLE_DEVICES=2,3; export TORCH_NCCL_ASYNC_ERROR_HANDLING=1;", "cd /work/job;",
        PY, "-u", "-m", "torch.distributed.run", "--nnodes=1:2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:29500", "--rdzv_id=r1", "--max_restarts=100", "--monitor_interval=5",
        "--nproc_per_node=2", "train.py", "--lr", "0.1",
    ]


def test_pdsh_elastic_refuses_launcher_only_flags() -> None:
    with pytest.raises(UsageError, match="--save_pid cannot be combined with --elastic_training"):
        PdshLauncher().command(fixture_spec(save_pid=1, elastic=ElasticSettings(1, 2)))


OPENMPI_FIXTURE = [
    "mpirun", "-n", "8", "-hostfile", "/job/hostfile", "--mca", "btl", "^openib",
    "--mca", "btl_tcp_if_include", "eth0",
    "-x", "UCX_TLS=tcp", "-x", "PYTHONPATH=/work/job", "-x", "NCCL_DEBUG=INFO",
    PY, "-u", "train.py", "--lr", "0.1",
]


def test_openmpi_fixture_argv() -> None:
    assert get_launcher("openmpi").command(fixture_spec()) == OPENMPI_FIXTURE


@pytest.mark.parametrize("flag", ["--mca", "-mca"])
def test_openmpi_user_interface_replaces_eth0(flag: str) -> None:
    argv = get_launcher("openmpi").command(fixture_spec(launcher_args=f"{flag} btl_tcp_if_include ib0"))
    assert argv[:11] == ["mpirun", "-n", "8", "-hostfile", "/job/hostfile", "--mca", "btl", "^openib",
                         flag, "btl_tcp_if_include", "ib0"]
    assert "eth0" not in argv


def test_openmpi_raw_values_and_ucx_override_keeps_first_position() -> None:
    argv = get_launcher("openmpi").command(fixture_spec(exports={"NCCL_X": "a b", "UCX_TLS": "rc"}, module=True))
    assert argv[11:] == ["-x", "UCX_TLS=rc", "-x", "NCCL_X=a b", PY, "-u", "-m", "train.py", "--lr", "0.1"]


def test_openmpi_no_python_runs_script_directly() -> None:
    assert get_launcher("openmpi").command(fixture_spec(no_python=True))[-3:] == ["train.py", "--lr", "0.1"]
    assert PY not in get_launcher("openmpi").command(fixture_spec(no_python=True))


MPICH_FIXTURE = [
    "mpirun", "-n", "8", "-ppn", "4", "-genv", "PYTHONPATH=/work/job", "-genv", "NCCL_DEBUG=INFO",
    "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500", "-genv", "WORLD_SIZE", "8",
    "-genv", "LOCAL_SIZE", "4", "-hosts", "worker-0,worker-1",
    PY, "-u", "-m", "deepspeed.launcher.launcher_helper", "--launcher", "mpich", "train.py", "--lr", "0.1",
]


def test_mpich_fixture_argv() -> None:
    assert get_launcher("mpich").command(fixture_spec()) == MPICH_FIXTURE


@pytest.mark.parametrize(("changes", "helper_flag"), [({"module": True}, ["--module"]),
                                                       ({"no_python": True}, ["--no_python"])])
def test_mpich_helper_flags(changes: dict, helper_flag: list[str]) -> None:
    argv = get_launcher("mpich").command(fixture_spec(**changes))
    assert argv[-6:] == ["--launcher", "mpich", *helper_flag, "train.py", "--lr", "0.1"]


def test_impi_mpmd_blocks() -> None:
    resources = Resources.from_mapping({"worker-0": [0], "worker-1": [0]})
    argv = get_launcher("impi").command(fixture_spec(resources=resources, exports={"NCCL_DEBUG": "INFO"}))
    assert argv == [
        "mpirun", "-ppn", "1", "-genv", "NCCL_DEBUG", "INFO",
        "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "29500", "-genv", "WORLD_SIZE", "2",
        "-genv", "LOCAL_SIZE", "1", "-genv", "I_MPI_PIN", "0", "-hosts", "worker-0,worker-1",
        "-n", "1", "-env", "RANK", "0", "-env", "LOCAL_RANK", "0", PY, "-u", "train.py", "--lr", "0.1",
        ":", "-n", "1", "-env", "RANK", "1", "-env", "LOCAL_RANK", "0", PY, "-u", "train.py", "--lr", "0.1",
    ]


def test_impi_local_ranks_cycle_per_host() -> None:
    argv = get_launcher("impi").command(fixture_spec())
    local_ranks = [argv[at + 2] for at, word in enumerate(argv) if word == "-env" and argv[at + 1] == "LOCAL_RANK"]
    assert local_ranks == ["0", "1", "2", "3", "0", "1", "2", "3"]


MVAPICH_FIXTURE = [
    "mpirun", "-np", "8", "-ppn", "4", "--hostfile", "/tmp/deepspeed_mvapich_hostfile",
    "-env", "MV2_SMP_USE_CMA=0", "-env", "MV2_DEBUG_SHOW_BACKTRACE=1", "-env", "MV2_USE_CUDA=1",
    "-env", "MV2_SUPPORT_DL=1", "-env", "MV2_ENABLE_AFFINITY=0", "-env", "MV2_INTER_ALLGATHER_TUNING=5",
    "-env", "MV2_CUDA_USE_NAIVE=0", "-env", "PYTHONPATH=/work/job", "-env", "NCCL_DEBUG=INFO",
    PY, "-u", "train.py", "--lr", "0.1",
]


def test_mvapich_fixture_argv_and_host_list() -> None:
    assert get_launcher("mvapich").command(fixture_spec()) == MVAPICH_FIXTURE
    assert MvapichLauncher().hostfile_text(fixture_spec()) == "worker-0\nworker-1\n"


def test_mvapich_without_cuda_and_own_host_list_path() -> None:
    argv = MvapichLauncher(hostfile_path="/run/job/hosts", cuda=False).command(fixture_spec())
    assert argv[5:7] == ["--hostfile", "/run/job/hosts"]
    assert "MV2_USE_CUDA=1" not in argv


@pytest.mark.parametrize(("which", "mpiname", "expected"), [
    (lambda tool: None, "MVAPICH2-GDR 2.3", False),
    (lambda tool: "/usr/bin/mpiname", "MVAPICH2 2.3", False),
    (lambda tool: "/usr/bin/mpiname", "MVAPICH2-GDR 2.3.7", True),
])
def test_mvapich_backend_needs_gdr(which, mpiname: str, expected: bool) -> None:
    asked: list[list[str]] = []
    read_output = lambda argv: asked.append(list(argv)) or mpiname  # noqa: E731
    assert MvapichLauncher().backend_exists(which, read_output) is expected
    assert asked == ([["mpiname"]] if which("mpiname") else [])


SLURM_FIXTURE = [
    "srun", "-n", "8", "--export=ALL,PYTHONPATH=/work/job,NCCL_DEBUG=INFO", PY, "-u", "train.py", "--lr", "0.1",
]


def test_slurm_fixture_argv() -> None:
    assert get_launcher("slurm").command(fixture_spec()) == SLURM_FIXTURE


def test_slurm_include_names_surviving_hosts() -> None:
    spec = fixture_spec(
        resources=Resources.from_mapping({"worker-1": [0, 1, 2, 3]}), request=ResourceRequest(include="worker-1"),
        slurm_comment="tune", launcher_args="-p gpu", exports={},
    )
    assert get_launcher("slurm").command(spec) == [
        "srun", "-n", "4", "-p", "gpu", "--comment", "tune", "--nodelist", "worker-1", "--nodes", "1",
        "--export=ALL", PY, "-u", "train.py", "--lr", "0.1",
    ]


def test_slurm_counts() -> None:
    spec = fixture_spec(
        resources=Resources.from_mapping({"worker-0": [0, 1], "worker-1": [0, 1]}),
        request=ResourceRequest(num_nodes=2, num_gpus=2), exports={},
    )
    assert get_launcher("slurm").command(spec)[:8] == [
        "srun", "-n", "4", "--nodes", "2", "--gpus-per-node", "2", "--export=ALL",
    ]


@pytest.mark.parametrize(("hosts", "exports", "message"), [
    ({"worker-0": [2, 3]}, {}, r"cannot pin device ids, got \[2, 3\] on worker-0"),
    ({"worker-0": [0, 1], "worker-1": [0]}, {}, "same number of devices on every host"),
    ({"worker-0": [0]}, {"NCCL_X": "a,b"}, "contains ','"),
])
def test_slurm_errors(hosts, exports, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        get_launcher("slurm").command(fixture_spec(resources=Resources.from_mapping(hosts), exports=exports))


@pytest.mark.parametrize("name", ["openmpi", "mpich", "impi", "mvapich"])
@pytest.mark.parametrize(("request_", "message"), [
    (ResourceRequest(include="worker-0"), "does not support --include/--exclude"),
    (ResourceRequest(exclude="worker-0:1"), "does not support --include/--exclude"),
    (ResourceRequest(num_nodes=1), "does not support --num_nodes/--num_gpus"),
    (ResourceRequest(num_gpus=2), "does not support --num_nodes/--num_gpus"),
])
def test_mpi_backends_refuse_selections(name: str, request_: ResourceRequest, message: str) -> None:
    with pytest.raises(UsageError, match=f"--launcher {name} {message}"):
        get_launcher(name).command(fixture_spec(request=request_))


@pytest.mark.parametrize("name", ["mpich", "impi", "mvapich"])
def test_equal_devices_per_host_required(name: str) -> None:
    uneven = Resources.from_mapping({"worker-0": [0, 1], "worker-1": [0]})
    with pytest.raises(UsageError, match="same number of devices on every host"):
        get_launcher(name).command(fixture_spec(resources=uneven))


@pytest.mark.parametrize("name", ["openmpi", "mpich", "impi", "mvapich", "slurm"])
def test_rank_backends_refuse_elastic(name: str) -> None:
    with pytest.raises(UsageError, match=f"not supported with --launcher {name}"):
        get_launcher(name).command(fixture_spec(elastic=ElasticSettings(1, 2)))


def test_openmpi_needs_hostfile() -> None:
    with pytest.raises(UsageError, match="needs a hostfile"):
        get_launcher("openmpi").command(fixture_spec(hostfile=None))


@pytest.mark.parametrize(("name", "tool"), [
    ("pdsh", "pdsh"), ("openmpi", "ompi_info"), ("mpich", "mpirun"), ("impi", "mpirun"), ("slurm", "sinfo"),
    ("mvapich", "mpiname"),
])
def test_missing_backend_is_a_clear_error(name: str, tool: str) -> None:
    looked_up: list[str] = []

    def which(program: str) -> str | None:
        looked_up.append(program)
        return None

    with pytest.raises(UsageError, match=f"launcher '{name}' is not installed: '{tool}' was not found"):
        require_backend(get_launcher(name), which)
    assert looked_up == [tool]


def test_present_backend_passes() -> None:
    require_backend(get_launcher("pdsh"), lambda program: f"/usr/bin/{program}")


@pytest.mark.parametrize(("given", "expected"), [("PDSH", "pdsh"), (" OpenMPI ", "openmpi"), ("Slurm", "slurm")])
def test_launcher_names_are_case_insensitive(given: str, expected: str) -> None:
    assert get_launcher(given).name == expected


def test_unknown_launcher() -> None:
    with pytest.raises(UsageError, match="unknown --launcher 'torque'; choose one of pdsh, openmpi"):
        get_launcher("torque")


def test_unbalanced_launcher_args() -> None:
    with pytest.raises(UsageError, match="--launcher_args .*balance the quotes"):
        get_launcher("pdsh").command(fixture_spec(launcher_args="-l 'oops"))


@pytest.mark.parametrize(("changes", "message"), [
    ({"module": True, "no_python": True}, "--module and --no_python"),
    ({"master_port": 70000}, "not a TCP port"),
    ({"cwd": "relative/dir"}, "must be an absolute path"),
    ({"resources": Resources(entries=())}, "no hosts selected"),
])
def test_spec_validation(changes: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        fixture_spec(**changes)


def test_local_command_matches_deepspeed_single_node() -> None:
    spec = fixture_spec(resources=Resources.from_mapping({"localhost": [2, 3]}), master_addr="127.0.0.1")
    info = encode_world_info({"localhost": [2, 3]})
    assert local_command(spec) == [
        PY, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}", "--master_addr=127.0.0.1",
        "--master_port=29500", "--enable_each_rank_log=None", "--log_level=info", "train.py", "--lr", "0.1",
    ]
    assert local_command(dataclasses.replace(spec, quiet=True, log_level="error"), node_rank=0)[5:10] == [
        "--master_addr=127.0.0.1", "--master_port=29500", "--node_rank=0", "--enable_each_rank_log=None", "--quiet",
    ]


@pytest.mark.parametrize(("hosts", "force_multi", "no_ssh", "expected"), [
    ({"a": [0]}, False, False, False),
    ({"a": [0]}, True, False, True),
    ({"a": [0], "b": [0]}, False, False, True),
    ({"a": [0], "b": [0]}, False, True, False),
    ({"a": [0]}, True, True, False),
])
def test_needs_multinode(hosts, force_multi: bool, no_ssh: bool, expected: bool) -> None:
    assert needs_multinode(Resources.from_mapping(hosts), force_multi=force_multi, no_ssh=no_ssh) is expected


#: The user's exports with secrets among them: a password, a token, a URL with a password.
SECRETS = {"MLFLOW_TRACKING_PASSWORD": "pw \"$x\";`y` z", "HF_TOKEN": "hf_tok3n",
           "MLFLOW_TRACKING_URI": "https://bob:uripass@mlflow.example"}
WITH_SECRETS = {**EXPORTS, **SECRETS, "MLFLOW_EXPERIMENT_NAME": "gpt"}
SECRETS_FILE = "/work/job/.autotune_secrets.0123"


@pytest.mark.parametrize("name", ["pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm"])
def test_no_secret_value_is_on_a_command_line_and_each_is_named(name: str) -> None:
    spec = fixture_spec(exports=WITH_SECRETS, secrets_file=SECRETS_FILE)
    argv = get_launcher(name).command(spec)
    text = "\0".join(argv)
    assert not [value for value in ('pw "$x";`y` z', "hf_tok3n", "uripass") if value in text], argv
    names = list(SECRETS)
    named = {"pdsh": [f". {SECRETS_FILE};"], "openmpi": [word for key in names for word in ("-x", key)],
             "mpich": ["-genvlist", ",".join(names)],
             "slurm": ["--export=ALL,PYTHONPATH=/work/job,NCCL_DEBUG=INFO,MLFLOW_EXPERIMENT_NAME=gpt," + ",".join(names)]}
    named["impi"] = named["mvapich"] = named["mpich"]
    assert "\0".join(named[name]) in text, argv
    assert "MLFLOW_EXPERIMENT_NAME" in text and "gpt" in text  # what is not a secret stays as DeepSpeed puts it


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs sh")
def test_pdsh_nodes_read_the_secrets_from_the_private_file_or_stop_saying_so(tmp_path) -> None:
    secrets_file = str(tmp_path / ".autotune_secrets.x")
    spec = fixture_spec(exports=WITH_SECRETS, secrets_file=secrets_file, cwd=str(tmp_path))
    launcher = PdshLauncher()
    words = launcher.remote_words(spec)
    setup = " ".join(words[:next(i for i, word in enumerate(words) if word.startswith("cd "))])
    dump = f"{setup} {shlex.quote(sys.executable)} -c 'import json, os; print(json.dumps(dict(os.environ)))'"
    clean = {"PATH": os.environ["PATH"]}
    missing = subprocess.run(["sh", "-c", dump], capture_output=True, text=True, env=clean)
    assert missing.returncode == 2 and f"{secrets_file} is not readable on this node" in missing.stderr
    assert "HF_TOKEN" in missing.stderr and "hf_tok3n" not in missing.stderr
    write_private_file(secrets_file, private_file_exports(launcher, spec))
    assert stat.S_IMODE(os.stat(secrets_file).st_mode) == 0o600
    seen = json.loads(subprocess.run(["sh", "-c", dump], capture_output=True, text=True, env=clean, check=True).stdout)
    assert {name: seen.get(name) for name in WITH_SECRETS} == WITH_SECRETS  # every value, byte for byte
    with pytest.raises(FileExistsError):
        write_private_file(secrets_file, {"A": "1"})  # never overwritten (nor a planted link followed)


def test_only_pdsh_writes_a_private_file() -> None:
    spec = fixture_spec(exports=WITH_SECRETS, secrets_file=SECRETS_FILE)
    assert private_file_exports(PdshLauncher(), spec) == SECRETS
    assert private_file_exports(get_launcher("openmpi"), spec) == {}
    assert private_file_exports(PdshLauncher(), fixture_spec()) == {}
