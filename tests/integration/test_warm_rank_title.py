"""A rank forked from a slot's warm process (a real forkserver, `workers.warm.warm_start`) shows its whole
title in `ps`, a long one too: the title has the room of the warm process's command line only
(`workers.warm.warm_preload.take_title` keeps its environ, SPT_NOENV), and that line (multiprocessing's
forkserver command, with the preload and the worker's sys.path) is longer than a title with a cluster
host's slot, a job id, a full-mode experiment name and a two-digit rank."""
from __future__ import annotations

import uuid
from pathlib import Path

from workers.process.process_identity import RankIdentity
from workers.warm.warm_start import WarmStarts

from tests.integration.test_warm_start import _env, _launch, warm  # noqa: F401  (the warm-process fixture, shared)

LONG = RankIdentity("node-0123.cluster.example.org.gpu7", uuid.uuid4().hex, "z3_rbs5.0e+07_abs1.0e+09_tmbspg60_gas16",
                    15, 64, uuid.uuid4().hex)


def test_a_warm_ranks_long_title_reads_back_whole(warm: WarmStarts, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "rank.py"
    script.write_text("import installed_lib\nprint(open('/proc/self/cmdline').read().replace('\\0', ' '))\n")
    result, start, out, err = _launch(warm, tmp_path, script, title=LONG.title())
    assert start.path == "warm", start.why_cold
    assert result.exit_code == 0, err
    assert RankIdentity.from_title(out.strip()) == RankIdentity.from_title(LONG.title()), out
