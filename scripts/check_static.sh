#!/usr/bin/env bash
# The static checks `make test` runs first:
#
#   bash scripts/check_static.sh
#
# 1. lint-imports: the import contract of pyproject.toml ([tool.importlinter];
#    docs/architecture.md, "Packages and the arrows between them").
# 2. mypy over the product packages (maru_core, maru_connector, maru_sidecar,
#    maru_operator) with pyproject.toml's [tool.mypy] settings: default
#    checks everywhere, `strict` on the seam modules listed there.
# Both run even when the first fails; the exit status is non-zero when
# either found something.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# This checkout's packages, not a copy installed elsewhere.
export PYTHONPATH="$PWD/core:$PWD/connector:$PWD/sidecar:$PWD/operator:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
failed=()

echo "==> import contract (lint-imports)"
if ! "$VENV/bin/lint-imports"; then
    failed+=(imports)
    cat <<'MSG'
The import contract is broken (the lines above name each import).
  maru_core imports none of the other packages; maru_connector, maru_sidecar and
  maru_operator import only maru_core; only maru_tools may import them all, and
  no product package imports kmock. Move the shared code down into maru_core,
  or the test support up into maru_tools. The contract itself is pyproject.toml's
  [tool.importlinter]; docs/architecture.md shows it as a picture.
MSG
fi

echo "==> types (mypy)"
if ! "$VENV/bin/python" -m mypy; then
    failed+=(types)
    cat <<'MSG'
mypy found type errors (each line above names file:line and the error code).
  Fix the code or its annotations; a library without type information goes in
  pyproject.toml's ignore_missing_imports override, never a blanket ignore.
  The seam modules (the list marked "strict seam modules" in pyproject.toml)
  are checked as --strict checks them.
MSG
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "static checks failed: ${failed[*]}" >&2
    exit 1
fi
echo "static checks passed"
