"""``marucache quickstart``: MaruCache end to end on this machine, in seconds.

Creates a pool in ``/dev/shm``, starts ``marucache index`` as its own
process, stores the KV objects of one prompt from a writer process and reads
them back, checked byte for byte, from a separate reader process — the way
two vLLM instances share a prefix. Prints what happened and removes the pool
and the index on exit, Ctrl-C included.

The writer and reader roles are also runnable alone
(``python -m maru_core.quickstart writer|reader --url ... --pool ...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROLES = ("writer", "reader")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from maru_core.index.cli import _size_arg

    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default 4096)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk key (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="model layers: one object per chunk and layer (default 4)")
    parser.add_argument("--object-size", type=_size_arg, default=256 * 1024, metavar="SIZE",
                        help="bytes per object (default 256Ki)")
    parser.add_argument("--pool-size", type=_size_arg, default=256 * 1024 * 1024, metavar="SIZE",
                        help="pool size (default 256Mi)")


def prompt_keys(tokens: int, chunk_tokens: int, layers: int) -> list[bytes]:
    """The layerwise object keys of a fixed demo prompt: chunk by chunk, layer by layer."""
    from maru_core.keys import KeyNamespace, chunk_keys, layer_key

    ns = KeyNamespace(model="marucache-quickstart", dtype="bfloat16", kv_dtype="bfloat16", layout="demo",
                      block_size=16, chunk_tokens=chunk_tokens, fmt="layerwise")  # fmt: skip
    token_ids = [(i * 7919) % 32000 for i in range(tokens)]
    return [layer_key(chunk, layer) for chunk in chunk_keys(ns, token_ids) for layer in range(layers)]


def object_bytes(key: bytes, length: int) -> bytes:
    """Deterministic stand-in for an object's KV bytes, so the reader can check them."""
    block = hashlib.blake2b(key, digest_size=64).digest()
    return (block * (length // 64 + 1))[:length]


def run_writer(client: Any, pool: Any, keys: list[bytes], length: int) -> dict[str, Any]:
    """Store one object per key: reserve, write data, slot header, commit."""
    from maru_core.pool import SlotFormat, SlotHeader

    t0 = time.perf_counter()
    slots = client.reserve([(k, length) for k in keys])
    t1 = time.perf_counter()
    written = []
    for k, slot in zip(keys, slots):
        if slot is None:
            continue  # already stored by someone else
        pool.invalidate_slot(slot.offset, length)
        pool.view(slot.offset, length)[:] = object_bytes(k, length)
        pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=length,
                                                       fmt=SlotFormat.LAYERWISE))  # fmt: skip
        written.append(k)
    t2 = time.perf_counter()
    committed = client.commit(written)
    t3 = time.perf_counter()
    return {"role": "writer", "pid": os.getpid(), "objects": len(keys), "committed": sum(committed),
            "bytes": sum(committed) * length, "reserve_ms": (t1 - t0) * 1e3, "write_ms": (t2 - t1) * 1e3,
            "commit_ms": (t3 - t2) * 1e3}  # fmt: skip


def run_reader(client: Any, pool: Any, keys: list[bytes], length: int) -> dict[str, Any]:
    """Look up, pin, check slot headers, read and verify every object, unpin."""
    t0 = time.perf_counter()
    matched = client.match_prefix(keys)
    t1 = time.perf_counter()
    locations = client.retrieve(keys)
    t2 = time.perf_counter()
    verified = 0
    if locations.misses() == 0:
        try:
            for k, loc in zip(keys, locations):
                header = pool.read_slot_header(loc.offset)
                if header is not None and header.names(k, loc.generation) and \
                        bytes(pool.view(loc.offset, loc.length)) == object_bytes(k, length):  # fmt: skip
                    verified += 1
        finally:
            client.unpin(keys)
    t3 = time.perf_counter()
    return {"role": "reader", "pid": os.getpid(), "objects": len(keys), "matched": matched,
            "hits": len(keys) - locations.misses(), "verified": verified, "bytes": verified * length,
            "match_ms": (t1 - t0) * 1e3, "retrieve_ms": (t2 - t1) * 1e3, "read_ms": (t3 - t2) * 1e3}  # fmt: skip


def role_main(argv: list[str]) -> int:
    """Entry of a writer or reader process: prints one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m maru_core.quickstart")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--url", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--token-file")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--object-size", type=int, default=256 * 1024)
    args = parser.parse_args(argv)
    from maru_core.index.cli import read_token
    from maru_core.index.client import IndexClient
    from maru_core.pool import Pool

    token = read_token(args.token_file) if args.token_file else None
    keys = prompt_keys(args.tokens, args.chunk_tokens, args.layers)
    with Pool.attach(args.pool) as pool, IndexClient(args.url, token=token, client_name=f"quickstart-{args.role}") as client:
        client.connect()  # connect and hello outside the timed calls
        role = run_writer if args.role == "writer" else run_reader
        print(json.dumps(role(client, pool, keys, args.object_size)), flush=True)
    return 0


def _role(role: str, index_url: str, pool: str, token_file: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "maru_core.quickstart", role, "--url", index_url, "--pool", pool,
           "--token-file", token_file, "--tokens", str(args.tokens), "--chunk-tokens", str(args.chunk_tokens),
           "--layers", str(args.layers), "--object-size", str(args.object_size)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the {role} process failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def run(args: argparse.Namespace) -> int:
    from maru_core.index.launcher import IndexProcess, unique_shm_path

    if args.tokens < args.chunk_tokens or args.chunk_tokens <= 0 or args.layers <= 0:
        print("marucache quickstart: error: need --tokens >= --chunk-tokens > 0 and --layers > 0", file=sys.stderr)
        return 2
    pool_path = unique_shm_path("marucache-quickstart")
    workdir = tempfile.mkdtemp(prefix="marucache-quickstart-")
    token_file = os.path.join(workdir, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
        fh.write(os.urandom(16).hex())
    index = IndexProcess(pool_path, pool_size=str(args.pool_size), token_file=token_file)
    print("MaruCache quickstart", flush=True)
    try:
        index.start()
        url, proc = index.url, index.proc
        assert url is not None and proc is not None  # start() raises unless the index printed its address
        print(f"  pool     {pool_path} ({_mib(args.pool_size)}, tmpfs standing in for CXL memory)")
        print(f"  index    {url} (pid {proc.pid})", flush=True)  # progress, also through a pipe
        w = _role("writer", url, pool_path, token_file, args)
        print(f"  writer   pid {w['pid']}: stored {w['committed']}/{w['objects']} objects, {_mib(w['bytes'])} "
              f"(reserve {w['reserve_ms']:.2f} ms, write {w['write_ms']:.1f} ms, commit {w['commit_ms']:.2f} ms)",
              flush=True)
        if w["committed"] < w["objects"]:
            print(f"  result   the pool held only {w['committed']} of {w['objects']} objects: "
                  "use a larger --pool-size or fewer --tokens")
            return 1
        r = _role("reader", url, pool_path, token_file, args)
        print(f"  reader   pid {r['pid']}: {r['hits']}/{r['objects']} hits, {r['verified']} verified byte for byte, "
              f"{_mib(r['bytes'])} read (match_prefix {r['match_ms']:.2f} ms, retrieve {r['retrieve_ms']:.2f} ms, "
              f"read {r['read_ms']:.1f} ms)")
        ok = r["verified"] == r["objects"] == w["objects"]
        print("  result   " + ("the reader got every object the writer stored" if ok else "MISMATCH: see above"))
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("  interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"marucache quickstart: error: {exc}", file=sys.stderr)
        return 1
    finally:
        index.stop()
        for path in (pool_path, token_file):
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(workdir)
        print("  cleanup  index stopped, pool removed")


if __name__ == "__main__":
    sys.exit(role_main(sys.argv[1:]))
