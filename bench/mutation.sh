#!/usr/bin/env bash
# Mutation testing of the decision and safety modules (issue 15 item 3); scores go in bench/README.md.
#   bench/mutation.sh            mutmut over the modules in [tool.mutmut] (unit tests only), then the
#                                hand mutants of the Lua lease scripts, dispatch's retry cap and the
#                                stale-rank check (bench/lua_mutants.py, against tests/integration/test_leases.py)
#   bench/mutation.sh --cached   keep mutants/ from the last run (only valid if no test changed:
#                                mutmut 3.8 keeps its test-to-function map and does not see new tests)
# Needs the dev extra plus mutmut (pip install -e '.[dev,mutation]'). Runs niced: the machine is shared.
# Exit status: 0 when every hand mutant was killed (mutmut's score is reported, not gated).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MUTMUT=${MUTMUT:-$(dirname "$PY")/mutmut}
[ "${1:-}" = "--cached" ] || rm -rf mutants
mkdir -p mutants
nice -n 19 "$MUTMUT" run --max-children "${MUTATION_JOBS:-2}" >mutants/run.log 2>&1 || { tail -40 mutants/run.log; exit 2; }
"$PY" bench/mutation_scores.py
nice -n 19 "$PY" bench/lua_mutants.py
