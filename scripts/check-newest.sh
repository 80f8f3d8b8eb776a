#!/usr/bin/env bash
# Builds a fresh environment with the newest versions pyproject.toml allows (ignoring constraints.txt),
# runs the test suite and the import contracts in it, and writes what it installed as a proposed
# constraints file beside a diff against the locked one. Not run in CI: an upgrade is a decision that a
# person commits (copy the proposal over constraints.txt once the suite passes).
#   usage: bash scripts/check-newest.sh OUT_DIR      (OUT_DIR must not exist; it is created)
#   TORCH_SPEC (default torch==2.13.0+cpu, the CPU build this project's CPU machines install; a plain
#   newer torch pulls a CUDA build of several GB) and PYTHON (default python3) choose the rest.
set -euo pipefail
if [ $# -ne 1 ]; then echo "usage: bash scripts/check-newest.sh OUT_DIR" >&2; exit 2; fi
out=$1
if [ -e "$out" ]; then echo "check-newest: $out already exists; give a new folder (nothing is overwritten)" >&2; exit 2; fi
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
"${PYTHON:-python3}" -m venv "$out/venv"
py="$out/venv/bin/python"
cd "$repo"
# An empty constraints file in place of the locked one (and of any the machine's pip configuration
# names): the point is what pyproject.toml's ranges resolve to today.
PIP_CONSTRAINT=/dev/null "$py" -m pip install -q "${TORCH_SPEC:-torch==2.13.0+cpu}" -e ".[dev]" 2>&1 \
  | tee "$out/install.log"
"$py" -m pip freeze --exclude-editable | grep -v '^xstage' > "$out/installed.txt"
{ sed -n '/^#/p' constraints.txt; cat "$out/installed.txt"; } > "$out/constraints.proposed.txt"
diff <(grep -v '^#' constraints.txt | sort -f) <(sort -f "$out/installed.txt") > "$out/constraints.diff" || true
set +e
"$py" -m pytest -q -n auto -p no:cacheprovider 2>&1 | tee "$out/pytest.log"
rc_tests=${PIPESTATUS[0]}
(cd "$repo" && "$out/venv/bin/lint-imports") 2>&1 | tee "$out/lint-imports.log"
rc_lint=${PIPESTATUS[0]}
set -e
echo
echo "changed versions (< locked, > newest):"
cat "$out/constraints.diff"
echo "tests: exit $rc_tests; import contracts: exit $rc_lint; proposal: $out/constraints.proposed.txt"
[ "$rc_tests" -eq 0 ] && [ "$rc_lint" -eq 0 ]
