"""``marucache flush``: evict a cache's objects, all of them or one model's
(``--model``, the layout fingerprint ``marucache inspect`` shows) or one
format's, but never a pinned object (one being read) nor a store in flight.

The index charges what a flush evicts to this client's eviction quotas
(``--max-lease-evict-fraction`` and ``--max-peer-evict-fraction`` per
``--evict-window``), as it charges a reserve's: when a window is used up the
flush waits for it (at most ``--wait`` seconds) and goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from maru_core.index.admin import (
    add_connection_arguments,
    collect_groups,
    human_bytes,
    layout_text,
    parse_layout,
    run_with_client,
)
from maru_core.index.client import IndexClient
from maru_core.protocol.messages import OBJECT_FORMATS

#: Exit code of a flush that an eviction window kept from finishing within --wait.
EXIT_INCOMPLETE = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Evict a cache's unpinned objects, all of them or one model's."
    add_connection_arguments(parser)
    parser.add_argument("--model", type=parse_layout, metavar="LAYOUT",
                        help="only this model's objects: its MODEL column in marucache inspect")
    parser.add_argument("--format", choices=OBJECT_FORMATS, help="only objects of this storage format")
    parser.add_argument("--yes", action="store_true", help="flush without asking")
    parser.add_argument("--wait", type=float, default=300.0, metavar="S",
                        help="seconds to wait, at most, for the index's eviction quotas to let the flush go on "
                             "(default 300)")


def _what(args: argparse.Namespace) -> str:
    parts = [f"model {layout_text(args.model)}" if args.model is not None else "all models"]
    if args.format is not None:
        parts.append(f"format {args.format}")
    return ", ".join(parts)


def _confirmed(args: argparse.Namespace, objects: int, size: int) -> bool:
    """Ask on the terminal whether to flush ``objects`` objects of ``size`` bytes."""
    answer = input(f"Flush {objects} objects ({human_bytes(size)}; {_what(args)}) from the cache at {args.index}? "
                   "Pinned objects stay. [y/N] ")  # fmt: skip
    return answer.strip().lower() in ("y", "yes")


@dataclasses.dataclass
class FlushTotals:
    """What a whole flush did (``--json`` prints these fields as they are); ``quota``: the
    quota that held ``held_back`` objects or more past ``--wait`` (None: the flush is complete)."""

    evicted: int = 0
    evicted_bytes: int = 0
    pinned: int = 0
    held_back: int = 0
    quota: str | None = None
    requests: int = 0


def flush_everything(client: IndexClient, args: argparse.Namespace) -> FlushTotals:
    """Walk the whole record table once, flushing what matches; wait out eviction windows
    for at most ``args.wait`` seconds in all."""
    totals = FlushTotals()
    give_up_at = time.monotonic() + args.wait
    cursor: int | None = 0
    while cursor is not None:
        page = client.flush(cursor, args.page_rows, layout=args.model, fmt=args.format)
        totals.requests += 1
        totals.evicted += page.evicted
        totals.evicted_bytes += page.evicted_bytes
        totals.pinned += page.pinned
        if page.quota is not None:
            if time.monotonic() + page.retry_after_s > give_up_at:
                totals.held_back, totals.quota = page.held_back, page.quota
                break
            if not args.json:
                print(f"marucache flush: {totals.evicted} objects so far; waiting {page.retry_after_s:g} s for "
                      f"the index's {page.quota} quota", file=sys.stderr)
            time.sleep(page.retry_after_s)
        cursor = page.next_cursor
    return totals


def run(args: argparse.Namespace) -> int:
    def flush(client: IndexClient) -> int:
        if not args.yes:
            if not sys.stdin.isatty():
                print(f"marucache flush: not flushing {_what(args)} from the cache at {args.index}: stdin is no "
                      "terminal to ask on; pass --yes", file=sys.stderr)
                return 2
            groups, _ = collect_groups(client, args.page_rows)
            matching = [g for g in groups if (args.model is None or g.layout == args.model)
                        and (args.format is None or g.format == args.format)]  # fmt: skip
            if not _confirmed(args, sum(g.objects for g in matching), sum(g.bytes for g in matching)):
                return 1
        totals = flush_everything(client, args)
        if args.json:
            print(json.dumps({"index": args.index, "model": None if args.model is None else layout_text(args.model),
                              "format": args.format, **dataclasses.asdict(totals)}, indent=2))  # fmt: skip
        else:
            print(f"flushed {totals.evicted} objects ({human_bytes(totals.evicted_bytes)}; {_what(args)}); "
                  f"skipped {totals.pinned} pinned objects")
            if totals.quota is not None:
                print(f"{totals.held_back} objects or more are left: the index's {totals.quota} quota held "
                      f"them past --wait {args.wait:g}; run the flush again", file=sys.stderr)
        return EXIT_INCOMPLETE if totals.quota is not None else 0

    return run_with_client(args, "flush", flush)
