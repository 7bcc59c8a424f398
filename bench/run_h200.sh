#!/usr/bin/env bash
# The GPU measurements of bench/RESULTS.md in one go, on a machine with one
# NVIDIA GPU, torch with CUDA and no vLLM (run from the project root):
#
#   bash bench/run_h200.sh OUT_DIR [STAGE ...]
#
# Stages (all by default): cuda-tests, transfer, profile, ttft. Each writes
# into OUT_DIR and prints its summary; a stage that fails does not stop the
# others (the script exits non-zero at the end).
#
# Last run: the final tree's cuda-tests stage on an H100 (bench/RESULTS.md:
# "CUDA tests"); before it ("Round 14"), two H100 leases,
#   bash bench/run_h200.sh OUT cuda-tests
#   python3 bench/handover_probe.py --probe-out OUT/FMT -- --paired --formats FMT \
#     --sizes 4096 --partial 4096 512 --modes sync_overlap_graphs \
#     sync_overlap_graphs_unverified --store-size 4096 --concurrent-size 4096 \
#     --concurrency 1 --repeats 41 --arms KNOB=0 KNOB=1
# Next lease: on an H200 (last lent in round 9) the final tree's CUDA
# tests and verified-load figures, so they stand on the card the targets
# name: the cuda-tests stage, then
#   SKIP_CUDA_TESTS=1 PAIRED_ROUNDS=25 PAIRED_ARMS="COPIES_AHEAD=2" bash bench/verify_h200.sh OUT paired-ab
#   python3 bench/ttft_gpu.py --paired --formats chunkwise layerwise --sizes 16384 32768 \
#     --modes sync_overlap_graphs sync_overlap_graphs_unverified --repeats 21 \
#     --store-size 4096 --concurrent-size 4096 --concurrency 1
set -u
out=${1:?usage: run_h200.sh OUT_DIR [STAGE ...]}
shift
stages=${*:-cuda-tests transfer profile ttft}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tools:tests/connector
source bench/device_run.sh

gpu_info
for stage in $stages; do
    case $stage in
    cuda-tests)
        run cuda_tests 180 python3 -m pytest --noconftest -p no:cacheprovider -m cuda -q \
            tests/connector/test_transfer_cuda.py tests/connector/test_head_start_cuda.py \
            tests/connector/test_graph_pieces_cuda.py tests/connector/test_llama_layer.py \
            tests/connector/test_verified_transfer.py tests/connector/test_partial_chunk_load.py \
            tests/connector/test_device_memory.py
        tail -1 "$out/cuda_tests.txt" ;;
    transfer)
        for shape in "1024 32" "1024 80" "4096 32" "16384 32"; do
            set -- $shape
            run "transfer_$1_$2" 120 python3 bench/transfer_gpu.py --tokens "$1" --layers "$2" \
                --out "$out/transfer_$1_$2.json"
            python3 - "$out/transfer_$1_$2.json" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
peak = d["pinned_peak_gbps"]
a = d["args"]
print(f"{a['tokens']} tokens, {a['layers']} layers: load / pinned peak",
      {k: round(v["ratio_to_pinned_peak"], 3) for k, v in d["formats"].items()},
      "concurrent (chunkwise)",
      {k: round(v["aggregate_gbps"] / peak, 3) for k, v in d["concurrency_chunkwise"].items()})
EOF
        done ;;
    profile)
        run profile_1k 60 python3 bench/profile_load.py --tokens 1024
        run profile_1k_concurrent8 60 python3 bench/profile_load.py --tokens 1024 --concurrent 8
        head -1 "$out/profile_1k.txt" "$out/profile_1k_concurrent8.txt" ;;
    ttft)
        run ttft 420 python3 bench/ttft_gpu.py --repeats 3 --sizes 4096 16384 32768 \
            --modes sync sync_overlap async_overlap sync_overlap_graphs async_overlap_graphs \
            --concurrency 1 8 \
            --timeline 4096/sync 4096/sync_overlap_graphs 4096/async_overlap_graphs \
            16384+2048/sync_overlap_graphs --out "$out/ttft"
        grep -v '^\[' "$out/ttft.txt" | grep -v -i warn | tail -40
        grep 'phases' -B1 "$out/ttft.txt" ;;
    *)
        echo "unknown stage $stage"
        failed=1 ;;
    esac
done
exit $failed
