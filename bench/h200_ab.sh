#!/usr/bin/env bash
# A/B runs of the GPU harness on the H200, one engine variant against the
# other, alternating, ROUNDS times (run from the project root on the GPU
# machine):
#
#   bash bench/h200_ab.sh EXPERIMENT OUT_DIR [ROUNDS]
#
# EXPERIMENT:
#   group  4k-token hits with their 16 MiB layers loaded one per fill (as
#          shipped, 8 MiB threshold) or in groups (32 MiB); also the load alone.
#   head   a 4k + 512 partial hit's load issued whole on the engine thread
#          (the engine before) or only its head (as shipped); then the CUDA tests.
#   fullhead  full hits' loads issued whole on the engine thread (as shipped) or
#          only their head, the rest on the copy thread; then the CUDA tests.
#   early  1k, 4k and 16k hits whose worker retrieves (pins) the load itself
#          (the connector before) or copies under the pins its lookup took
#          (as shipped); then the CUDA tests.
#   prefix 1k, 4k and 16k hits whose lookup pins in a second round trip (a
#          match_prefix, then a retrieve: the connector before) or in the
#          same one (retrieve_prefix, as shipped); then the CUDA tests.
#   attention  1k, 4k and 16k hits with the stand-in's attention as one flash
#          kernel per request (before) or one per layer for the whole batch
#          (as shipped); then the CUDA tests.
#   weights  1k, 4k and 16k hits with the stand-in's projections as x @ w over
#          [in, out] weights (before) or F.linear over [out, in] (as shipped);
#          then the CUDA tests.
#   headstart 4k and 16k hits whose copies start when the load is submitted
#          (the connector before) or, their first 64 MiB, when the lookup
#          answers (a head start, as shipped); then the CUDA tests.
set -u
usage="usage: h200_ab.sh group|head|fullhead|early|prefix|attention|weights|headstart OUT_DIR [ROUNDS]"
experiment=${1:?$usage}
out=${2:?$usage}
rounds=${3:-3}
sizes=4096
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tools:tests/connector
case $experiment in
group) variants="g8:--group-below-mib=8 g32:--group-below-mib=32"; timed=4096/sync_overlap_graphs ;;
head) variants="whole:--whole-inline-beside-forward head:"; timed=4096+512/sync_overlap_graphs ;;
fullhead) variants="whole: head:--head-only-inline"; timed=4096/sync_overlap_graphs ;;
early) variants="worker:--no-early-pins early:"; timed="1024/sync_overlap_graphs 4096/sync_overlap_graphs"
       sizes="1024 4096 16384" ;;
prefix) variants="twort:--two-round-trip-pins onert:"; timed="1024/sync_overlap_graphs 4096/sync_overlap_graphs"
       sizes="1024 4096 16384" ;;
attention) variants="perreq:--attention=per-request varlen:"
       timed="1024/sync_overlap_graphs 4096/sync_overlap_graphs" sizes="1024 4096 16384" ;;
weights) variants="inout:--weights=in-out outin:"
       timed="1024/sync_overlap_graphs 4096/sync_overlap_graphs" sizes="1024 4096 16384" ;;
headstart) variants="submit:--head-start-mib=0 lookup:"; timed="4096/sync_overlap_graphs 16384/sync_overlap_graphs"
       sizes="4096 16384" ;;
*) echo "unknown experiment $experiment" >&2; exit 2 ;;
esac
for r in $(seq 1 "$rounds"); do
    for variant in $variants; do
        name=${variant%%:*} flag=${variant#*:}
        timeout 240 python3 bench/ttft_gpu.py --repeats 5 --sizes $sizes --partial 4096 512 \
            --store-size 4096 --concurrent-size 4096 --concurrency 1 \
            --modes sync sync_overlap_graphs async_overlap_graphs --timeline $timed $flag \
            --out "$out/ttft_${name}_r$r" >"$out/ttft_${name}_r$r.txt" 2>&1 \
            || echo "!! ttft $name r$r failed"
        echo "== $name, round $r"
        grep -E "^\| *(1024|4096|16384)|phases" "$out/ttft_${name}_r$r.txt" | head -16
        if [ "$experiment" = group ]; then
            timeout 120 python3 bench/transfer_gpu.py --tokens 4096 $flag \
                --out "$out/transfer_4k_${name}_r$r.json" >"$out/transfer_4k_${name}_r$r.txt" 2>&1 \
                || echo "!! transfer $name r$r failed"
        fi
    done
done
if [ "$experiment" != group ]; then
    timeout 240 python3 -m pytest --noconftest -p no:cacheprovider -m cuda -q \
        tests/connector/test_transfer_cuda.py tests/connector/test_head_start_cuda.py \
        tests/connector/test_graph_pieces_cuda.py tests/connector/test_llama_layer.py \
        >"$out/cuda_tests.txt" 2>&1
    tail -3 "$out/cuda_tests.txt"
fi
