"""The ledger ConfigMap store against kmock: group commit within a process, compare-and-swap across."""

from __future__ import annotations

import asyncio

from maru_operator.inventory import Device
from maru_operator.k8s import KubeApi, LedgerStore, load_configuration
from maru_operator.ledger import Claim, Ledger, NoSpace
from maru_operator.models import CacheRef

GiB = 1 << 30
DEVICE = Device("cxl-big", "dax", 64 * GiB, {"n1": "/dev/dax0.0"})


def allocate(i: int, size: int = GiB):
    def change(led: Ledger) -> tuple[Ledger, Claim]:
        return led.allocate(CacheRef("ns", f"c{i}", f"uid-{i}"), "dax", size, [DEVICE])
    return change


def ledger_writes(cluster, name: str = "marucache-ledger") -> int:
    """Writes the API server received for the ledger ConfigMap (creation included)."""
    def count() -> int:
        return sum(1 for r in cluster.emulator if r.method.value in ("POST", "PATCH", "PUT")
                   and r.url.path.startswith("/api/v1/namespaces/maru-system/configmaps")
                   and (r.url.path.endswith(f"/{name}") or (r.data or {}).get("metadata", {}).get("name") == name))
    return cluster.call(count)


def assert_disjoint(claims: list[dict]) -> bool:
    spans = sorted((c["offset"], c["offset"] + c["size"]) for c in claims)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    return True


def test_updates_queued_behind_a_write_are_stored_with_one_write(cluster, options):
    async def go():
        api = KubeApi(load_configuration(options.kubeconfig))
        store = LedgerStore(api, "maru-system")
        try:
            # The first caller starts a write; the 39 that queue behind it go in one batch.
            claims = await asyncio.gather(*(store.update(allocate(i)) for i in range(40)))
            return claims, store.writes, store.conflicts, await store.read()
        finally:
            api.close()

    claims, writes, conflicts, (stored, _version) = asyncio.run(go())
    assert writes == 2 and conflicts == 0, (writes, conflicts)
    assert ledger_writes(cluster) == 2 and cluster.emulator.conflicts == 0
    assert sorted(claims, key=lambda c: c.owner.uid) == sorted(stored.claims, key=lambda c: c.owner.uid)
    assert len({c.owner.uid for c in claims}) == 40
    assert_disjoint([c.to_dict() for c in claims]) and stored.overlapping_pairs() == []


def test_a_change_that_fails_fails_only_its_caller(cluster, options):
    async def go():
        api = KubeApi(load_configuration(options.kubeconfig))
        store = LedgerStore(api, "maru-system")
        try:
            await store.update(allocate(0))
            results = await asyncio.gather(store.update(allocate(1)), store.update(allocate(2, 63 * GiB)),
                                           store.update(allocate(3)), return_exceptions=True)
            return results, await store.read()
        finally:
            api.close()

    (first, too_big, third), (stored, _version) = asyncio.run(go())
    assert isinstance(too_big, NoSpace), too_big
    assert {c.owner.uid for c in stored.claims} == {"uid-0", "uid-1", "uid-3"}
    assert {first, third} <= set(stored.claims)


def test_two_operators_racing_never_overlap(cluster, options):
    """Two processes' stores: the resourceVersion precondition makes the loser re-read and re-apply."""
    async def go():
        apis = [KubeApi(load_configuration(options.kubeconfig)) for _ in range(2)]
        stores = [LedgerStore(api, "maru-system") for api in apis]
        try:
            await stores[0].update(allocate(100))
            await stores[1].update(lambda led: (led, None))  # both now hold the same version of the ledger
            results = await asyncio.gather(*(stores[i % 2].update(allocate(i)) for i in range(30)))
            return results, [s.conflicts for s in stores], await stores[0].read()
        finally:
            for api in apis:
                api.close()

    results, conflicts, (stored, _version) = asyncio.run(go())
    assert len(stored.claims) == 31 and set(results) <= set(stored.claims)
    assert_disjoint([c.to_dict() for c in stored.claims]) and stored.overlapping_pairs() == []
    # Both first batches were written against that version: one of them was refused and re-applied.
    assert sum(conflicts) >= 1 and cluster.emulator.conflicts == sum(conflicts)
