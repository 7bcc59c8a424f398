"""What ``marucache inspect`` and ``marucache flush`` share: the connection
flags, the client they open, the listing walked page by page, and one-line
errors that say what to change."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from maru_core.index.api import IndexError_, IndexRejected, IndexUnavailable
from maru_core.index.client import IndexClient
from maru_core.index.inventory import DEFAULT_SCAN_ROWS, ObjectGroup
from maru_core.protocol import ErrorType
from maru_core.protocol.messages import MAX_SCAN_ROWS


class AdminError(Exception):
    """A problem the user fixes (a flag, a file): printed as one line, exit code 2."""


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", required=True, metavar="URL",
                        help="the cache's index: tcp://HOST:PORT or unix:///PATH")
    parser.add_argument("--token-file", metavar="FILE",
                        help="file holding the cache's index token (its Secret, mounted at "
                             "/var/run/maru-token/token in the cache's pods); omit for an index without one")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds per request (default 10)")
    parser.add_argument("--page-rows", type=int, default=DEFAULT_SCAN_ROWS, metavar="N",
                        help=f"index records scanned per request, 1 to {MAX_SCAN_ROWS} (default {DEFAULT_SCAN_ROWS})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def read_client_token(path: str | None) -> str | None:
    """The token in ``path`` (surrounding whitespace removed), or ``None`` without a path."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminError(f"cannot read --token-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise AdminError(f"--token-file {path} is empty: it must hold the cache's index token")
    return token


def open_client(args: argparse.Namespace, name: str) -> IndexClient:
    if not 1 <= args.page_rows <= MAX_SCAN_ROWS:
        raise AdminError(f"--page-rows must be from 1 to {MAX_SCAN_ROWS}, got {args.page_rows}")
    if args.timeout <= 0:
        raise AdminError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    token = read_client_token(args.token_file)
    try:
        return IndexClient(args.index, token=token, client_name=f"marucache-{name}", timeout_s=args.timeout)
    except ValueError as exc:
        raise AdminError(f"--index {args.index}: {exc}") from None


def explain(exc: IndexError_, args: argparse.Namespace) -> str:
    """One line about a failed call, saying what to change."""
    if isinstance(exc, IndexRejected) and exc.error_type is ErrorType.AUTH:
        where = f"the token in {args.token_file}" if args.token_file else "no token (pass --token-file)"
        return (f"the index at {args.index} refused {where}: use the token of this cache's index "
                "(its Secret NAME-maru-token, key token)")
    if isinstance(exc, IndexRejected) and exc.error_type is ErrorType.UNKNOWN_OP:
        return (f"the index at {args.index} is older than this command (it has no {exc.op} op): "
                "run an index of this MaruCache release")
    if isinstance(exc, IndexUnavailable):
        return f"cannot reach the index at {args.index}: {exc}"
    return str(exc)


def run_with_client(args: argparse.Namespace, name: str, body: Callable[[IndexClient], int]) -> int:
    """Run ``body`` with a client of ``args.index``: exit code 2 for a flag or file to fix,
    1 when the index refused or could not be reached, else ``body``'s."""
    try:
        client = open_client(args, name)
    except AdminError as exc:
        print(f"marucache {name}: {exc}", file=sys.stderr)
        return 2
    try:
        return body(client)
    except IndexError_ as exc:
        print(f"marucache {name}: {explain(exc, args)}", file=sys.stderr)
        return 1
    finally:
        client.close()


def collect_groups(client: IndexClient, page_rows: int) -> tuple[list[ObjectGroup], int]:
    """Every group of the cache's objects, merged over the pages of the listing (largest
    first), and how many requests the listing took."""
    merged: dict[tuple[int, str], list[int]] = {}
    cursor: int | None = 0
    requests = 0
    while cursor is not None:
        page = client.list_objects(cursor, page_rows)
        requests += 1
        for group in page.groups:
            totals = merged.setdefault((group.layout, group.format), [0, 0, 0, 0])
            for i, value in enumerate((group.objects, group.pages, group.bytes, group.pinned)):
                totals[i] += value
        cursor = page.next_cursor
    groups = [ObjectGroup(layout, fmt, *totals) for (layout, fmt), totals in merged.items()]
    groups.sort(key=lambda g: (-g.bytes, g.layout, g.format))
    return groups, requests


def layout_text(layout: int) -> str:
    """A layout fingerprint as ``inspect`` prints it and ``flush --model`` takes it: 16 hex digits."""
    return f"{layout:016x}"


def parse_layout(text: str) -> int:
    """``--model``'s value: a layout fingerprint as ``inspect`` prints it."""
    try:
        value = int(text, 16)
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 64 or len(text) > 16:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no layout fingerprint: give the MODEL column of marucache inspect (16 hex digits)")
    return value


def human_bytes(size: int) -> str:
    """``size`` in bytes as people read it: ``512 B``, ``1.5 GiB``."""
    if size < 1024:
        return f"{size} B"
    scaled = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        scaled /= 1024
        if scaled < 1024 or unit == "TiB":
            break
    return f"{scaled:.1f} {unit}"


def table(rows: Sequence[Sequence[object]], header: list[str]) -> str:
    """Left-aligned text columns."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
