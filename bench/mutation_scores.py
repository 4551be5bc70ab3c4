"""Mutation score per module from mutmut's last run (the mutants/ folder), as a Markdown table.

score = killed / (mutants that were tested): a mutant with no covering test counts as a survivor
(nothing would notice it), a timeout counts as killed (the mutant made the tests hang, which a run
would notice too), and so does a test run killed by a signal (mutmut's "segfault": exit -9 is also
how mutmut's own timeout ends a run that blocks in a system call). Run from the repository root after `mutmut run`; bench/mutation.sh does both.

    python bench/mutation_scores.py [--survivors] [MODULE.py ...]

With modules (e.g. scheduler/cluster/dispatch.py), only their rows and survivors: what `bench/mutation.sh
MODULE.py ...` ran (mutmut leaves the other modules' mutants "not checked").
"""
from __future__ import annotations

import sys
from collections import Counter

from mutmut.__main__ import SourceFileMutationData, walk_mutatable_files
from mutmut.stats import status_by_exit_code


def main() -> int:
    show_survivors = "--survivors" in sys.argv[1:]
    modules = {arg for arg in sys.argv[1:] if not arg.startswith("--")}
    rows, survivors, total = [], [], Counter()
    for path in sorted(walk_mutatable_files()):
        if modules and str(path) not in modules:
            continue
        data = SourceFileMutationData(path=path)
        data.load()
        counts = Counter(status_by_exit_code[code] for code in data.exit_code_by_key.values())
        killed = counts["killed"] + counts["timeout"] + counts["segfault"]
        tested = sum(n for status, n in counts.items() if status not in ("skipped", "not checked"))
        rows.append((str(path), tested, killed, counts["survived"], counts["no tests"], counts["not checked"]))
        total.update({"tested": tested, "killed": killed, "survived": counts["survived"],
                      "no tests": counts["no tests"], "not checked": counts["not checked"]})
        survivors += [name for name, code in data.exit_code_by_key.items()
                      if status_by_exit_code[code] in ("survived", "no tests")]
    print("| module | mutants | killed | survived | no test | score |")
    print("|---|---:|---:|---:|---:|---:|")
    for path, tested, killed, survived, untested, unchecked in rows:
        score = f"{100 * killed / tested:.1f} %" if tested else "-"
        print(f"| {path} | {tested} | {killed} | {survived} | {untested} | {score} |"
              + (f" ({unchecked} not checked)" if unchecked else ""))
    score = f"{100 * total['killed'] / total['tested']:.1f} %" if total["tested"] else "-"
    print(f"| **all** | {total['tested']} | {total['killed']} | {total['survived']} | {total['no tests']} | {score} |")
    if show_survivors:
        print()
        print("\n".join(survivors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
