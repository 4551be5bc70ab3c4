"""docs/command.md documents every option of every command, and names no long option none of them has.

Why: the page is the reference a user reads instead of `--help`; an option added to a parser without
a line there is one nobody finds, and a documented option no parser has fails the user's command.
The parsers are the commands' own: built by their builders, or, for the two commands that build
theirs inside `main` (`deploy.templates`, `deploy.remote`), caught as `main` parses.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import deploy.remote
import deploy.templates
from deploy.__main__ import build_parser as deploy_parser
from scheduler import autotune, resources
from scheduler.cli import build_parser as cli_parser
from scheduler.run import build_parser as run_parser

COMMAND_PAGE = Path(__file__).resolve().parents[2] / "docs" / "command.md"
#: Long options command.md names that are not ours, each for a reason the page gives: the training
#: script's own flags (the config argument, the local rank, Hugging Face's flags), and DeepSpeed's
#: launcher flags `scheduler.run` does not offer.
NOT_OURS = frozenset({
    "--deepspeed_config", "--deepspeed", "--local_rank",
    "--module", "--no_python", "--no_ssh", "--node_rank", "--force_multi", "--save_pid",
    "--enable_each_rank_log", "--bind_cores_to_rank", "--bind_core_list", "--venv_script", "--ssh_port",
    "--quiet",
})
LONG_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def caught_parser(main: Callable[[list[str]], object], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `main` builds, taken when it parses (nothing of the command runs)."""
    def parse(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Caught(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(_Caught) as caught:
        main([])
    monkeypatch.undo()
    return caught.value.parser


def autotune_parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    return caught_parser(lambda argv: autotune.parse_args(argv), monkeypatch)


def all_parsers(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    return {
        "python -m scheduler.autotune": autotune_parser(monkeypatch),
        "celery-autotune": cli_parser(),
        "python -m scheduler.run": run_parser(),
        "python -m scheduler.resources": resources._build_parser(),
        "python -m deploy": deploy_parser(),
        "python -m deploy.templates": caught_parser(deploy.templates.main, monkeypatch),
        "python -m deploy.remote": caught_parser(deploy.remote.main, monkeypatch),
    }


def option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every option string of the parser and of its subcommands' parsers."""
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from option_strings(sub)


def undocumented(text: str, options: set[str]) -> set[str]:
    """The options the page never names as a word of their own (`--num_gpus`, not `--num_gpus_x`)."""
    return {option for option in options if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text)}


def test_every_option_of_every_command_is_on_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    text = COMMAND_PAGE.read_text()
    missing = {name: sorted(undocumented(text, set(option_strings(parser))))
               for name, parser in all_parsers(monkeypatch).items()}
    missing = {name: options for name, options in missing.items() if options}
    assert not missing, f"document these in {COMMAND_PAGE.name}: {missing}"


def test_every_documented_long_option_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = {option for parser in all_parsers(monkeypatch).values() for option in option_strings(parser)}
    assert not NOT_OURS & ours, f"these are ours, drop them from NOT_OURS: {sorted(NOT_OURS & ours)}"
    named = set(LONG_OPTION.findall(COMMAND_PAGE.read_text()))
    unknown = named - ours - NOT_OURS
    assert not unknown, f"{COMMAND_PAGE.name} names options no command has: {sorted(unknown)}"


def test_the_parsers_are_the_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    parsers = all_parsers(monkeypatch)
    assert {"--exp-timeout", "--status", "--run"} <= set(option_strings(parsers["python -m scheduler.autotune"]))
    assert {"--env-file", "--gpus-per-node"} <= set(option_strings(parsers["python -m deploy.templates"]))
    assert {"--node", "--run-dir", "--grace"} <= set(option_strings(parsers["python -m deploy.remote"]))


def test_the_checks_see_a_missing_option_and_an_invented_one(monkeypatch: pytest.MonkeyPatch) -> None:
    text = COMMAND_PAGE.read_text()
    assert not undocumented(text, {"--deadline"})
    assert undocumented(text.replace("--deadline", "--dead-line"), {"--deadline"}) == {"--deadline"}
    assert "--exp-timeout-s" in LONG_OPTION.findall(text + " `--exp-timeout-s 60`")
