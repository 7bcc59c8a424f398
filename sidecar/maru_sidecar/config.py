"""The sidecar's settings, parsed once from flags and the downward-API environment."""

from __future__ import annotations

import argparse
import grp
import math
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from maru_core.protocol.url import parse_url

DEFAULT_METRICS_PORT = 9477
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: The shortest cache token accepted (the index requires the same).
MIN_TOKEN_CHARS = 16
# A Unix socket path longer than this does not fit in sockaddr_un.
_MAX_SOCKET_PATH = 107


class ConfigError(ValueError):
    """A setting the sidecar cannot run with; the message names the flag to change."""


def _on_read_only_mount(path: str | os.PathLike[str]) -> bool:
    """A file on a read-only mount, such as a Kubernetes Secret volume: only the
    containers of the pod see that mount, so a mode open to "others" there
    opens it to the pod's own containers (the webhook mounts the token 0444
    so that the non-root sidecar and vLLM can both read it without an fsGroup)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the sidecar needs to run; built once by `from_args`."""

    pool_path: Path
    pool_offset: int  # where the pool starts in its device (a region of a shared device), 0 otherwise
    socket_path: Path
    index_url: str
    token_file: Path | None
    cache: str
    namespace: str
    pod: str
    metrics_host: str
    metrics_port: int  # 0: an ephemeral port, printed at start
    index_timeout_s: float
    socket_gid: int | None = None  # group of the hand-off socket (--socket-group); None: the sidecar's own

    @property
    def stats_dir(self) -> Path:
        """The connectors' stats regions live beside the socket, in the shared volume."""
        return self.socket_path.parent

    @property
    def labels(self) -> dict[str, str]:
        return {"cache": self.cache, "namespace": self.namespace, "pod": self.pod}

    def read_token(self) -> str | None:
        """The cache token, read afresh each time so that a rotated Secret takes effect."""
        if self.token_file is None:
            return None
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                mode = os.fstat(fh.fileno()).st_mode
                token = fh.read().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {self.token_file}: cannot read it ({exc.strerror})") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--token-file {self.token_file}: not a text file ({exc.reason})") from exc
        if mode & 0o007 and not _on_read_only_mount(self.token_file):
            raise ConfigError(
                f"--token-file {self.token_file} is open to other users (mode {stat.S_IMODE(mode):04o}); "
                "make it 0600, 0640 or 0440, or mount it read-only (a Secret volume)"
            )
        if not token:
            raise ConfigError(f"--token-file {self.token_file} is empty; it must hold the cache token")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"--token-file {self.token_file} holds a token of {len(token)} characters; use at least {MIN_TOKEN_CHARS}"
            )
        return token

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> SidecarConfig:
        env = os.environ if environ is None else environ
        socket_path = Path(args.socket).absolute()
        if len(os.fsencode(socket_path)) > _MAX_SOCKET_PATH:
            raise ConfigError(f"--socket {socket_path} is longer than {_MAX_SOCKET_PATH} bytes; use a shorter path")
        if not socket_path.parent.is_dir():
            raise ConfigError(f"--socket {socket_path}: directory {socket_path.parent} does not exist")
        try:
            parse_url(args.index)  # the index client's own check of its address
        except ValueError as exc:
            raise ConfigError(f"--index: {exc}; expected tcp://HOST:PORT or unix:///PATH") from None
        pool_offset = _pool_offset(args.pool_offset)
        if not 0 <= args.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {args.metrics_port}: expected 0..65535")
        if not (0 < args.index_timeout <= 60 and math.isfinite(args.index_timeout)):
            raise ConfigError(f"--index-timeout {args.index_timeout}: expected seconds above 0 and at most 60")
        if str(getattr(args, "log_level", "INFO")).upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {args.log_level}: expected one of {', '.join(LOG_LEVELS)}")
        config = cls(
            pool_path=Path(args.pool),
            pool_offset=pool_offset,
            socket_path=socket_path,
            index_url=args.index,
            token_file=Path(args.token_file) if args.token_file else None,
            cache=args.cache or env.get("MARU_CACHE_NAME") or "default",
            namespace=args.namespace or env.get("POD_NAMESPACE") or "local",
            pod=args.pod or env.get("POD_NAME") or socket.gethostname(),
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            index_timeout_s=args.index_timeout,
            socket_gid=_group_id(getattr(args, "socket_group", None)),
        )
        config.read_token()  # fail at start, not at the first hand-off
        return config


def _group_id(group: str | None) -> int | None:
    """The gid of ``--socket-group`` (a group name or a number)."""
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group {group}: no such group; give a group name of this system or a gid") from None


def _pool_offset(text: str) -> int:
    from maru_core.index.cli import parse_offset

    try:
        return parse_offset(text)
    except ValueError as exc:
        raise ConfigError(f"--pool-offset {text}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `marucache sidecar` flags."""
    parser.add_argument("--pool", required=True, help="the pool: a DAX device (/dev/daxX.Y) or a tmpfs file")
    parser.add_argument(
        "--pool-offset", default="0", metavar="BYTES",
        help="where the pool starts in --pool, a multiple of 2Mi (bytes, 512Mi, 2Gi; default 0): "
             "the pool's region of a device shared with other caches",
    )  # fmt: skip
    parser.add_argument(
        "--socket", required=True, help="Unix socket to serve the pool on; its directory holds the stats regions"
    )
    parser.add_argument("--index", required=True, help="the index address, tcp://HOST:PORT or unix:///PATH")
    parser.add_argument(
        "--socket-group", metavar="GROUP",
        help="group (name or gid) given the hand-off socket, which is mode 0660: the vLLM container's group "
             "(default: the sidecar's own group)",
    )  # fmt: skip
    parser.add_argument(
        "--token-file",
        help=f"file holding the cache token (a mounted Secret; not readable by others, at least {MIN_TOKEN_CHARS} "
             "characters); without it, no auth",
    )  # fmt: skip
    parser.add_argument("--cache", help="the MaruCache name (default: $MARU_CACHE_NAME or 'default')")
    parser.add_argument("--namespace", help="metrics label (default: $POD_NAMESPACE or 'local')")
    parser.add_argument("--pod", help="metrics label (default: $POD_NAME or the host name)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the HTTP endpoints (default 0.0.0.0)")
    parser.add_argument(
        "--metrics-port", type=_int_arg, default=DEFAULT_METRICS_PORT,
        help=f"port of /metrics, /healthz, /readyz (default {DEFAULT_METRICS_PORT}; 0 picks a free one)",
    )  # fmt: skip
    parser.add_argument(
        "--index-timeout", type=_float_arg, default=1.0, help="seconds the readiness probe waits for the index"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
