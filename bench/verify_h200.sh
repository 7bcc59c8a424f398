#!/usr/bin/env bash
# Verified loads on the GPU, in one go (run from the project root on a machine
# with one NVIDIA GPU, torch with CUDA, Triton, no vLLM):
#
#   bash bench/verify_h200.sh OUT_DIR [fused-ab|group-ab|direct-ab|batch-ab|ahead-ab|paired-ab]
#
# 1. the CUDA tests of verified loads, of the CUDA engine and of its memory
#    (test_verified_transfer.py -m cuda, test_transfer_cuda.py,
#    test_head_start_cuda.py, test_device_memory.py, test_partial_chunk_load.py)
#    -> OUT_DIR/cuda_tests.txt
# 2. the checksum kernel's cost per GB against the pinned copy of the same
#    bytes (bench/checksum_gpu.py) -> OUT_DIR/checksum_gpu.json
# 3. verified against unverified hits of 4k, 16k and 32k tokens, both formats,
#    sync and overlapped, in the GPU harness (bench/ttft_gpu.py)
#    -> OUT_DIR/ttft_{chunkwise,layerwise}/ and .txt
#
# With `fused-ab`, steps 2 and 3 make way for the A/B of a verified fill's sum
# and comparison in one launch (as shipped) against the comparison as torch
# operations after the sum (before, --torch-compare), in the same lease:
# verified against unverified 4k and 16k hits (4k only for the before), both
# formats, 7 repeats -> OUT_DIR/ttft_{FORMAT}{,_torch_compare}/ and .txt.
#
# With `group-ab`, steps 2 and 3 make way for the A/B of 4k-token hits'
# layers loaded in groups (--group-below-mib 32: fills of 1, 2, 4, 4, ...
# layers, 10 fills instead of 32) against one fill per layer (as shipped),
# verified and unverified, both formats, 7 repeats (GROUP_AB_ROUNDS rounds,
# alternating, default 1), after the issuing
# functions' host time in the harness (bench/verify_issue_cost.py).
#
# With `direct-ab`, steps 2 and 3 make way for the A/B of the checksum
# kernel launched through the CUDA driver directly (as shipped) against
# Triton's launcher (before, --triton-launch): the launches' host time
# (bench/verify_issue_cost.py launches), the issuing functions' host time in
# the harness, then verified against unverified 4k (and, in round 1, 16k)
# hits, both formats, 7 repeats, two rounds, the two launches alternating.
#
# With `batch-ab`, steps 2 and 3 make way for the A/B of a verified load's
# fills of single layers summed in batches, one launch each (as shipped),
# against one launch per fill (before, --no-sum-batches): verified against
# unverified 4k and 4k + 512 hits, both formats, 7 repeats, two rounds
# (16 MiB layers: 32 fills, in batches of 4; 16k hits' 64 MiB layers are
# one batch each, so they do not change).
#
# With `ahead-ab`, steps 2 and 3 make way for the A/B of the engine's
# COPIES_AHEAD at $AHEAD_AB_ARM (default 2, as shipped: a fill's scatter is
# queued once the copies of three later fills are) against 0 (before: once
# one is): verified against unverified 4k and 4k + 512 hits, both formats
# ($AHEAD_AB_FORMATS), 15 repeats, the arms' order swapped in the second
# round ($AHEAD_AB_ROUNDS: which rounds).
#
# With `paired-ab`, steps 2 and 3 make way for verified against unverified
# hits served in turn (bench/ttft_gpu.py --paired): 4k and 4k + 512 hits,
# both formats ($PAIRED_FORMATS), each mode in each arm of $PAIRED_ARMS
# (settings of the engine's knobs, default "COPIES_AHEAD=2 COPIES_AHEAD=4"),
# one hit of each per round for
# $PAIRED_ROUNDS rounds (default 41), the order rotated every round; the
# cost is the median of the per-round ratios, so a host's drift between
# runs (round 9's hosts moved 2 ms between runs of the same code) cancels.
# First the check state's host staging, the two ways (bench/check_state_alloc.py).
#
# The index (step 3) needs `sortedcontainers` (pure Python): where it is not
# installed, put a copy of the package in bench/.site/ (git ignores it). The
# connector needs no xxhash (only entries of older writers use it), the CUDA
# tests no hypothesis. About 6 minutes in all; each step has its own time
# limit, and a step that fails does not stop the others (the exit code says).
set -u
out=${1:?usage: verify_h200.sh OUT_DIR [fused-ab|group-ab|direct-ab|batch-ab|ahead-ab|paired-ab]}
mode=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tools:tests/connector:bench/.site
source bench/device_run.sh

gpu_info
if [ -z "${SKIP_CUDA_TESTS:-}" ]; then  # set: they ran in this lease already (bench/run_h200.sh cuda-tests)
    run cuda_tests 300 python3 -m pytest --noconftest -p no:cacheprovider -m cuda -q \
        tests/connector/test_verified_transfer.py tests/connector/test_transfer_cuda.py \
        tests/connector/test_head_start_cuda.py tests/connector/test_device_memory.py \
        tests/connector/test_partial_chunk_load.py
fi
if [ "$mode" = group-ab ]; then
    for group in 8 32; do
        run "issue_cost_group$group" 90 python3 bench/verify_issue_cost.py harness --formats chunkwise \
            --repeats 5 --sizes 4096 --partial 4096 512 --modes sync_overlap_graphs --group-below-mib "$group"
        grep 'issue cost' "$out/issue_cost_group$group.txt"
    done
    ab="sync_overlap_graphs sync_overlap_graphs_unverified"
    for round in $(seq "${GROUP_AB_ROUNDS:-1}"); do
        for fmt in chunkwise layerwise; do
            for group in 8 32; do
                name="ttft_${fmt}_group${group}_$round"
                run "$name" 100 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 --sizes 4096 \
                    --partial 4096 512 --modes $ab --group-below-mib "$group" --out "$out/$name"
                grep '^|' "$out/$name.txt"
            done
        done
    done
    exit $failed
fi
if [ "$mode" = paired-ab ]; then
    run check_state_alloc 60 python3 bench/check_state_alloc.py
    cat "$out/check_state_alloc.txt"
    for fmt in ${PAIRED_FORMATS:-chunkwise layerwise}; do
        name="ttft_${fmt}_paired"
        run "$name" 300 python3 bench/ttft_gpu.py --paired --formats "$fmt" --repeats "${PAIRED_ROUNDS:-41}" \
            --sizes 4096 --partial 4096 512 --modes sync_overlap_graphs sync_overlap_graphs_unverified \
            --arms ${PAIRED_ARMS:-COPIES_AHEAD=2 COPIES_AHEAD=4} --store-size 4096 --concurrent-size 4096 --concurrency 1 \
            --out "$out/$name"
        grep 'twin\|^| 4096' "$out/$name.txt"
    done
    exit $failed
fi
if [ "$mode" = ahead-ab ]; then
    ab="sync_overlap_graphs sync_overlap_graphs_unverified"
    for round in ${AHEAD_AB_ROUNDS:-1 2}; do
        for fmt in ${AHEAD_AB_FORMATS:-chunkwise layerwise}; do
            new=${AHEAD_AB_ARM:-2}
            arms=$([ $((round % 2)) = 1 ] && echo "$new 0" || echo "0 $new")
            for ahead in $arms; do
                name="ttft_${fmt}_ahead${ahead}_$round"
                run "$name" 120 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 15 --sizes 4096 \
                    --partial 4096 512 --modes $ab --copies-ahead "$ahead" --out "$out/$name"
                grep '^| 4096' "$out/$name.txt"
            done
        done
    done
    exit $failed
fi
if [ "$mode" = batch-ab ]; then
    ab="sync_overlap_graphs sync_overlap_graphs_unverified"
    for round in 1 2; do
        for fmt in chunkwise layerwise; do
            for batches in on off; do
                name="ttft_${fmt}_batches_${batches}_$round"
                flag=$([ "$batches" = off ] && echo --no-sum-batches)
                run "$name" 100 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 --sizes 4096 \
                    --partial 4096 512 --modes $ab $flag --out "$out/$name"
                grep '^| 4096' "$out/$name.txt"
            done
        done
    done
    exit $failed
fi
if [ "$mode" = direct-ab ]; then
    run launches 90 python3 bench/verify_issue_cost.py launches
    grep 'host per call\|through the driver:' "$out/launches.txt"
    for launch in direct triton; do
        flag=$([ "$launch" = triton ] && echo --triton-launch)
        run "issue_cost_$launch" 90 python3 bench/verify_issue_cost.py harness --formats chunkwise --repeats 5 \
            --sizes 4096 --partial 4096 512 --modes sync_overlap_graphs $flag
        grep 'issue cost' "$out/issue_cost_$launch.txt"
    done
    ab="sync_overlap_graphs sync_overlap_graphs_unverified"
    for round in 1 2; do
        sizes=$([ "$round" = 1 ] && echo "4096 16384" || echo 4096)
        for fmt in chunkwise layerwise; do
            for launch in direct triton; do
                name="ttft_${fmt}_${launch}_$round"
                flag=$([ "$launch" = triton ] && echo --triton-launch)
                run "$name" 150 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 --sizes $sizes \
                    --partial 4096 512 --modes $ab $flag --out "$out/$name"
                grep '^|' "$out/$name.txt"
            done
        done
    done
    exit $failed
fi
if [ "$mode" = fused-ab ]; then
    ab="sync_overlap_graphs sync_overlap_graphs_unverified"
    for fmt in chunkwise layerwise; do
        run "ttft_$fmt" 150 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 --sizes 4096 16384 \
            --partial 4096 512 --modes $ab --out "$out/ttft_$fmt"
        grep '^|' "$out/ttft_$fmt.txt"
        run "ttft_${fmt}_torch_compare" 100 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 7 \
            --sizes 4096 --partial 4096 512 --modes $ab --torch-compare --out "$out/ttft_${fmt}_torch_compare"
        grep '^|' "$out/ttft_${fmt}_torch_compare.txt"
    done
    exit $failed
fi
run checksum_gpu 40 python3 bench/checksum_gpu.py --gib 2 --out "$out/checksum_gpu.json"
for fmt in chunkwise layerwise; do
    run "ttft_$fmt" 140 python3 bench/ttft_gpu.py --formats "$fmt" --repeats 3 --sizes 4096 16384 32768 \
        --partial 4096 512 --store-size 4096 --concurrent-size 4096 --concurrency 1 \
        --modes sync sync_unverified sync_overlap_graphs sync_overlap_graphs_unverified \
        --out "$out/ttft_$fmt"
    grep '^|' "$out/ttft_$fmt.txt"
done
exit $failed
