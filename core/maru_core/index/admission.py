"""Who a connection's peer is, and what its per-peer budgets let it cost.

The index's side of ``maru_core.index.peers``. Every new connection spends
its address's connection budget at accept (``admit``); every read spends its
peer's budget of bytes received (``received``); a ``hello`` presents the
cache token or a pod credential minted with it (``authenticate``). A
credential makes the connection's peer its pod, which from then on pays for
the connection instead of its address (``charge_pod``); a wrong token is
answered ``auth``, and held back once its peer's failures are over budget.
Each time a budget holds a peer to it, ``maru_index_rate_limited_total
{reason}`` counts it and a line is logged (at most one per ten seconds).
"""

from __future__ import annotations

import collections
import hmac
import logging
from typing import TYPE_CHECKING

from maru_core import pod_credentials
from maru_core.index.listen import RateLimitedLog
from maru_core.protocol import ErrorType, ProtocolError

if TYPE_CHECKING:
    from maru_core.index.connection import Connection
    from maru_core.index.limits import ServerLimits
    from maru_core.index.metrics import IndexMetrics

log = logging.getLogger(__name__)

#: How a pod that presented its credential is named as a peer (addresses and ``uid N`` never start so).
POD_PEER = "pod:"
#: The line logged (at most one per 10 s) when a peer is held to a budget, by reason.
_HELD_LOGS = {
    "connections": "closing new connections from %s: over its budget of connections "
                   "(--peer-connection-rate/--peer-connection-burst)",
    "auth_failures": "holding back the answers to wrong tokens from %s: over its budget of auth failures "
                     "(--peer-auth-failure-rate/--peer-auth-failure-burst)",
    "received_bytes": "reading %s's connections more slowly: over its budget of received bytes "
                      "(--peer-receive-rate-mib/--peer-receive-burst-mib)",
}


class Admission:
    """The per-peer budgets of one index server and its ``hello``'s authentication
    (see the module docstring). ``token``: the cache token (``None``: none is needed);
    ``metrics``: an optional ``IndexMetrics``; ``refusals``: the server's log of bad peers."""

    def __init__(self, limits: "ServerLimits", token: str | None, metrics: "IndexMetrics | None",
                 refusals: RateLimitedLog) -> None:
        self._limits = limits
        self._token = token or None  # also the key pod credentials are minted with
        self._metrics = metrics
        self._refusals = refusals
        self._peers = limits.peer_limiter()
        self.rate_limited: collections.Counter[str] = collections.Counter()
        self._held_log = RateLimitedLog(log, interval_s=10.0)  # a flood of refusals: a line per 10 s

    def admit(self, peer: str) -> bool:
        """A socket of ``peer`` was just accepted: whether its peer's budget of connections lets it in."""
        refused = self._peers.admit(peer)
        if refused is not None:
            self._held(refused, peer)
        return refused is None

    def refund(self, peer: str) -> None:
        """A connection of ``peer`` went away before sending a byte: its connection token comes back."""
        self._peers.refund(peer)

    def received(self, conn: "Connection", nbytes: int) -> float:
        """``conn`` read ``nbytes``: how long it must not be read again, over its peer's budget."""
        hold_s = self._peers.received(conn.peer_key, nbytes)
        if hold_s > 0:
            self._held("received_bytes", conn.peer_key)
        return hold_s

    def authenticate(self, conn: "Connection", args: dict) -> str:
        """The peer a ``hello`` opens its lease for: the pod its credential names (whatever the
        address it comes from), else its connection's peer when it presents the token (or none is
        required); else ``auth``, and the connection is closed after the answer."""
        if self._token is None:
            return conn.peer_key
        offered = args["token"] or ""
        pod = pod_credentials.pod_of(self._token, offered) if offered else None
        if pod is not None:
            return f"{POD_PEER}{pod}"
        if hmac.compare_digest(offered.encode(), self._token.encode()):
            return conn.peer_key
        conn.close_after_reply = "auth"
        self._refusals.warning("wrong or missing token from %s (client %r): closing the connection",
                               conn.peer, str(args["client"])[:64])  # fmt: skip
        backoff = min(self._peers.auth_failed(conn.peer_key), self._limits.hello_timeout_s)
        if backoff > 0:  # the failing connection pays, not its neighbours
            conn.hold_last_reply_s = backoff
            self._held("auth_failures", conn.peer_key)
        if self._metrics is not None:
            self._metrics.count_auth_failure()
        if pod_credentials.is_credential(offered):
            raise ProtocolError(ErrorType.AUTH, "a pod credential not minted with this cache's token (another "
                                "cache's, or forged); the pod's sidecar writes the right one")
        raise ProtocolError(
            ErrorType.AUTH,
            "wrong or missing token; use the token of this cache's index (its token file or Secret)",
        )

    def charge_pod(self, conn: "Connection", peer: str) -> None:
        """``conn``'s ``hello`` opens a lease for ``peer``: on a connection's first credential
        ``hello``, the connection token its address spent at accept comes back, and its pod spends
        one of its own instead, or the connection is closed (``quota``). So a pod that opens
        connections without end empties its own budget, never the budget of the pods behind its
        address (a NAT, a node's hostNetwork pods)."""
        if peer == conn.peer_key or conn.peer_key.startswith(POD_PEER):
            return
        self._peers.refund(conn.peer_key)
        if self._peers.admit(peer) is not None:
            conn.close_after_reply = "connection_limit"
            self._held("connections", peer)
            raise ProtocolError(ErrorType.QUOTA, f"{peer} opens connections faster than its budget "
                                "(--peer-connection-rate, --peer-connection-burst): keep connections open and reuse them")

    def _held(self, reason: str, peer: str) -> None:
        """``peer`` was held to its budget of ``reason``: count it, log it (rate-limited)."""
        self.rate_limited[reason] += 1
        if self._metrics is not None:
            self._metrics.count_rate_limited(reason)
        self._held_log.warning(_HELD_LOGS[reason], peer)
