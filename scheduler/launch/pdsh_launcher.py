"""pdsh: one DeepSpeed per-node launcher per host over ssh, and the secret exports' file it needs.

Differences from DeepSpeed's argv (`scheduler.launch.launchers` lists those common to all):
- the remote shell parses the command, so each word of it (user arguments, paths, export values)
  is `shlex.quote`d exactly once. DeepSpeed only wrapped arguments containing a space in double
  quotes, so `$`, backticks, `;` and `\\` acted remotely and quotes without a space broke. The
  exports word has no trailing blank and is left out when there is nothing to export. pdsh
  substitutes `%n` in the command text, so a literal `%n` in a user argument is rewritten (as in
  DeepSpeed; quoting cannot protect it).
- `--bind_cores_to_rank`/`--bind_core_list` reach the per-node launcher (DeepSpeed drops them for
  pdsh only); `--ssh_port` is appended to PDSH_SSH_ARGS_APPEND after one blank instead of a run of
  indentation blanks; no `pkill -f` kill command is built (it matches substrings on every host;
  stopping a launch is the caller's job, by process group).
- pdsh forwards no environment: each node's shell reads the secret exports from
  `spec.secrets_file`, which the caller writes (only the user can read it; `private_file_exports`)
  in the working directory every node already shares, and removes when the launch ends; a node
  that cannot read it stops with a line saying so.
"""
from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from scheduler.launch import elastic
from scheduler.launch.backend import Launcher, ToolBackend
from scheduler.launch.environment import render_exports, source_private_file
from scheduler.launch.launch_spec import LaunchSpec, per_node_command

PDSH_MAX_FAN_OUT = 1024


@dataclass(frozen=True)
class PdshLauncher(ToolBackend):
    """pdsh runs one DeepSpeed launcher per host over ssh; `%n` becomes each host's index."""

    name: ClassVar[str] = "pdsh"
    tool: ClassVar[str] = "pdsh"

    def command(self, spec: LaunchSpec) -> list[str]:
        head = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(spec.resources.hosts)]
        return [*head, *spec.launcher_arg_list(), *self.remote_words(spec)]

    def remote_words(self, spec: LaunchSpec) -> list[str]:
        """The remote command as shell words; pdsh joins them with blanks for the remote shell."""
        words = [f"source {shlex.quote(spec.venv_script)};"] if spec.venv_script is not None else []
        exports, secret = spec.split_exports()
        if spec.elastic is not None:
            exports.update(elastic.node_environment(elastic.shared_device_ids(spec.resources)))
        if exports:
            words.append(render_exports(exports))
        if secret:
            words.append(source_private_file(spec.secrets_file, list(secret)))
        words.append(f"cd {shlex.quote(spec.cwd)};")
        return words + [shlex.quote(word) for word in per_node_command(spec, "%n", self.name)]

    def remote_command(self, spec: LaunchSpec) -> str:
        """The text each host's shell parses (before pdsh replaces `%n`)."""
        return " ".join(self.remote_words(spec))

    def launch_env(self, spec: LaunchSpec, environ: Mapping[str, str]) -> dict[str, str]:
        env = {"PDSH_RCMD_TYPE": "ssh"}
        if spec.ssh_port is not None:
            existing = environ.get("PDSH_SSH_ARGS_APPEND", "")
            env["PDSH_SSH_ARGS_APPEND"] = f"{existing} -p {spec.ssh_port}".lstrip()
        return env


def private_file_exports(launcher: Launcher, spec: LaunchSpec) -> dict[str, str]:
    """What the caller writes to `spec.secrets_file` (`environment.write_private_file`) before
    running `launcher.command(spec)`: the secret exports for pdsh, nothing for the others (they take
    the secrets from the launching process's environment, which must hold `spec.split_exports()[1]`)."""
    return spec.split_exports()[1] if launcher.name == PdshLauncher.name else {}
