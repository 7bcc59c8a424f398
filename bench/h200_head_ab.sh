#!/usr/bin/env bash
# Partial hits of up to 4k tokens: does issuing only a load's head on the
# engine thread, when the forward computes much beside it, shorten TTFT?
# Alternates the engine as shipped with the one before (the whole load
# issued there, --whole-inline-beside-forward), ROUNDS times, then runs the
# CUDA tests (run from the project root on the GPU machine):
#
#   bash bench/h200_head_ab.sh OUT_DIR [ROUNDS]
set -u
out=${1:?usage: h200_head_ab.sh OUT_DIR [ROUNDS]}
rounds=${2:-3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tests/connector
for r in $(seq 1 "$rounds"); do
    for variant in whole head; do
        flag=""
        [ "$variant" = whole ] && flag=--whole-inline-beside-forward
        timeout 240 python3 bench/ttft_gpu.py --repeats 5 --sizes 4096 --partial 4096 512 \
            --store-size 4096 --concurrent-size 4096 --concurrency 1 \
            --modes sync sync_overlap_graphs async_overlap_graphs \
            --timeline 4096+512/sync_overlap_graphs $flag \
            --out "$out/ttft_${variant}_r$r" >"$out/ttft_${variant}_r$r.txt" 2>&1 \
            || echo "!! ttft $variant r$r failed"
        echo "== $variant, round $r"
        grep -E "^\| *4096|phases" "$out/ttft_${variant}_r$r.txt" | head -8
    done
done
timeout 240 python3 -m pytest --noconftest -p no:cacheprovider -m cuda -q \
    tests/connector/test_transfer_cuda.py tests/connector/test_graph_pieces_cuda.py >"$out/cuda_tests.txt" 2>&1
tail -3 "$out/cuda_tests.txt"
