"""Index addresses: ``tcp://HOST:PORT`` or ``unix:///PATH``."""

from __future__ import annotations

import ipaddress
from typing import NamedTuple, Union
from urllib.parse import urlsplit


class TcpAddress(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


class UnixAddress(NamedTuple):
    path: str

    def __str__(self) -> str:
        return f"unix://{self.path}"


Address = Union[TcpAddress, UnixAddress]


def parse_url(url: str) -> Address:
    """Parse an index address; raise ``ValueError`` saying what a valid one looks like.

    ``tcp://HOST:PORT`` (an IPv6 host in brackets; port 0 lets a server pick
    one) or ``unix:///ABSOLUTE/PATH``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(
            f"index address {url!r} has no scheme; use tcp://HOST:PORT or unix:///PATH"
        )
    parts = urlsplit(url)
    if parts.scheme == "unix":
        path = url[len("unix://") :]
        if not path.startswith("/") or path == "/":
            raise ValueError(f"index address {url!r}: a Unix socket needs an absolute path, unix:///PATH")
        return UnixAddress(path)
    if parts.scheme != "tcp":
        raise ValueError(
            f"index address {url!r}: scheme {parts.scheme!r} is not supported; use tcp:// or unix://"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"index address {url!r}: only tcp://HOST:PORT is allowed, nothing after the port")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"index address {url!r}: port must be an integer 0-65535") from exc
    host = parts.hostname
    if not host or port is None:
        raise ValueError(f"index address {url!r} needs both a host and a port: tcp://HOST:PORT")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ValueError(f"index address {url!r}: {host!r} is not an IPv6 address") from exc
    return TcpAddress(host, port)
