"""``marucache inspect``: what a cache holds, by model (the KV layout
fingerprint its writers recorded) and storage format, and its pool's usage.

The listing is read from the index a range of records per request
(``--page-rows``), while the cache keeps serving: objects stored or evicted
meanwhile may be counted or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from maru_core.index.admin import (
    add_connection_arguments,
    collect_groups,
    human_bytes,
    layout_text,
    run_with_client,
    table,
)
from maru_core.index.client import IndexClient
from maru_core.index.inventory import ObjectGroup
from maru_core.protocol import Message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "List a cache's objects by model and storage format, and its pool's usage."
    add_connection_arguments(parser)


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """The pool's usage in pages and objects (``--json`` prints these fields as they are)."""

    page_bytes: int
    pages: int
    pages_used: int
    pages_free: int
    pages_reserved: int
    pages_committed: int
    pages_pinned: int
    objects: int
    objects_pinned: int
    reservations: int
    evictions: int
    leases: int
    quarantined: bool


def usage_of(stats: Message, page_size: int) -> PoolUsage:
    """The pool's usage in pages and objects, from the index's ``stats``."""
    pages = {name: int(stats[f"{name}_bytes"]) // page_size
             for name in ("capacity", "free", "reserved", "committed", "pinned")}  # fmt: skip
    return PoolUsage(
        page_bytes=page_size,
        pages=pages["capacity"],
        pages_used=pages["reserved"] + pages["committed"],
        pages_free=pages["free"],
        pages_reserved=pages["reserved"],
        pages_committed=pages["committed"],
        pages_pinned=pages["pinned"],
        objects=int(stats["keys"]),
        objects_pinned=int(stats["pinned_keys"]),
        reservations=int(stats["reserved_keys"]),
        evictions=int(stats["evictions"]),
        leases=int(stats["leases"]),
        quarantined=bool(stats["quarantined"]),
    )


def render(index: str, usage: PoolUsage, groups: list[ObjectGroup]) -> str:
    page = usage.page_bytes
    lines = [
        f"cache index {index}: {usage.pages} pages of {human_bytes(page)} ({human_bytes(usage.pages * page)})",
        f"pages: {usage.pages_used} used ({usage.pages_committed} committed, {usage.pages_reserved} "
        f"reserved), {usage.pages_free} free, {usage.pages_pinned} pinned",
        f"objects: {usage.objects} ({usage.objects_pinned} pinned), {usage.reservations} stores in "
        f"flight, {usage.leases} leases, {usage.evictions} evicted since the index started"
        + (" (quarantined after a restart)" if usage.quarantined else ""),
        "",
    ]
    if not groups:
        return "\n".join(lines + ["no committed objects"])
    rows = [[layout_text(g.layout), g.format, g.objects, g.pages, human_bytes(g.bytes), g.pinned] for g in groups]
    return "\n".join(lines + [table(rows, ["MODEL", "FORMAT", "OBJECTS", "PAGES", "BYTES", "PINNED"])])


def run(args: argparse.Namespace) -> int:
    def inspect(client: IndexClient) -> int:
        client.connect()
        assert client.geometry is not None  # set by hello
        usage = usage_of(client.stats(), int(client.geometry["page_size"]))
        groups, requests = collect_groups(client, args.page_rows)
        if args.json:
            print(json.dumps({"index": args.index, "usage": dataclasses.asdict(usage), "requests": requests,
                              "groups": [{**vars(g), "model": layout_text(g.layout)} for g in groups]},
                             indent=2))  # fmt: skip
        else:
            print(render(args.index, usage, groups))
        return 0

    return run_with_client(args, "inspect", inspect)
