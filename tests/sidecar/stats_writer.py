"""A connector-like process that writes a stats region, driven line by line on stdin.

Commands (one per line; each answers "ok" or "error ..." on stdout):
  lookup HIT_TOKENS | load BYTES SECONDS | load_fail REASON TOKENS | park N
  layer_wait SECONDS | store BYTES SECONDS | store_fail REASON | path | close
End of input ends the process without closing the region (like a crash).
"""

import sys

from maru_core.stats import ConnectorStats


def main() -> None:
    stats = ConnectorStats(sys.argv[1], role=sys.argv[2] if len(sys.argv) > 2 else "worker")
    print("ready", stats.path, flush=True)
    actions = {
        "lookup": lambda a: stats.record_lookup(int(a[0])),
        "load": lambda a: stats.record_load(int(a[0]), float(a[1])),
        "load_fail": lambda a: stats.record_load_failure(a[0], int(a[1])),
        "park": lambda a: stats.set_parked_requests(int(a[0])),
        "layer_wait": lambda a: stats.record_layer_wait(float(a[0])),
        "store": lambda a: stats.record_store(int(a[0]), float(a[1])),
        "store_fail": lambda a: stats.record_store_failure(a[0]),
        "close": lambda a: stats.close(),
    }
    for line in sys.stdin:
        name, *args = line.split()
        try:
            actions[name](args)
        except (KeyError, ValueError, IndexError) as exc:
            print("error", exc, flush=True)
            continue
        print("ok", flush=True)


if __name__ == "__main__":
    main()
