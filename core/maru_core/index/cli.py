"""``marucache index``: run the index service of one pool.

    marucache index --pool /dev/shm/maru.pool --pool-size 2Gi \\
        --listen tcp://0.0.0.0:7700 --token-file /etc/maru/token --metrics-port 9400

Creates the pool when ``--pool-size`` is given and nothing is at ``--pool``;
attaches to it otherwise, rebuilding the index from the slot headers an index
marked committed (``maru_core.pool.commit_records``). With
``--pool-offset`` (or a ``--pool-size`` smaller than the device), the pool is
the region of ``--pool-size`` bytes from that offset of a DAX device shared
with other caches: a pool of exactly that region is attached, anything else
there is replaced by a new pool (``_make_region_pool`` says when). Prints
one ``listening on ADDRESS`` line on stdout once it accepts connections, and
stops cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import stat
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from maru_core.index.limits import ServerLimits

log = logging.getLogger("maru_core.index")

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGTP]i?)?B?\s*$")
_UNITS = {"": 1}
for _i, _p in enumerate("KMGTP", start=1):
    _UNITS[_p] = 1000**_i
    _UNITS[_p + "i"] = 1024**_i


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"512Mi"`` (binary) or ``"2G"`` (decimal), as
    Kubernetes quantities read them; ``ValueError`` saying what is accepted."""
    size = _quantity(text)
    if size == 0:
        raise ValueError(f"{text!r} is not a size: a size is more than zero bytes")
    return size


def parse_offset(text: str) -> int:
    """A pool offset in bytes, in ``parse_size``'s syntax (``0``, ``2Gi``,
    ``2147483648``); ``ValueError`` unless it is a multiple of 2 MiB."""
    from maru_core.pool import check_region_offset

    offset = _quantity(text)
    check_region_offset(offset)
    return offset


def _quantity(text: str) -> int:
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(
            f"{text!r} is not a size: use bytes (1073741824), binary units (512Mi, 2Gi) "
            "or decimal units (2G)"
        )
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _offset_arg(text: str) -> int:
    try:
        return parse_offset(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The longest TTL, timeout or deadline a flag accepts (a day): longer is always a typo.
_MAX_SECONDS = 86400.0
#: The shortest token accepted: a token is a secret, not a password to remember.
MIN_TOKEN_CHARS = 16


def _number_arg(convert: Callable[[str], Any], accept: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)`` when ``accept`` takes it, else the one-line
    error "'TEXT' is not WHAT" (comparisons also refuse nan and inf where they must)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


#: The highest per-peer rate a flag accepts: higher is no limit at all.
_MAX_RATE = 1e6

_positive_seconds = _number_arg(float, lambda v: 0 < v <= _MAX_SECONDS,
                                f"a positive number of seconds (at most {_MAX_SECONDS:g})")
_positive_ms = _number_arg(float, lambda v: 0 < v <= _MAX_SECONDS * 1e3,
                           f"a positive number of milliseconds (at most {_MAX_SECONDS * 1e3:g})")
_count_arg = _number_arg(int, lambda v: v >= 1, "a whole number of at least 1")
_rate_arg = _number_arg(float, lambda v: 0 < v <= _MAX_RATE, f"a positive number per second (at most {_MAX_RATE:g})")
_fraction_arg = _number_arg(float, lambda v: 0 < v <= 1, "a fraction of the pool above 0 and at most 1 (e.g. 0.25)")
#: A TCP port, 0 (pick a free one) to 65535.
port_arg = _number_arg(int, lambda v: 0 <= v <= 65535, "a port: use 0 to 65535 (0 picks a free port)")


def host_arg(text: str) -> str:
    """An address to bind: an IP address or a host name."""
    if not re.fullmatch(r"[A-Za-z0-9.:_-]{1,253}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an address to listen on: use an IP address or host name")
    return text


def _address_arg(text: str) -> Any:
    from maru_core.protocol import parse_url

    try:
        return parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report a bad flag in one line (no usage block), exit code 2."""

    def error(message: str) -> Any:
        parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")

    parser.error = error  # type: ignore[method-assign]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from maru_core.index.aliases import DEFAULT_MAX_ALIASES
    from maru_core.index.limits import PRE_AUTH_FRAME_BYTES, ServerLimits, default_max_connections
    from maru_core.index.quotas import EVICT_WINDOW_S, MAX_LEASE_EVICT_FRACTION, MAX_LEASE_PIN_FRACTION
    from maru_core.index.registry import MAX_EVICT_FRACTION, MAX_FENCE_S, MAX_LEASE_POOL_FRACTION

    limits = ServerLimits()
    one_line_errors(parser)
    parser.add_argument("--pool", required=True, metavar="PATH",
                        help="pool file (tmpfs, e.g. /dev/shm/maru.pool) or DAX device (/dev/daxX.Y)")
    parser.add_argument("--pool-size", type=_size_arg, metavar="SIZE",
                        help="create the pool with this size if PATH does not exist (512Mi, 2Gi, 2G, bytes)")
    parser.add_argument("--pool-offset", type=_offset_arg, default=0, metavar="BYTES",
                        help="where the pool starts in PATH, a multiple of 2Mi (default 0): the pool is the "
                             "region of --pool-size bytes from there of a device shared with other caches")
    parser.add_argument("--page-size", type=_size_arg, metavar="SIZE",
                        help="page size of a pool created here (a power of two, default 64Ki)")
    parser.add_argument("--listen", required=True, type=_address_arg, metavar="ADDR",
                        help="tcp://HOST:PORT or unix:///PATH (port 0 picks a free port)")
    parser.add_argument("--token-file", metavar="FILE",
                        help=f"file holding the token clients must present (at least {MIN_TOKEN_CHARS} "
                             "characters, not readable by others); without it, no token is needed")
    parser.add_argument("--metrics-port", type=port_arg, metavar="N", help="serve Prometheus /metrics on this port")
    parser.add_argument("--metrics-addr", type=host_arg, metavar="HOST",
                        help="address for /metrics (default: the host of a tcp:// --listen, else 127.0.0.1)")
    parser.add_argument("--lease-ttl", type=_positive_seconds, default=10.0, metavar="S",
                        help="seconds a client's lease lives without a heartbeat (default 10)")
    parser.add_argument("--reservation-ttl", type=_positive_seconds, default=30.0, metavar="S",
                        help="seconds a reservation may stay uncommitted (default 30)")
    parser.add_argument("--high-watermark", type=_fraction_arg, default=0.95, metavar="F",
                        help="used fraction of the pool at which a reserve evicts objects, least recently "
                             "used first by fair share among peers (default 0.95)")
    parser.add_argument("--low-watermark", type=_fraction_arg, default=0.85, metavar="F",
                        help="used fraction eviction brings the pool down to; below --high-watermark "
                             "(default 0.85)")
    parser.add_argument("--max-connections", type=_count_arg, default=default_max_connections(), metavar="N",
                        help="connections served at once (default 1024, fewer under a lower open-files limit)")
    parser.add_argument("--max-leases-per-connection", type=_count_arg, default=limits.max_leases_per_connection,
                        metavar="N", help=f"live leases one connection may open (default {limits.max_leases_per_connection})")
    parser.add_argument("--hello-timeout", type=_positive_seconds, default=limits.hello_timeout_s, metavar="S",
                        help=f"seconds a new connection has to say hello (default {limits.hello_timeout_s:g}; "
                             f"frames before it: at most {PRE_AUTH_FRAME_BYTES} bytes)")
    parser.add_argument("--frame-timeout", type=_positive_seconds, default=limits.frame_timeout_s, metavar="S",
                        help=f"seconds a frame may take from its first byte, or unread replies may wait "
                             f"(default {limits.frame_timeout_s:g})")
    parser.add_argument("--max-receive-mib", type=int, default=limits.max_receive_bytes >> 20, metavar="MIB",
                        help="MiB all connections' large receive buffers (frames of 1 MiB or more under way) "
                             f"may hold together (default {limits.max_receive_bytes >> 20})")
    parser.add_argument("--idle-timeout", type=_positive_seconds, default=limits.idle_timeout_s, metavar="S",
                        help=f"seconds a connection may send nothing (default {limits.idle_timeout_s:g})")
    parser.add_argument("--turn-ms", type=_positive_ms, default=limits.turn_s * 1e3, metavar="MS",
                        help="milliseconds of the event loop one peer's requests may hold per round while it is "
                             f"the only peer served (default {limits.turn_s * 1e3:g})")
    parser.add_argument("--shared-turn-ms", type=_positive_ms, default=limits.shared_turn_s * 1e3,
                        metavar="MS", help="the same while other peers are served too: about how long a request "
                                           "waits for a peer that keeps the index busy "
                                           f"(default {limits.shared_turn_s * 1e3:g})")
    parser.add_argument("--peer-connection-rate", type=_rate_arg, default=limits.peer_connection_rate, metavar="R",
                        help="new connections per second one peer (an IP address, or a Unix socket's user) may "
                             "open (one its peer closes before sending a byte is not counted); beyond, they are "
                             f"closed at accept (default {limits.peer_connection_rate:g})")
    parser.add_argument("--peer-connection-burst", type=_count_arg, default=limits.peer_connection_burst,
                        metavar="N", help="new connections one peer may open at once, e.g. its workers reconnecting "
                                          f"after a restart (default {limits.peer_connection_burst})")
    parser.add_argument("--peer-auth-failure-rate", type=_rate_arg, default=limits.peer_auth_failure_rate,
                        metavar="R", help="wrong-token hellos per second one peer may send; beyond, the answer "
                                          "to each failing connection is held back (never its neighbours' "
                                          f"connections refused) (default {limits.peer_auth_failure_rate:g})")
    parser.add_argument("--peer-auth-failure-burst", type=_count_arg, default=limits.peer_auth_failure_burst,
                        metavar="N", help=f"wrong-token hellos one peer may send at once (default {limits.peer_auth_failure_burst})")
    parser.add_argument("--peer-receive-rate-mib", type=_rate_arg, default=limits.peer_receive_rate / 2**20,
                        metavar="R", help="MiB per second one peer's connections together may send; beyond, "
                                          "the connection that read them is not read again until the budget "
                                          f"has refilled (default {limits.peer_receive_rate / 2**20:g})")
    parser.add_argument("--peer-receive-burst-mib", type=_count_arg, default=limits.peer_receive_burst >> 20,
                        metavar="MIB", help=f"MiB one peer may send at once (default {limits.peer_receive_burst >> 20})")
    parser.add_argument("--max-evict-fraction", type=_fraction_arg, default=MAX_EVICT_FRACTION, metavar="F",
                        help=f"largest share of the pool one reserve may evict (default {MAX_EVICT_FRACTION:g})")
    parser.add_argument("--max-lease-pool-fraction", type=_fraction_arg, default=MAX_LEASE_POOL_FRACTION,
                        metavar="F", help="largest share of the pool one lease may hold reserved, or fenced "
                                          f"after a lapse (default {MAX_LEASE_POOL_FRACTION:g})")
    parser.add_argument("--max-lease-pin-fraction", type=_fraction_arg, default=MAX_LEASE_PIN_FRACTION,
                        metavar="F", help="largest share of the pool one lease may pin (the pages of the distinct "
                                          "objects its retrieves pinned and it has not unpinned); beyond, a "
                                          f"retrieve is refused with 'quota' (default {MAX_LEASE_PIN_FRACTION:g})")
    parser.add_argument("--max-lease-evict-fraction", type=_fraction_arg, default=MAX_LEASE_EVICT_FRACTION,
                        metavar="F", help="largest share of the pool one lease's reserves may evict within "
                                          "--evict-window; beyond, its objects get no slot (default "
                                          f"{MAX_LEASE_EVICT_FRACTION:g})")
    parser.add_argument("--max-peer-pool-fraction", type=_fraction_arg, metavar="F",
                        help="largest share of the pool all the leases of one peer (an IP address, or a Unix "
                             "socket's user) may hold reserved or fenced together (default: as "
                             f"--max-lease-pool-fraction, {MAX_LEASE_POOL_FRACTION:g})")
    parser.add_argument("--max-peer-pin-fraction", type=_fraction_arg, metavar="F",
                        help="largest share of the pool all the leases of one peer may pin together (each "
                             "lease's distinct objects, summed; 1: no bound); beyond, a retrieve is refused with "
                             f"'quota' (default: as --max-lease-pin-fraction, {MAX_LEASE_PIN_FRACTION:g})")
    parser.add_argument("--max-peer-evict-fraction", type=_fraction_arg, metavar="F",
                        help="largest share of the pool the reserves of one peer's leases may evict within "
                             "--evict-window, whatever leases or connections they came from (default: as "
                             f"--max-lease-evict-fraction, {MAX_LEASE_EVICT_FRACTION:g})")
    parser.add_argument("--evict-window", type=_positive_seconds, default=EVICT_WINDOW_S, metavar="S",
                        help="seconds over which --max-lease-evict-fraction and --max-peer-evict-fraction count "
                             f"evictions (default {EVICT_WINDOW_S:g})")
    parser.add_argument("--max-fence", type=_positive_seconds, default=MAX_FENCE_S, metavar="S",
                        help="seconds a lapsed reservation's pages stay fenced while its writer's lease lives "
                             f"(default {MAX_FENCE_S:g})")
    parser.add_argument("--max-aliases", type=_count_arg, default=DEFAULT_MAX_ALIASES, metavar="N",
                        help="block aliases the index keeps, least recently used out beyond (about 190 bytes "
                             f"each at most; default {DEFAULT_MAX_ALIASES})")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def read_token(path: str) -> str:
    """The token in ``path`` (surrounding whitespace removed); ``ValueError`` if unusable:
    unreadable, empty, shorter than ``MIN_TOKEN_CHARS``, or a file others may read or write."""
    try:
        with open(path, encoding="utf-8") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --token-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if mode & 0o007:
        raise ValueError(
            f"--token-file {path} is open to other users (mode {stat.S_IMODE(mode):04o}); "
            f"run chmod 600 (or 640/440) on it"
        )
    if not token:
        raise ValueError(f"--token-file {path} is empty: write the cache's token into it")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"--token-file {path} holds a token of {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(e.g. openssl rand -hex 16)"
        )
    return token


def open_pool(path: str, size: int | None, page_size: int | None, offset: int = 0) -> tuple[Any, bool]:
    """Create the pool at ``offset`` of ``path`` or attach the one there (see
    the module docstring); return it and whether it was created just now."""
    from maru_core.pool import DEFAULT_PAGE_SIZE, Pool, PoolFormatError, PoolSizeError
    from maru_core.pool.truncation import drop_lost_objects, regrow_file

    if not os.path.exists(path):
        if offset:
            raise ValueError(
                f"nothing at {path}: --pool-offset {offset} names a region of an existing DAX device "
                "(or file); check --pool"
            )
        if size is None:
            raise ValueError(f"no pool at {path}: pass --pool-size to create one")
        return Pool.create(path, size, page_size or DEFAULT_PAGE_SIZE, creator="marucache index"), True
    lost_from = regrow_file(path, offset)  # a pool file truncated while no index ran
    try:
        pool, fresh = Pool.attach(path, expected_size=size, offset=offset), False
    except (PoolFormatError, PoolSizeError) as found:
        if not _is_region(path, size, offset):
            raise
        pool, fresh = _make_region_pool(path, size, page_size or DEFAULT_PAGE_SIZE, offset, found), True
    if lost_from is not None and not fresh:
        dropped = drop_lost_objects(pool, lost_from)
        log.error("the pool file %s ended at pool byte %d of %d: a process truncated it. Its size is back; "
                  "the %d objects whose bytes were lost are dropped", path, lost_from, pool.geometry.size, dropped)
    if page_size is not None and page_size != pool.geometry.page_size:
        pool.close()
        raise ValueError(
            f"the pool at {path} has {pool.geometry.page_size}-byte pages, not --page-size {page_size}"
        )
    return pool, fresh


def _is_region(path: str, size: int | None, offset: int) -> bool:
    """Whether the pool is (to be) a region of a device or of a larger file, made in place."""
    st = os.stat(path)
    return not stat.S_ISREG(st.st_mode) or offset > 0 or (size is not None and size < st.st_size)


def _make_region_pool(path: str, size: int | None, page_size: int, offset: int, found: Exception) -> Any:
    """A new pool in the region at ``offset`` of ``path``, where no pool of this region is.

    A blank region (a new device) is initialised. Any other content is
    replaced only where the region is the index's own: a ``--pool-size``
    region of a DAX device, or past byte 0 of a file. The operator's ledger
    gives each cache its region, so what lies there is left from an earlier
    allocation of the device (a pool of another size or offset, or the data
    of a deleted cache), never another cache's live pool. A pool file of its
    own (at byte 0 of a regular file) is never overwritten.
    """
    from maru_core.pool import Pool, PoolExists

    try:
        return Pool.create(path, size, page_size, offset=offset, exist_ok=True, creator="marucache index")
    except PoolExists:
        owned = size is not None and (offset > 0 or not stat.S_ISREG(os.stat(path).st_mode))
        if not owned:
            raise found from None
    log.warning(
        "the region of %d bytes at offset %d of %s holds no pool of this region (%s); it is left from an "
        "earlier allocation of the device: making a new, empty pool there", size, offset, path, found,
    )  # fmt: skip
    return Pool.create(path, size, page_size, offset=offset, force=True, creator="marucache index")


def _peer_quotas(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--max-peer-*`` flags given; the others follow their lease's (``build_service``)."""
    flags = ("max_peer_pool_fraction", "max_peer_pin_fraction", "max_peer_evict_fraction")
    return {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The server's limits as the flags set them (``ValueError`` for an impossible one)."""
    from maru_core.index.limits import ServerLimits

    return ServerLimits(
        max_connections=args.max_connections, hello_timeout_s=args.hello_timeout,
        frame_timeout_s=args.frame_timeout, idle_timeout_s=args.idle_timeout,
        max_receive_bytes=args.max_receive_mib << 20,
        max_leases_per_connection=args.max_leases_per_connection,
        turn_s=args.turn_ms / 1e3, shared_turn_s=args.shared_turn_ms / 1e3,
        peer_connection_rate=args.peer_connection_rate, peer_connection_burst=args.peer_connection_burst,
        peer_auth_failure_rate=args.peer_auth_failure_rate, peer_auth_failure_burst=args.peer_auth_failure_burst,
        peer_receive_rate=args.peer_receive_rate_mib * 2**20, peer_receive_burst=args.peer_receive_burst_mib << 20,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from maru_core.pool import PoolError
    from maru_core.protocol import TcpAddress

    if args.low_watermark >= args.high_watermark:
        print(f"marucache index: error: --low-watermark {args.low_watermark} must be below "
              f"--high-watermark {args.high_watermark}", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file) if args.token_file else None
        limits = server_limits(args)
        pool, fresh = open_pool(args.pool, args.pool_size, args.page_size, args.pool_offset)
    except (ValueError, PoolError) as exc:
        print(f"marucache index: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    if args.metrics_addr is None:
        args.metrics_addr = args.listen.host if isinstance(args.listen, TcpAddress) else "127.0.0.1"
    if token is None and isinstance(args.listen, TcpAddress) and not _is_loopback(args.listen.host):
        log.warning("no --token-file: anyone who can reach %s may use (and fill) this cache", args.listen)
    try:
        return asyncio.run(_serve(args, pool, token, fresh, limits))
    except _MetricsError as exc:
        print(f"marucache index: error: cannot serve metrics on {args.metrics_addr}:{args.metrics_port}: "
              f"{exc.error.strerror or exc.error}", file=sys.stderr)  # fmt: skip
        return 2
    except OSError as exc:
        print(f"marucache index: error: cannot listen on {args.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        pool.close()


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _MetricsError(Exception):
    """The metrics endpoint could not be served (its cause is the ``OSError``)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


async def _serve(args: argparse.Namespace, pool: Any, token: str | None, fresh: bool, limits: Any) -> int:
    from maru_core.index.service import build_service, freeze_startup_objects

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    service = build_service(
        pool,
        token=token,
        lease_ttl_s=args.lease_ttl,
        reservation_ttl_s=args.reservation_ttl,
        with_metrics=args.metrics_port is not None,
        fresh_pool=fresh,
        watermarks=(args.high_watermark, args.low_watermark),
        limits=limits,
        max_evict_fraction=args.max_evict_fraction,
        max_lease_pool_fraction=args.max_lease_pool_fraction,
        max_fence_s=args.max_fence,
        max_lease_pin_fraction=args.max_lease_pin_fraction,
        max_lease_evict_fraction=args.max_lease_evict_fraction,
        evict_window_s=args.evict_window,
        max_aliases=args.max_aliases,
        **_peer_quotas(args),
    )
    log.debug("%d start-up objects frozen: full garbage collections walk only what serving creates",
             freeze_startup_objects())
    try:
        if args.metrics_port is not None:  # before listening: a taken port is reported before any client arrives
            assert service.metrics is not None  # built with_metrics
            try:
                port = service.metrics.serve(args.metrics_port, args.metrics_addr)
            except OSError as exc:
                raise _MetricsError(exc) from exc
            print(f"marucache index: metrics on http://{args.metrics_addr}:{port}/metrics", flush=True)
        bound = await service.server.start(args.listen)
        g = pool.geometry
        print(
            f"marucache index: pool {args.pool} at offset {pool.offset} ({g.capacity_bytes} bytes in "
            f"{g.num_pages} pages, uuid {g.uuid}, {service.restored} objects restored); listening on {bound}",
            flush=True,
        )
        await stop.wait()
        log.info("shutting down")
    finally:
        await service.close()
    return 0
