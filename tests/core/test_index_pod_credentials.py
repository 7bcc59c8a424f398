"""Per-pod credentials on a real index process: two pods behind one address
(as behind a NAT, or hostNetwork pods) are two peers, each with its own
share of the pins and of the pool (fair-share eviction), while two clients
of that address with the cache token stay one peer; a credential minted
with another token, or with its pod's name changed, is refused with
``auth``."""

from __future__ import annotations

import urllib.request

import pytest
from quota_objects import numbered, store
from test_index_fair_eviction import NO_EVICTION_WINDOWS, _keys, _store_what_fits
from test_index_peer_quotas import serve

from maru_core import pod_credentials
from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.pool import Pool
from maru_tools.index_process import IndexProcess


def _client(index: IndexProcess, token: str) -> IndexClient:
    client = IndexClient(index.url, token=token, client_name="marucache-testing", timeout_s=5.0)
    client.connect()
    return client


def _pins_until_refused(clients: list[IndexClient], keys: list[bytes]) -> tuple[int, IndexRejected | None]:
    """Pin ``keys`` 250 at a time, the clients (leases of one pod) in turn, until refused."""
    pinned = 0
    for n, start in enumerate(range(0, len(keys), 250)):
        try:
            clients[n % len(clients)].retrieve(keys[start : start + 250])
        except IndexRejected as exc:
            return pinned, exc
        pinned += len(keys[start : start + 250])
    return pinned, None


@pytest.mark.parametrize("by_pod", [True, False], ids=["pod credentials", "cache token"])
def test_two_pods_behind_one_address_have_a_share_each(by_pod):
    """Two leases per pod (an engine's scheduler and worker), so the peer's quota binds, not a lease's."""
    process, _ = serve()
    with process as index, Pool.attach(index.pool_path) as pool:
        tokens = ([pod_credentials.mint(index.token, f"team-a/vllm-{n}") for n in range(2)] if by_pod
                  else [index.token, index.token])  # fmt: skip
        pod_a, pod_b = ([_client(index, token) for _ in range(2)] for token in tokens)  # all from 127.0.0.1
        try:
            pages = pool.geometry.num_pages
            keys = numbered(1, int(0.9 * pages))
            for start in range(0, len(keys), 1000):
                store(pod_a[0], pool, keys[start : start + 1000])
            share = pages // 2  # a peer's default pin quota
            split = int(0.6 * pages)
            pinned_a, refused_a = _pins_until_refused(pod_a, keys[:split])
            assert refused_a is not None and refused_a.error_type == "quota"
            assert "--max-peer-pin-fraction" in refused_a.message
            assert share - 250 < pinned_a <= share
            pinned_b, refused_b = _pins_until_refused(pod_b, keys[split - 1000 :])
            if by_pod:
                assert "peer pod:team-a/vllm-0" in refused_a.message
                assert refused_b is None, refused_b  # its own share: the other pod's pins cost it nothing
                assert pinned_b == len(keys) - split + 1000
            else:
                assert "peer 127.0.0.1" in refused_a.message
                assert refused_b is not None and pinned_b == 0  # one peer: its share is spent
        finally:
            for client in pod_a + pod_b:
                client.close()


def test_a_pod_storing_without_end_leaves_a_neighbour_pods_objects_within_its_share():
    """The fair-share test of ``test_index_fair_eviction``, both pods behind one address:
    with the cache token they would be one peer, and the victim's objects the oldest of it."""
    process, _ = serve(*NO_EVICTION_WINDOWS)
    with process as index, Pool.attach(index.pool_path) as pool:
        pages = pool.geometry.num_pages
        victim = _client(index, pod_credentials.mint(index.token, "team-a/victim"))
        attacker = _client(index, pod_credentials.mint(index.token, "team-a/attacker"))
        try:
            mine = numbered(1, pages // 8)
            store(victim, pool, mine)
            stored = 0
            while stored < 3 * pages:
                stored += _store_what_fits(attacker, pool, _keys(stored, 1000))
            assert victim.stats()["evictions"] >= 2 * pages  # the attacker turned the pool over
            assert victim.retrieve(mine).misses() == 0, "the neighbour pod evicted the victim's objects"
            assert victim.unpin(mine) == len(mine)
        finally:
            attacker.close()
            victim.close()


def test_forged_credentials_are_refused():
    process, _ = serve()
    with process as index:
        genuine = pod_credentials.mint(index.token, "team-a/vllm-0")
        other_cache = pod_credentials.mint("another cache's token, long enough", "team-a/vllm-0")
        renamed = genuine.replace("vllm-0", "vllm-1")
        for credential in (other_cache, renamed, genuine[:-1]):
            with pytest.raises(IndexRejected) as refused:
                _client(index, credential)
            assert refused.value.error_type == "auth"
            assert "pod credential not minted with this cache's token" in refused.value.message
        _client(index, genuine).close()


def test_a_pod_opening_connections_without_end_spends_its_own_budget_not_its_addresss():
    """Connections are charged to their address at accept (nothing is known of them before they
    speak) and to their pod from its credential ``hello`` on. Before, a pod's 30 connections spent
    its address's 20 tokens and every other pod behind that address was reset at accept."""
    process, metrics_port = serve("--peer-connection-burst", "20", "--peer-connection-rate", "0.01")
    with process as index:
        hog = pod_credentials.mint(index.token, "team-a/hog")
        held, refused = [], []
        for _ in range(30):
            try:
                held.append(_client(index, hog))
            except IndexRejected as exc:
                refused.append(exc)
        assert len(held) == 20, "the pod's own budget: 20 connections"
        assert refused and all(exc.error_type == "quota" and "--peer-connection-rate" in exc.message
                               and "pod:team-a/hog" in exc.message for exc in refused)  # fmt: skip
        neighbours = [_client(index, pod_credentials.mint(index.token, f"team-a/vllm-{n}")) for n in range(5)]
        neighbours.append(_client(index, index.token))  # a client of the address with the cache token too
        assert all(c.stats()["keys"] >= 0 for c in neighbours)
        assert _rate_limited(metrics_port, "connections") == len(refused)
        for client in held + neighbours:
            client.close()


def _rate_limited(metrics_port: int, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith(f'maru_index_rate_limited_total{{reason="{reason}"}}')))  # fmt: skip
