#!/usr/bin/env bash
# A verified fill summed and compared in one launch, on one NVIDIA GPU (torch
# with CUDA, Triton, no vLLM), from the project root:
#
#   bash bench/verify_fused_h200.sh OUT_DIR
#
# 1. the CUDA tests of verified loads, the CUDA engine and its memory
#    -> OUT_DIR/cuda_tests.txt
# 2. verified against unverified hits of 4k and 16k tokens, both formats, in
#    the GPU harness, the comparison fused (as shipped) and, for 4k, as torch
#    operations after the sum (before, --torch-compare), in the same lease
#    -> OUT_DIR/ttft_{FORMAT}{,_torch_compare}/ and .txt
#
# Needs `sortedcontainers` for the index: bench/.site/ (see verify_h200.sh).
set -u
out=${1:?usage: verify_fused_h200.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tools:tests/connector:bench/.site
source bench/device_run.sh

gpu_info
run cuda_tests 170 python3 -m pytest --noconftest -p no:cacheprovider -m cuda -q \
    tests/connector/test_verified_transfer.py tests/connector/test_transfer_cuda.py \
    tests/connector/test_head_start_cuda.py tests/connector/test_device_memory.py
modes="sync_overlap_graphs sync_overlap_graphs_unverified"
for fmt in chunkwise layerwise; do
    run "ttft_$fmt" 150 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 --sizes 4096 16384 \
        --partial 4096 512 --modes $modes --out "$out/ttft_$fmt"
    grep '^|' "$out/ttft_$fmt.txt"
    run "ttft_${fmt}_torch_compare" 100 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 \
        --sizes 4096 --partial 4096 512 --modes $modes --torch-compare --out "$out/ttft_${fmt}_torch_compare"
    grep '^|' "$out/ttft_${fmt}_torch_compare.txt"
done
exit $failed
