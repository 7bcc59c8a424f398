"""The sidecar's settings, parsed once from flags and the downward-API environment."""

from __future__ import annotations

import argparse
import grp
import math
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from maru_core.pod_credentials import check_pod
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
    # `namespace/name` of the pod when told (--pod NAMESPACE/NAME or the downward API), else None:
    # the hand-off accepts a pod credential only of this pod
    pod_identity: str | None = None
    credential_file: Path | None = None  # where the pod's credential is written (--credential-file)

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
        namespace, pod, pod_identity = _pod_names(args, env)
        credential_file = _credential_file(args, pod_identity)
        config = cls(
            pool_path=Path(args.pool),
            pool_offset=pool_offset,
            socket_path=socket_path,
            index_url=args.index,
            token_file=Path(args.token_file) if args.token_file else None,
            cache=args.cache or env.get("MARU_CACHE_NAME") or "default",
            namespace=namespace,
            pod=pod,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            index_timeout_s=args.index_timeout,
            socket_gid=_group_id(getattr(args, "socket_group", None)),
            pod_identity=pod_identity,
            credential_file=credential_file,
        )
        config.read_token()  # fail at start, not at the first hand-off
        return config


def _pod_names(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str, str | None]:
    """The metric labels (namespace, pod) and the pod's identity ``namespace/name``, None when
    either part is not told (then the labels fall back to 'local' and the host name).

    ``--pod`` is a name or ``NAMESPACE/NAME``; an identity given in full is checked here, one
    put together from separate parts only when a credential depends on it (`_credential_file`).
    """
    namespace, name = args.namespace or env.get("POD_NAMESPACE"), args.pod or env.get("POD_NAME")
    if args.pod and "/" in args.pod:
        try:
            check_pod(args.pod)
        except ValueError as exc:
            raise ConfigError(f"--pod: {exc}") from None
        told_namespace, name = args.pod.split("/")
        if args.namespace and args.namespace != told_namespace:
            raise ConfigError(f"--pod {args.pod} and --namespace {args.namespace} name two namespaces; "
                              "give the namespace once")  # fmt: skip
        namespace = told_namespace
    identity = f"{namespace}/{name}" if namespace and name else None
    return namespace or "local", name or socket.gethostname(), identity


def _credential_file(args: argparse.Namespace, pod_identity: str | None) -> Path | None:
    """``--credential-file``, checked: it needs the token to mint with and the pod to name."""
    path_text = getattr(args, "credential_file", None)
    if not path_text:
        return None
    path = Path(path_text).absolute()
    if not args.token_file:
        raise ConfigError(f"--credential-file {path} needs the cache token to mint the credential with; "
                          "set --token-file")  # fmt: skip
    if pod_identity is None:
        raise ConfigError(f"--credential-file {path} needs the pod's identity; set --pod NAMESPACE/NAME "
                          "(or the environment variables POD_NAMESPACE and POD_NAME, from the downward API)")
    try:
        check_pod(pod_identity)
    except ValueError as exc:
        raise ConfigError(f"--credential-file needs a valid pod identity (--pod or $POD_NAMESPACE/$POD_NAME): "
                          f"{exc}") from None
    if not path.parent.is_dir():
        raise ConfigError(f"--credential-file {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ConfigError(f"--credential-file {path} is a directory; give the path of the file to write")
    if path.exists() and path.resolve() == Path(args.token_file).resolve():
        raise ConfigError(f"--credential-file {path} is the --token-file: the token would be overwritten; "
                          "give the credential a path of its own (beside the hand-off socket)")
    if path == Path(args.socket).absolute():
        raise ConfigError(f"--credential-file {path} is the --socket; give the credential a path of its own")
    return path


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
    parser.add_argument(
        "--pod", metavar="[NAMESPACE/]NAME",
        help="the pod: metrics label, and with its namespace the identity a pod credential names "
             "(default: $POD_NAMESPACE/$POD_NAME, from the downward API; labels else 'local' and the host name)",
    )  # fmt: skip
    parser.add_argument(
        "--credential-file", metavar="PATH",
        help="write this pod's credential here (mode 0440, group --socket-group), minted from the cache token "
             "(needs --token-file and the pod's identity): the token file of the vLLM container",
    )  # fmt: skip
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
