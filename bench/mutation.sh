#!/usr/bin/env bash
# Mutation testing of the decision and safety modules (issue 15 item 3); scores go in bench/README.md.
#   bench/mutation.sh            mutmut over the modules in [tool.mutmut] (unit tests and tests/redis), then
#                                the hand mutants of the Lua lease scripts, dispatch's retry cap and the
#                                stale-rank check (bench/lua_mutants.py, against tests/integration/test_leases.py
#                                and tests/redis)
#   bench/mutation.sh scheduler/cluster/dispatch.py workers/state/gang.py
#                                only the mutants of these modules (each must be in only_mutate), and only
#                                the hand mutants in these files; the table has their rows only
#   bench/mutation.sh --cached   keep mutants/ from the last run (only valid if no test changed:
#                                mutmut 3.8 keeps its test-to-function map and does not see new tests)
# Needs the dev extra plus mutmut 3.x (.venv/bin/pip install 'mutmut==3.*'). Runs niced: the machine is shared
# (MUTATION_JOBS=1 on a small one). Survivors: .venv/bin/python bench/mutation_scores.py --survivors [MODULE...]
# Exit status: 0 when every hand mutant was killed (mutmut's score is reported, not gated).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MUTMUT=${MUTMUT:-$(dirname "$PY")/mutmut}
CACHED=0
MODULES=()
for arg in "$@"; do
  case "$arg" in
    --cached) CACHED=1 ;;
    -*) echo "usage: bench/mutation.sh [--cached] [MODULE.py ...]" >&2; exit 2 ;;
    *) [ -f "$arg" ] || { echo "no such module: $arg" >&2; exit 2; }; MODULES+=("$arg") ;;
  esac
done
# mutmut names a mutant <module path with dots>.x<function>__mutmut_<n>: one glob per module
GLOBS=()
for module in "${MODULES[@]}"; do
  GLOBS+=("$(echo "${module%.py}" | tr / .).x*")
done
[ "$CACHED" = 1 ] || rm -rf mutants
mkdir -p mutants
nice -n 19 "$MUTMUT" run --max-children "${MUTATION_JOBS:-2}" "${GLOBS[@]}" >mutants/run.log 2>&1 ||
  { tail -c 4000 mutants/run.log; exit 2; }
"$PY" bench/mutation_scores.py "${MODULES[@]}"
if [ "${#MODULES[@]}" -gt 0 ]; then
  nice -n 19 "$PY" bench/lua_mutants.py --in "${MODULES[@]}"
else
  nice -n 19 "$PY" bench/lua_mutants.py
fi
