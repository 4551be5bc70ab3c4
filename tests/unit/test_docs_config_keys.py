"""docs/config.md's table of `autotuning` keys is the schema's list, both ways, with the code's defaults.

Why: the table is where a user looks a key up; a key the schema accepts but the table lacks is a
feature nobody finds, and a row the schema lacks promises a key the config check refuses. The
defaults in the table are compared with what the code takes when a key is left out: the checked
`TuningConfig` and the search's `SearchSettings` built from an `autotuning` section with no keys.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from scheduler.inputs.config import parse_config
from scheduler.inputs.config_schema import KNOWN_AUTOTUNING_KEYS
from scheduler.search.session import SearchSettings

CONFIG_PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
ROW = re.compile(r"^\| `(?P<key>[a-z_]+)` \| (?P<type>[^|]+) \| (?P<default>[^|]+) \| (?P<meaning>[^|]+) \|$")


def key_table(text: str) -> dict[str, dict[str, str]]:
    """The rows of the table under "## The `autotuning` keys": key -> its type, default and meaning."""
    section = text.split("## The `autotuning` keys", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, dict[str, str]] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            assert match["key"] not in rows, f"{match['key']} has two rows"
            rows[match["key"]] = {name: match[name].strip() for name in ("type", "default", "meaning")}
    return rows


def code_defaults() -> dict[str, Any]:
    """What the code takes for each key it gives a default, read from an empty `autotuning` section."""
    cfg = parse_config({"autotuning": {}}, Path("cfg.json"), cwd=Path("/work"))
    settings = SearchSettings.from_config(cfg, capacity_bytes=16 << 30, num_nodes=1, num_gpus=1)
    return {
        "metric": cfg.metric, "results_dir": cfg.results_dir.name, "exps_dir": cfg.exps_dir.name,
        "overwrite": cfg.overwrite, "start_profile_step": cfg.start_profile_step,
        "end_profile_step": cfg.end_profile_step, "user_args": list(cfg.user_args),
        "min_train_micro_batch_size_per_gpu": settings.min_micro_batch_size,
        "max_train_micro_batch_size_per_gpu": settings.max_micro_batch_size,
        "max_train_batch_size": settings.max_train_batch_size,
        "num_tuning_micro_batch_sizes": settings.num_tuning_micro_batch_sizes, "mp_size": settings.mp_size,
        "model_info": settings.model_info, "search": settings.search, "fast": settings.fast,
        "tuner_type": settings.tuner_type, "tuner_num_trials": settings.tuner_num_trials,
        "tuner_early_stopping": settings.tuner_early_stopping, "tuner_seed": settings.tuner_seed,
        "memory_strategies": list(settings.strategy),
    }


def documented_default(cell: str) -> Any:
    """A default cell written as one JSON value in backticks (`3`, `"throughput"`, `null`)."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"default {cell!r} is not one JSON value in backticks"
    return json.loads(match[1])


def test_every_schema_key_has_a_row_and_every_row_is_a_key() -> None:
    documented = set(key_table(CONFIG_PAGE.read_text()))
    assert not KNOWN_AUTOTUNING_KEYS - documented, f"add rows to {CONFIG_PAGE.name}: {sorted(KNOWN_AUTOTUNING_KEYS - documented)}"
    assert not documented - KNOWN_AUTOTUNING_KEYS, f"rows for keys the schema refuses: {sorted(documented - KNOWN_AUTOTUNING_KEYS)}"


def test_each_documented_default_is_the_codes() -> None:
    rows = key_table(CONFIG_PAGE.read_text())
    defaults = code_defaults()
    assert set(defaults) <= set(rows)
    wrong = {key: (rows[key]["default"], value) for key, value in defaults.items()
             if documented_default(rows[key]["default"]) != value}
    assert not wrong, f"documented default vs the code's: {wrong}"


def test_every_row_says_its_type_and_meaning() -> None:
    for key, row in key_table(CONFIG_PAGE.read_text()).items():
        assert row["type"] and row["meaning"] and row["default"], key


def test_the_checks_see_a_missing_row_an_extra_row_and_a_wrong_default() -> None:
    text = CONFIG_PAGE.read_text()
    assert "tuner_seed" in key_table(text)
    without = "\n".join(line for line in text.splitlines() if not line.startswith("| `tuner_seed` |"))
    assert "tuner_seed" in KNOWN_AUTOTUNING_KEYS - set(key_table(without))
    extra = text.replace("| `nvme_path` |", "| `nvme_dir` | path | none | made up |\n| `nvme_path` |", 1)
    assert "nvme_dir" in set(key_table(extra)) - KNOWN_AUTOTUNING_KEYS
    changed = key_table(text.replace("| `tuner_num_trials` | integer 1-10000 | `50` |",
                                     "| `tuner_num_trials` | integer 1-10000 | `40` |", 1))
    assert documented_default(changed["tuner_num_trials"]["default"]) != code_defaults()["tuner_num_trials"]
