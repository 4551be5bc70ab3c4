"""Hand-written mutants of the lease rules that mutmut cannot mutate: the Lua scripts in
`workers/state/gang.py` (mutmut sees them as string literals, and a changed string is not a changed rule),
the retry cap in `scheduler.cluster.sweep._lose` (mutmut mutates it too, with tests/redis; kept here as
the named rule) and the stale-message check in `workers/slot/rank.py` (only exercised by an integration test).

Each mutant is one exact text replacement that breaks one safety rule. For each, the repository's
tracked files are copied to a scratch folder, the replacement is applied there (the original must
occur exactly once, so a refactor that moves the code fails loudly instead of silently testing
nothing), and the named integration test file runs against the copy. A failing run kills the
mutant; a passing run means the tests do not guard that rule. The unmutated copy runs first and
must pass, or no verdict means anything. The tests: tests/integration/test_leases.py (contention, the
stale rank) and tests/redis (every single-threaded lease rule and the retry cap).

    python bench/lua_mutants.py                          # all mutants; exit 1 if any survived
    python bench/lua_mutants.py --list                   # names and what each breaks
    python bench/lua_mutants.py --in workers/state/gang.py     # only the mutants of these files
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEASES = ("tests/integration/test_leases.py", "tests/redis")


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str  #: the rule this mutant breaks, in words
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...] = LEASES


MUTANTS = [
    Mutant("reserve_ignores_held", "reserve never sees a held slot (double booking)", "workers/state/gang.py",
           "if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end",
           "if false then return 0 end"),
    Mutant("reserve_half_on_conflict", "reserve takes the free slots before seeing a held one (not all-or-nothing)",
           "workers/state/gang.py",
           "for i = 1, #KEYS do\n  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end\nend\n"
           "for i = 1, #KEYS do\n  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])\nend",
           "for i = 1, #KEYS do\n  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end\n"
           "  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])\nend"),
    Mutant("reserve_without_lease", "reserve sets no PX expiry (a dead owner holds the slot forever)",
           "workers/state/gang.py",
           "redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])\nend\nreturn 1",
           "redis.call('SET', KEYS[i], ARGV[1])\nend\nreturn 1"),
    Mutant("release_without_token", "release frees slots it does not hold", "workers/state/gang.py",
           "if redis.call('GET', KEYS[i]) == ARGV[1] then",
           "if redis.call('GET', KEYS[i]) then"),
    Mutant("keep_without_token", "keep extends a slot another token holds", "workers/state/gang.py",
           "if holder == ARGV[1] then",
           "if holder then"),
    Mutant("keep_never_retakes", "keep never retakes a key Redis lost", "workers/state/gang.py",
           "if not holder then\n  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n  return 2\nend",
           "if not holder then\n  return 0\nend"),
    Mutant("keep_does_not_extend", "keep reports success without extending the lease", "workers/state/gang.py",
           "  redis.call('PEXPIRE', KEYS[1], ARGV[2])\n  return 1",
           "  return 1"),
    Mutant("lose_retries_forever", "a lost launch is retried forever (the attempt cap is ignored)",
           "scheduler/cluster/sweep.py",
           "if attempts < spec.max_attempts:",
           "if True:"),
    Mutant("lose_never_retries", "a lost launch is recorded lost at once (no retry)",
           "scheduler/cluster/sweep.py",
           "if attempts < spec.max_attempts:",
           "if False:"),
    Mutant("rank_runs_stale", "a redelivered rank runs although its reservation is gone", "workers/slot/rank.py",
           "if spec.gang_token and client.get(keys.gang(slot.queue)) != spec.gang_token.encode():",
           "if False:"),
]


def _copy_tree(dest: Path) -> None:
    """The tracked and non-ignored files of the working tree (what the tests see), nothing built."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[bool, float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", *tests],
                          cwd=tree, env=env, capture_output=True, text=True)
    return proc.returncode == 0, time.monotonic() - start, proc.stdout[-1500:] + proc.stderr[-1500:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--in", dest="paths", nargs="+", default=[], metavar="FILE",
                        help="only the mutants of these files (e.g. workers/state/gang.py)")
    parser.add_argument("names", nargs="*", help="only these mutants")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (not args.names or m.name in args.names) and (not args.paths or m.path in args.paths)]
    if not chosen:
        print("no hand mutants in " + ", ".join(args.paths or args.names))
        return 0
    if args.list:
        for m in chosen:
            print(f"{m.name:26} {m.path:24} {m.breaks}")
        return 0
    with tempfile.TemporaryDirectory(prefix="hand-mutants-") as scratch:
        base = Path(scratch) / "base"
        _copy_tree(base)
        for m in chosen:  # every mutant must still apply: a moved rule is a broken check, not a pass
            count = (base / m.path).read_text().count(m.original)
            if count != 1:
                print(f"ERROR {m.name}: the original text occurs {count} times in {m.path}")
                return 2
        passed, took, tail = _run_tests(base, LEASES)
        if not passed:
            print(f"ERROR the unmutated tree fails {' '.join(LEASES)}:\n{tail}")
            return 2
        print(f"unmutated: {' '.join(LEASES)} passes ({took:.1f}s)")
        survived = []
        for m in chosen:
            tree = Path(scratch) / m.name
            shutil.copytree(base, tree)
            target = tree / m.path
            target.write_text(target.read_text().replace(m.original, m.mutated))
            passed, took, _ = _run_tests(tree, m.tests)
            verdict = "SURVIVED" if passed else "killed"
            if passed:
                survived.append(m.name)
            print(f"{verdict:8} {m.name:26} {took:5.1f}s  {m.breaks}")
            shutil.rmtree(tree)
        print(f"hand mutants: {len(chosen) - len(survived)}/{len(chosen)} killed"
              + (f"; survived: {', '.join(survived)}" if survived else ""))
        return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
