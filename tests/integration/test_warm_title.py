"""A slot's warm process (`workers.warm.warm_start`, a real forkserver) names itself in `ps` as its ranks
do (`workers.warm.warm_preload.title`): `autotune warm slot=<slot>`, which no check takes for a rank's
title, while its /proc environ, where a forked rank's leftovers are found by their launch's token,
stays as it started."""
from __future__ import annotations

from pathlib import Path

import psutil

from workers.process.launch import CONTAINER_ENV
from workers.process.process_identity import RankIdentity
from workers.warm.warm_server import shows_warm
from workers.warm.warm_start import WarmStarts

from tests.integration.test_warm_start import _env, _launch, warm  # noqa: F401  (the warm-process fixture, shared)


def test_the_warm_process_names_its_slot(warm: WarmStarts, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "rank.py"
    script.write_text("import installed_lib, os\nprint(os.getppid())\n")  # the warm process forked it
    env = _env(tmp_path)
    env.pop("SPT_NOENV", None)  # as a slot worker started without it: the warm process keeps its environ itself
    result, start, out, err = _launch(warm, tmp_path, script, env=env)
    assert start.path == "warm", start.why_cold
    assert result.exit_code == 0, err
    server = psutil.Process(int(out.strip()))
    shown = " ".join(server.cmdline()).strip()
    assert shown == "autotune warm slot=test.gpu0"  # AUTOTUNE_SLOT of the fixture's environment
    assert shows_warm(shown) and RankIdentity.from_title(shown) is None
    assert CONTAINER_ENV in server.environ(), "the warm process's /proc environ was overwritten by its title"
