"""The region ledger: allocation, resize, release, persistence, rebuild."""

import pytest
from hypothesis import given, settings, strategies as st

from maru_operator.inventory import Device
from maru_operator.ledger import ALIGN, Claim, Drain, Impossible, Ledger, NoSpace, Region, rebuild
from maru_operator.models import CacheRef

GiB = 1 << 30


def dev(uuid: str, size: int, cls: str = "dax", nodes=("n1",)) -> Device:
    return Device(uuid, cls, size, {n: "/dev/dax0.0" for n in nodes})


def ref(i: int) -> CacheRef:
    return CacheRef("ns", f"c{i}", f"uid-{i}")


def test_allocate_is_idempotent_and_aligned():
    devices = [dev("a", 10 * GiB)]
    led, claim = Ledger().allocate(ref(1), "dax", 3 * GiB + 1, devices)
    assert claim.region == Region("a", 0, 3 * GiB + ALIGN)
    again, same = led.allocate(ref(1), "dax", 3 * GiB + 1, devices)
    assert again is led and same == claim


def test_best_fit_prefers_the_tightest_gap():
    devices = [dev("a", 10 * GiB), dev("b", 4 * GiB)]
    led, c1 = Ledger().allocate(ref(1), "dax", 4 * GiB, devices)
    assert c1.region.device_uuid == "b"  # b fits exactly
    led, c2 = led.allocate(ref(2), "dax", 2 * GiB, devices)
    assert c2.region == Region("a", 0, 2 * GiB)


def test_impossible_and_no_space_are_told_apart():
    devices = [dev("a", 4 * GiB)]
    with pytest.raises(Impossible):
        Ledger().allocate(ref(1), "dax", 5 * GiB, devices)
    with pytest.raises(Impossible):
        Ledger().allocate(ref(1), "shm", GiB, devices)
    led, _ = Ledger().allocate(ref(1), "dax", 3 * GiB, devices)
    with pytest.raises(NoSpace):
        led.allocate(ref(2), "dax", 2 * GiB, devices)
    led = led.release("uid-1")
    assert led.allocate(ref(2), "dax", 2 * GiB, devices)[1].region.offset == 0


def test_resize_grows_in_place_when_the_neighbour_allows_and_moves_otherwise():
    devices = [dev("a", 12 * GiB)]
    led, _ = Ledger().allocate(ref(1), "dax", 2 * GiB, devices)
    led, grown = led.allocate(ref(1), "dax", 4 * GiB, devices)
    assert grown.region == Region("a", 0, 4 * GiB)
    led, c2 = led.allocate(ref(2), "dax", 2 * GiB, devices)
    led, moved = led.allocate(ref(1), "dax", 5 * GiB, devices)
    assert moved.region == Region("a", c2.region.end, 5 * GiB) and len(led.claims) == 2
    assert not led.overlapping_pairs()


def test_json_round_trip_and_foreign_format():
    led, _ = Ledger().allocate(ref(1), "dax", GiB, [dev("a", 4 * GiB)])
    assert Ledger.from_json(led.to_json()) == led
    with pytest.raises(ValueError, match="upgrade the operator"):
        Ledger.from_json('{"format": 99, "claims": []}')


def test_rebuild_drops_orphans_restores_status_claims_and_refuses_overlaps():
    devices = [dev("a", 10 * GiB)]
    led, _ = Ledger().allocate(ref(1), "dax", GiB, devices)  # owner 1 is gone
    live = {"uid-2": ref(2), "uid-3": ref(3), "uid-4": ref(4)}
    recorded = [Claim(ref(2), "dax", Region("a", 2 * GiB, GiB)),
                Claim(ref(3), "dax", Region("a", 2 * GiB + ALIGN, GiB))]  # overlaps 2's
    rebuilt, problems = rebuild(led, live, recorded, listed_after=frozenset({"uid-1"}))
    assert [c.owner.uid for c in rebuilt.claims] == ["uid-2"]
    assert len(problems) == 1 and "c3" in problems[0]
    # A claim added after the listing (unknown to `listed_after`) is never dropped as an orphan.
    led2, _ = Ledger().allocate(ref(9), "dax", GiB, devices)
    kept, _ = rebuild(led2, live, [], listed_after=frozenset())
    assert kept.claim_of("uid-9") is not None


ops = st.lists(st.tuples(st.sampled_from(["alloc", "release"]), st.integers(0, 7),
                         st.integers(1, 6 * 1024)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_no_sequence_of_create_resize_delete_overlaps(sequence):
    devices = [dev("a", 8 * GiB), dev("b", 3 * GiB + 5), dev("c", GiB, nodes=("n1", "n2"))]
    led = Ledger()
    for op, who, mib in sequence:
        if op == "release":
            led = led.release(f"uid-{who}")
            assert led.claim_of(f"uid-{who}") is None
            continue
        try:
            led, claim = led.allocate(ref(who), "dax", mib << 20, devices)
        except (Impossible, NoSpace):
            continue
        assert claim.region.size >= mib << 20 and claim.region.offset % ALIGN == 0
    assert not led.overlapping_pairs()
    by_uuid = {d.uuid: d for d in devices}
    for claim in led.claims:
        assert claim.region.end <= by_uuid[claim.region.device_uuid].size
    assert len({c.owner.uid for c in led.claims}) == len(led.claims)
    assert Ledger.from_json(led.to_json()) == led


def test_a_moved_cache_leaves_its_old_region_draining_until_no_pod_maps_it():
    devices = [dev("a", 8 * GiB)]
    led, old = Ledger().allocate(ref(1), "dax", 2 * GiB, devices)
    led, _ = led.allocate(ref(2), "dax", 2 * GiB, devices)  # the neighbour: 1 cannot grow in place
    led, moved = led.allocate(ref(1), "dax", 4 * GiB, devices, placement="digest-1")
    assert moved.region == Region("a", 4 * GiB, 4 * GiB)
    assert led.draining == (Drain(ref(1), "dax", old.region, "digest-1"),)
    assert led.free_gaps(devices[0]) == []  # the old region is not free
    with pytest.raises(NoSpace, match=f"drain until no pod maps them: a/0/{2 * GiB}"):  # the only gap that
        led.allocate(CacheRef("other", "c3", "uid-3"), "dax", 2 * GiB, devices)  # fits: no cache gets it
    still, freed = led.settle(lambda drain: drain.region == old.region)  # a pod still maps it
    assert still is led and freed == ()
    led, freed = led.settle(lambda drain: False)  # its last pod is gone
    assert [d.region for d in freed] == [old.region] and led.draining == ()
    led, third = led.allocate(CacheRef("other", "c3", "uid-3"), "dax", 2 * GiB, devices)
    assert third.region == old.region


def test_a_cache_grows_in_place_over_its_own_old_region_but_others_wait_for_a_shrunk_tail():
    devices = [dev("a", 8 * GiB)]
    led, _ = Ledger().allocate(ref(1), "dax", 4 * GiB, devices)
    led, shrunk = led.allocate(ref(1), "dax", 2 * GiB, devices)
    assert shrunk.region == Region("a", 0, 2 * GiB) and led.draining_of("uid-1")[0].region == Region("a", 0, 4 * GiB)
    assert led.free_gaps(devices[0]) == [(4 * GiB, 8 * GiB)]  # the tail [2, 4) GiB drains too
    led, grown = led.allocate(ref(1), "dax", 3 * GiB, devices)  # in place, over its own draining region
    assert grown.region == Region("a", 0, 3 * GiB)
    assert all(d.owner == ref(1) for d in led.draining)


def test_a_deleted_cache_region_drains_and_survives_persistence_and_rebuild():
    devices = [dev("a", 4 * GiB)]
    led, claim = Ledger().allocate(ref(1), "dax", 4 * GiB, devices)
    led = led.retire("uid-1", placement="digest-1")
    assert led.claims == () and led.draining == (Drain(ref(1), "dax", claim.region, "digest-1"),)
    assert Ledger.from_json(led.to_json()) == led
    assert '"draining"' not in Ledger().to_json()  # nothing new in the stored form without a draining region
    rebuilt, problems = rebuild(led, {"uid-2": ref(2)}, [Claim(ref(2), "dax", Region("a", 0, GiB))],
                                listed_after=frozenset({"uid-1"}))
    assert rebuilt.draining == led.draining and rebuilt.claims == ()  # a status claim over it is refused
    assert len(problems) == 1 and "draining" in problems[0]


drain_ops = st.lists(st.tuples(st.sampled_from(["alloc", "delete", "settle"]), st.integers(0, 5),
                               st.integers(1, 4 * 1024)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(drain_ops)
def test_no_claim_ever_overlaps_a_region_another_cache_left_while_it_drains(sequence):
    devices = [dev("a", 8 * GiB), dev("b", 3 * GiB + 5)]
    led = Ledger()
    for op, who, mib in sequence:
        if op == "delete":
            led = led.retire(f"uid-{who}")
        elif op == "settle":  # the pods of caches with an even number are gone
            led, _ = led.settle(lambda drain: int(drain.owner.uid.split("-")[1]) % 2 == 1)
        else:
            try:
                led, _ = led.allocate(ref(who), "dax", mib << 20, devices)
            except (Impossible, NoSpace):
                continue
        for claim in led.claims:
            clash = [d for d in led.draining if d.owner.uid != claim.owner.uid and d.region.overlaps(claim.region)]
            assert not clash, (claim, clash)
    assert not led.overlapping_pairs()
    assert Ledger.from_json(led.to_json()) == led
