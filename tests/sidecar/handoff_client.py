"""A connector-like process: fetches the pool from the sidecar, maps it and reads it.

usage: handoff_client.py SOCKET CACHE TOKEN [--hold]
TOKEN "-" sends no token. Prints one JSON line: the hand-off's result. With
--hold it then answers commands on stdin, reading through its own mapping:
  read OFFSET LENGTH   -> the bytes as hex
  magic                -> the pool header's magic, read from the mapping now
  write OFFSET HEX     -> writes the bytes through the mapping, answers "ok"
"""

import json
import sys

from maru_core.handoff import HandoffError, HandoffRefused, fetch_pool


def main() -> None:
    socket_path, cache, token = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        handoff = fetch_pool(socket_path, None if token == "-" else token, cache, timeout_s=5.0)
    except HandoffError as exc:
        kind = exc.type if isinstance(exc, HandoffRefused) else type(exc).__name__
        print(json.dumps({"ok": False, "type": kind, "message": str(exc)}), flush=True)
        return
    pool = handoff.open_pool()
    print(json.dumps({
        "ok": True,
        "magic": bytes(pool.buffer[:8]).decode(),
        "uuid": pool.geometry.uuid,
        "offset": pool.offset,  # the region offset recorded in the header it mapped
        "handed_offset": handoff.pool_offset,
        "mapped_bytes": len(pool.buffer),
        "size": pool.geometry.size,
        "data_offset": pool.geometry.data_offset,
        "claimed_geometry": handoff.geometry,
        "index_url": handoff.index_url,
        "stats_dir": handoff.stats_dir,
        "cache": handoff.cache,
    }), flush=True)  # fmt: skip
    if "--hold" not in sys.argv:
        pool.close()
        return
    for line in sys.stdin:
        name, *args = line.split()
        if name == "read":
            offset, length = int(args[0]), int(args[1])
            print(bytes(pool.view(offset, length)).hex(), flush=True)
        elif name == "magic":
            print(bytes(pool.buffer[:8]).decode(), flush=True)
        elif name == "write":
            data = bytes.fromhex(args[1])
            pool.view(int(args[0]), len(data))[:] = data
            print("ok", flush=True)
    pool.close()


if __name__ == "__main__":
    main()
