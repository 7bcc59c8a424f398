#!/usr/bin/env bash
# Installs one vLLM release's Python code, without its dependencies, into
# $VENV/vllm-VERSION (once): what the scheduler-level tests need of it.
#
#   bash scripts/install_vllm_release.sh VERSION
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
version=${1:?usage: install_vllm_release.sh VERSION}
target="$VENV/vllm-$version"
[ -f "$target/.installed" ] && exit 0
echo "==> installing vLLM $version's Python code into $target (no dependencies)"
rm -rf "$target"
"$VENV/bin/python" -m pip install -q --no-deps --no-compile --target "$target" "vllm==$version" \
    2> >(grep -v "is ignored: it is neither" >&2)
touch "$target/.installed"
