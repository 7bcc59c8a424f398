#!/usr/bin/env bash
# bench/ttft_async.py on two connectors, alternating run by run, so both see
# the same machine (run from the repository root):
#
#   bash bench/ab_ttft_async.sh BASE_REV OUT_PREFIX [ROUNDS] -- [ttft_async.py args]
#
# "base" runs the connector package of commit BASE_REV (extracted with git
# archive into a temporary directory, ahead of the tree's on PYTHONPATH),
# "head" the working tree's; everything else (core, the benchmark, vLLM) is
# the working tree's. Round i writes OUT_PREFIX_{head,base}i.{md,json,jsonl}
# (the .jsonl a trace for bench/trace_phases.py). Example, 2 rounds:
#
#   bash bench/ab_ttft_async.sh HEAD~1 out/ab 2 -- --formats chunkwise --mp off \
#       --sizes 1024 4096 --concurrent 0 --repeats 5 --release-after 0
set -eu
base_rev=${1:?usage: ab_ttft_async.sh BASE_REV OUT_PREFIX [ROUNDS] -- [ttft_async.py args]}
prefix=${2:?usage: ab_ttft_async.sh BASE_REV OUT_PREFIX [ROUNDS] -- [ttft_async.py args]}
shift 2
rounds=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] && shift
root=$(pwd)
base_dir=$(mktemp -d)
trap 'rm -rf "$base_dir"' EXIT
git archive "$base_rev" connector/maru_connector | tar -x -C "$base_dir"
mkdir -p "$(dirname "$prefix")"
for round in $(seq "$rounds"); do
    for side in head base; do
        connector=$root/connector
        [ "$side" = base ] && connector=$base_dir/connector
        out=${prefix}_$side$round
        rm -f "$out.jsonl"
        echo "== round $round, $side ($(date +%T))"
        PYTHONPATH=$connector:$root/core:$root/tools .venv/bin/python bench/ttft_async.py "$@" \
            --trace "$out.jsonl" --json "$out.json" >"$out.md" 2>&1
    done
done
