#!/usr/bin/env bash
# Says whether a vLLM release newer than the pinned VLLM_RELEASE_VERSION exists
# and, if one does, runs the connector's scheduler-level tests against it
# (scripts/test_vllm_release.sh). Not part of `make test`: its answer changes
# with every release, and CI must stay reproducible.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_versions.sh
VENV=${VENV:-.venv}
newest=$("$VENV/bin/python" -m pip index versions vllm 2>/dev/null | sed -n 's/^vllm (\(.*\))$/\1/p')
if [ -z "$newest" ]; then
    echo "could not read vLLM's newest release from the package index" >&2
    exit 2
fi
if [ "$newest" = "$VLLM_RELEASE_VERSION" ]; then
    echo "vLLM $newest is the newest release, and the pinned one: nothing new to test"
    exit 0
fi
echo "vLLM $newest is out (pinned: $VLLM_RELEASE_VERSION); testing against it"
exec bash scripts/test_vllm_release.sh "$newest" "$@"
