"""The winner's curse on one stage: a script whose readings of one ZeRO stage are noisy and often
lucky, where that stage is not the best. Does a search crown a lucky reading?

Why: on a held-out script with one such stage, a pick came out at 0.68 of the optimum in one of
three runs (the stage's lucky readings beat a better stage's honest ones). This bench draws that
script from bench/surfaces.py's families: the surface's own readings everywhere, except that every
reading of the `--stage` (default: the best stage's runner-up, the stage whose best config is
closest to the optimum without being it) is lucky with probability `--rate` (throughput x
U(1.3, 1.8)), on top of a per-config noise of 2-8 %. Per family it prints, for ours and DeepSpeed's
replay, the median and lowest fraction of the optimum over `--runs` scripts, and how many picks fell
below 0.9 (the goal: none).

    .venv/bin/python bench/lucky_stage.py [--runs 20] [--seed 0] [--rate 0.3] [--family monotone]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.search_quality import deepspeed, ours  # noqa: E402
from bench.surfaces import FAMILIES, Surface, _stream, make_surface  # noqa: E402


@dataclass(frozen=True)
class LuckyStage(Surface):
    """A surface whose readings of `lucky_stage` are lucky with probability `lucky_rate`."""

    lucky_stage: int = 2
    lucky_rate: float = 0.3

    def reading_factor(self, name: str, stage: int, mbs: int, gas: int) -> float:
        factor = super().reading_factor(name, stage, mbs, gas)
        if stage != self.lucky_stage:
            return factor
        draw = _stream(f"{self.seed}:{name}:lucky")
        return factor * draw.uniform(1.3, 1.8) if draw.random() < self.lucky_rate else factor


def runner_up_stage(surface: Surface) -> int | None:
    """The stage, other than the optimum's, whose best config comes closest to the optimum."""
    best = {stage: max((surface.throughput(stage, m, g) for m, g in surface.space(stage)), default=0.0)
            for stage in range(4)}
    winner = max(best, key=best.get)
    others = [s for s in best if s != winner and best[s] > 0]
    return max(others, key=best.get) if others else None


def lucky(family: str, seed: int, rate: float) -> LuckyStage | None:
    surface = make_surface(family, seed)
    stage = runner_up_stage(surface)
    if stage is None:
        return None
    fields = {name: getattr(surface, name) for name in surface.__dataclass_fields__}
    return replace(LuckyStage(**fields), lucky_stage=stage, lucky_rate=rate, noise_spread=4.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="scripts per family (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.3, help="share of the stage's readings that are lucky")
    parser.add_argument("--family", choices=FAMILIES, action="append")
    args = parser.parse_args()
    print(f"LUCKY STAGE: {args.runs} scripts per family (seeds {args.seed}..), the runner-up stage's readings "
          f"lucky (x1.3-1.8) with probability {args.rate}, per-config noise 2-8 %")
    print(f"{'family':<13}{'search':<11}{'frac med':>9}{'frac min':>9}{'< 0.9':>7}{'launch med':>11}")
    for family in args.family or FAMILIES:
        surfaces = [s for s in (lucky(family, seed, args.rate) for seed in range(args.seed, args.seed + args.runs))
                    if s is not None]
        for label, search in (("ours", ours), ("DeepSpeed", deepspeed)):
            outcomes = [search(surface) for surface in surfaces]
            fractions = [o.fraction for o in outcomes]
            print(f"{family:<13}{label:<11}{statistics.median(fractions):>9.3f}{min(fractions):>9.3f}"
                  f"{sum(f < 0.9 for f in fractions):>7}{statistics.median(o.launches for o in outcomes):>11.1f}")


if __name__ == "__main__":
    main()
