"""What resolving a load costs before its first copy: derive the object keys,
retrieve (pin) them from a real index, check the reply and every slot header,
and plan the copies; then unpin. Llama-3-8B geometry (32 layers, 8 KV heads
of 128, bf16, block 16, chunks of 256 tokens): a 16k-token layerwise hit is
2,048 objects, a chunkwise one 64.

    PYTHONPATH=connector:core python3 bench/resolve_cost.py --tokens 4096 16384 32768

Runs on the CPU (no GPU, no vLLM): the objects' headers are written into the
index's own pool file, the data is never read. Prints median milliseconds
per phase for each format and size.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.slots import SlotFormat

from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.resolve import object_keys, release_pins, resolve_load
from maru_tools.index_process import IndexProcess


def llama8b_format(layerwise: bool, chunk_tokens: int = 256) -> ObjectFormat:
    """The object format of Llama-3-8B's KV on the CPU layout (a few blocks suffice)."""
    blocks, heads, block, head = 4, 8, 16, 128
    backing = torch.empty(32 * blocks * heads * block * 2 * head, dtype=torch.bfloat16)
    per_layer = backing.view(32, blocks, heads, block, 2 * head)
    caches = {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(32)}
    return ObjectFormat(detect_kv_layout(caches, block), chunk_tokens, layerwise)


def store_headers(client, pool: Pool, fmt: ObjectFormat, chunk_keys: list[bytes],
                  checksums: bool = False) -> None:
    """Reserve every object, write its slot header as a writer would (with
    its payload's checksum when ``checksums``), commit."""
    keys = object_keys(fmt, chunk_keys)
    slots = client.reserve([(k, fmt.object_bytes) for k in keys])
    if None in list(slots):
        raise SystemExit("the pool is too small for these objects; raise --pool-size")
    kind = SlotFormat.LAYERWISE if fmt.layerwise else SlotFormat.CHUNKWISE
    for key, slot in zip(keys, slots):
        checksum = pool.payload_checksum(slot.offset, fmt.object_bytes) if checksums else None
        pool.write_slot_header(slot.offset, SlotHeader(key, slot.generation, fmt.object_bytes,
                                                       fmt=kind, layout=fmt.fingerprint,
                                                       checksum=checksum))
    client.commit(keys)


def measure(client, pool: Pool, fmt: ObjectFormat, tokens: int, repeats: int,
            verify_payload: bool = False) -> dict:
    chunk_keys = [os.urandom(16) for _ in range(tokens // fmt.chunk_tokens)]
    store_headers(client, pool, fmt, chunk_keys, checksums=verify_payload)
    per = fmt.blocks_per_chunk
    block_ids = [tuple(range(c * per, (c + 1) * per)) for c in range(len(chunk_keys))]
    rows: dict[str, list[float]] = {"keys": [], "resolve_load": [], "release_pins": []}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        object_keys(fmt, chunk_keys)
        t1 = time.perf_counter()
        pinned = resolve_load(client, pool, fmt, chunk_keys, block_ids, verify_payload=verify_payload)
        t2 = time.perf_counter()
        release_pins(client, pinned)
        t3 = time.perf_counter()
        if i:  # the first is a warm-up
            for name, took in zip(rows, (t1 - t0, t2 - t1, t3 - t2)):
                rows[name].append(took * 1e3)
    return {"objects": pinned.num_objects, **{k: statistics.median(v) for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--pool-size", default="16Gi", help="sparse: only slot headers are written")
    ap.add_argument("--verify-payload", action="store_true",
                    help="headers record their payload's checksum, and the resolve reads it for the engine "
                         "(maru_verify_payload, on by default)")
    args = ap.parse_args()
    print(f"# python {platform.python_version()}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| format | tokens | objects | keys ms | resolve_load ms | release_pins ms |")
    print("|---|---:|---:|---:|---:|---:|")
    with IndexProcess(pool_size=args.pool_size) as index:
        pool = Pool.attach(index.pool_path)
        client = index.client(timeout_s=30)
        try:
            for layerwise in (False, True):
                fmt = llama8b_format(layerwise)
                for tokens in args.tokens:
                    r = measure(client, pool, fmt, tokens, args.repeats, args.verify_payload)
                    print(f"| {fmt.name} | {tokens} | {r['objects']} | {r['keys']:.2f} | "
                          f"{r['resolve_load']:.2f} | {r['release_pins']:.2f} |", flush=True)
        finally:
            client.close()
            pool.close()


if __name__ == "__main__":
    main()
