#!/usr/bin/env bash
# Runs the connector's scheduler-level tests (vLLM's own Scheduler and config
# code driving both connector halves, in both of vLLM's call orders) against
# the Python code of another vLLM release:
#
#   bash scripts/test_vllm_release.sh [VERSION] [PYTEST ARGS ...]
#
# VERSION defaults to the pinned VLLM_RELEASE_VERSION (scripts/vllm_versions.sh).
# The release's wheel is installed without its dependencies into
# $VENV/vllm-VERSION (once) and put ahead of the CPU build on the path: its
# CUDA kernels never load, since these tests start no engine.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_versions.sh
VENV=${VENV:-.venv}
version=$VLLM_RELEASE_VERSION
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then  # a first argument that is no option: the version
    version=$1
    shift
fi
target="$VENV/vllm-$version"
VENV="$VENV" bash scripts/install_vllm_release.sh "$version"
echo "==> the connector's scheduler-level tests against vLLM $version"
# VLLM_TARGET_DEVICE: a CUDA wheel on a machine without a GPU picks no platform otherwise.
MARUCACHE_EXPECT_VLLM="$version" VLLM_TARGET_DEVICE=cpu PYTHONPATH="$target" \
    "$VENV/bin/python" -m pytest -p no:cacheprovider tests/connector tests/e2e/test_vllm_scheduler.py \
    tests/e2e/test_partial_chunk_hits.py tests/e2e/test_block_alias_hits.py "$@"
