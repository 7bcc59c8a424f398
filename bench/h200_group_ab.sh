#!/usr/bin/env bash
# Does loading 4k-token hits' 16 MiB layers in groups (as layers under
# 8 MiB already are) shorten their TTFT? Alternates the engine's grouping
# threshold, 8 MiB (as shipped) and 32 MiB, ROUNDS times (run from the
# project root on the GPU machine):
#
#   bash bench/h200_group_ab.sh OUT_DIR [ROUNDS]
set -u
out=${1:?usage: h200_group_ab.sh OUT_DIR [ROUNDS]}
rounds=${2:-2}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=connector:core:tests/connector
for r in $(seq 1 "$rounds"); do
    for g in 8 32; do
        timeout 240 python3 bench/ttft_gpu.py --repeats 5 --sizes 4096 --partial 4096 512 \
            --store-size 4096 --concurrent-size 4096 --concurrency 1 \
            --modes sync sync_overlap_graphs async_overlap_graphs \
            --timeline 4096/sync_overlap_graphs --group-below-mib "$g" \
            --out "$out/ttft_g${g}_r$r" >"$out/ttft_g${g}_r$r.txt" 2>&1 || echo "!! ttft g$g r$r failed"
        grep -E "^\| *(4k|4096)" "$out/ttft_g${g}_r$r.txt" | head -4
        timeout 120 python3 bench/transfer_gpu.py --tokens 4096 --group-below-mib "$g" \
            --out "$out/transfer_4k_g${g}_r$r.json" >"$out/transfer_4k_g${g}_r$r.txt" 2>&1 \
            || echo "!! transfer g$g r$r failed"
        python3 - "$out/transfer_4k_g${g}_r$r.json" "$g" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print(f"group below {sys.argv[2]} MiB: 4k load / pinned peak",
      {k: round(v["ratio_to_pinned_peak"], 3) for k, v in d["formats"].items()})
PY
    done
done
