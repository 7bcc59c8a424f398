"""Device memory the CUDA transfer engine takes beside vLLM's KV cache.

vLLM sizes its KV cache from the memory it measured before the connector's
worker registered it, so whatever the engine allocates afterwards (the load
staging ring, the store staging, the head-start buffer, block-id buffers)
must fit in the headroom ``gpu_memory_utilization`` leaves. This measures it
on a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads of 128, blocks of 16
tokens, bf16) for both formats: the device bytes allocated once the engine
exists, and after it has loaded, stored and started a head, against the
engine's own ``device_bytes()``.

    python3 bench/staging_memory_gpu.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from transfer_gpu import Pool, chunks_of, make_kv, place  # noqa: E402

from maru_connector.kv_layout import detect_kv_layout  # noqa: E402
from maru_connector.object_format import ObjectFormat  # noqa: E402
from maru_connector.transfer import ChunkLoad, ChunkStore, create_engine  # noqa: E402

MIB = 1 << 20


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def measure(layerwise: bool, tokens: int, chunk_tokens: int) -> dict:
    blocks = 2 * tokens // 16
    kv = make_kv("flash_nhd", 32, blocks, 8, 16, 128)
    fmt = ObjectFormat(detect_kv_layout(kv), chunk_tokens, layerwise)
    chunks = tokens // chunk_tokens
    pool = Pool(chunks * fmt.objects_per_chunk * fmt.object_bytes + (2 << 20))
    bpc = fmt.blocks_per_chunk
    ids = list(range(blocks))
    offsets = place(fmt, chunks)
    base = allocated()
    engine = create_engine(pool.buffer, kv, fmt)
    row = {"format": "layerwise" if layerwise else "chunkwise", "after_create_mib": (allocated() - base) / MIB}
    try:
        engine.submit_store(chunks_of(ids[:chunks * bpc], offsets, bpc, ChunkStore)).wait()
        row["after_store_mib"] = (allocated() - base) / MIB
        engine.submit_load(chunks_of(ids[chunks * bpc:], offsets, bpc, ChunkLoad)).wait_all()
        row["after_load_mib"] = (allocated() - base) / MIB
        head = engine.start_head(offsets)
        row["head_started"] = head is not None
        torch.cuda.synchronize()
        row["after_head_start_mib"] = (allocated() - base) / MIB
        declared = getattr(engine, "device_bytes", None)
        row["declared_mib"] = declared() / MIB if declared is not None else None
    finally:
        engine.close()
        pool.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    free, total = torch.cuda.mem_get_info()
    result = {"gpu": torch.cuda.get_device_name(), "total_mib": total / MIB,
              "rows": [measure(lw, args.tokens, args.chunk_tokens) for lw in (False, True)]}
    worst = max(max(v for k, v in r.items() if k.endswith("_mib") and v is not None) for r in result["rows"])
    result["largest_mib"] = worst
    result["utilization_share"] = worst * MIB / total
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
