"""The region ledger: which byte ranges of which device belong to which cache (pure).

Invariants, for any sequence of `allocate` and `release`:
- two claims on one device never overlap;
- every claim lies inside its device and starts on a 2 MiB boundary (device
  DAX maps in 2 MiB pages);
- a cache (by UID) holds at most one claim, and allocating again with the
  same size returns that claim unchanged (idempotent);
- a region a cache leaves (moved, resized or deleted) is *draining* until
  no pod maps it any more (`settle`): no claim of another cache overlaps a
  draining region, so a pod left running on a cache's old region never
  shares memory with the pool of a cache placed after it. Draining is
  keyed on the region (device, offset, size), not on the cache's placement
  (which also changes when a node is lost while the region stays).

The ledger is a value: every change returns a new `Ledger`. Persistence
(`to_json`/`from_json`) and the cluster-side compare-and-swap live in
`k8s.py`; this module never does I/O.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .inventory import Device
from .models import CacheRef

ALIGN = 2 * 1024 * 1024
LEDGER_FORMAT = 1


class AllocationError(Exception):
    """No region can be given now. `permanent` means a spec change is needed."""

    permanent = False


class Impossible(AllocationError):
    permanent = True


class NoSpace(AllocationError):
    permanent = False


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True, order=True)
class Region:
    device_uuid: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def text(self) -> str:
        """The region as injected pods record it (`maru.io/region`): `DEVICE/OFFSET/SIZE`."""
        return f"{self.device_uuid}/{self.offset}/{self.size}"

    def overlaps(self, other: Region) -> bool:
        return self.device_uuid == other.device_uuid and self.offset < other.end and other.offset < self.end


@dataclasses.dataclass(frozen=True)
class Claim:
    owner: CacheRef
    device_class: str
    region: Region

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.owner.namespace, "name": self.owner.name, "uid": self.owner.uid,
                "deviceClass": self.device_class, "device": self.region.device_uuid,
                "offset": self.region.offset, "size": self.region.size}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Claim:
        return cls(owner=CacheRef(str(raw["namespace"]), str(raw["name"]), str(raw["uid"])),
                   device_class=str(raw["deviceClass"]),
                   region=Region(str(raw["device"]), int(raw["offset"]), int(raw["size"])))


@dataclasses.dataclass(frozen=True)
class Drain:
    """A region a cache left, kept from every other cache until no pod maps it.

    `owner` is the cache that held it; `placement` the placement digest
    (`maru.io/placement`) its pods were injected with, which tells the pods
    of an older webhook (no `maru.io/region`) that map it.
    """

    owner: CacheRef
    device_class: str
    region: Region
    placement: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**Claim(self.owner, self.device_class, self.region).to_dict(), "placement": self.placement}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Drain:
        claim = Claim.from_dict(raw)
        return cls(claim.owner, claim.device_class, claim.region, str(raw.get("placement") or ""))


@dataclasses.dataclass(frozen=True)
class Ledger:
    claims: tuple[Claim, ...] = ()
    draining: tuple[Drain, ...] = ()

    def claim_of(self, uid: str) -> Claim | None:
        return next((c for c in self.claims if c.owner.uid == uid), None)

    def release(self, uid: str) -> Ledger:
        """Drop the cache's claim; its region is free at once (see `retire` for a region pods may map)."""
        return dataclasses.replace(self, claims=tuple(c for c in self.claims if c.owner.uid != uid))

    def retire(self, uid: str, placement: str = "") -> Ledger:
        """Drop the cache's claim and keep its region draining (`settle` frees it);
        `placement`: the placement digest its pods were injected with."""
        claim = self.claim_of(uid)
        if claim is None:
            return self
        return self.release(uid)._draining(Drain(claim.owner, claim.device_class, claim.region, placement))

    def draining_of(self, uid: str) -> tuple[Drain, ...]:
        """The draining regions `uid` left."""
        return tuple(d for d in self.draining if d.owner.uid == uid)

    def settle(self, mapped: Callable[[Drain], bool]) -> tuple[Ledger, tuple[Drain, ...]]:
        """Free the draining regions no pod maps any more (`mapped(drain)` is False);
        the new ledger and the regions freed."""
        freed = tuple(d for d in self.draining if not mapped(d))
        if not freed:
            return self, ()
        return dataclasses.replace(self, draining=tuple(d for d in self.draining if d not in freed)), freed

    def _draining(self, drain: Drain) -> Ledger:
        if drain in self.draining:
            return self
        return dataclasses.replace(self, draining=tuple(sorted(self.draining + (drain,), key=lambda d: d.region)))

    def allocate(self, owner: CacheRef, device_class: str, size: int,
                 devices: Sequence[Device], placement: str = "") -> tuple[Ledger, Claim]:
        """Give `owner` a region of `size` bytes (rounded up to 2 MiB).

        An existing claim of the same size is returned as is. A new size
        grows or shrinks the claim in place when the neighbours allow it,
        otherwise moves it; the old region is left draining either way
        (`retire`, with `placement`, the digest the pods of the current
        claim were injected with). Only in place may a claim overlap a
        region its own cache left. Raises `Impossible` when no candidate
        device could ever hold the size and `NoSpace` when one could but is
        full now.
        """
        size = align_up(size)
        current = self.claim_of(owner.uid)
        if current is not None and current.region.size == size:
            return self, current
        others = self.retire(owner.uid, placement)
        usable = [d for d in devices if d.device_class == device_class]
        if not usable:
            raise Impossible(f"no node offers a {device_class} device")
        if all(_usable_size(d) < size for d in usable):
            biggest = max(_usable_size(d) for d in usable)
            raise Impossible(f"{size} bytes is larger than the largest {device_class} device ({biggest} bytes)")
        if current is not None:
            in_place = Region(current.region.device_uuid, current.region.offset, size)
            device = next((d for d in usable if d.uuid == in_place.device_uuid), None)
            if device is not None and others._fits(in_place, device, owner.uid):
                return others._with(Claim(owner, device_class, in_place))
        region = others._best_fit(size, usable)
        if region is None:
            on = {d.uuid for d in usable}
            drains = [d for d in others.draining if d.region.device_uuid in on]
            raise NoSpace(f"every {device_class} device that could hold {size} bytes is full" + (
                f" ({len(drains)} region(s) left by resized, moved or deleted caches drain until no pod "
                f"maps them: {', '.join(d.region.text for d in drains[:3])})" if drains else ""))
        return others._with(Claim(owner, device_class, region))

    def _with(self, claim: Claim) -> tuple[Ledger, Claim]:
        claims = tuple(sorted(self.claims + (claim,), key=lambda c: c.region))
        return dataclasses.replace(self, claims=claims), claim

    def _taken(self, except_drains_of: str | None = None) -> list[Region]:
        """Regions no new claim may overlap: every claim and every draining region
        (but those `except_drains_of` left, for its own claim in place)."""
        return [c.region for c in self.claims] + [
            d.region for d in self.draining if d.owner.uid != except_drains_of]

    def _fits(self, region: Region, device: Device, owner_uid: str | None = None) -> bool:
        return region.end <= _usable_size(device) and not any(
            region.overlaps(taken) for taken in self._taken(owner_uid))

    def _best_fit(self, size: int, devices: Iterable[Device]) -> Region | None:
        """The smallest free gap that holds `size`; ties go to the lowest (device, offset)."""
        best: tuple[int, Region] | None = None
        for device in sorted(devices, key=lambda d: d.uuid):
            for start, end in self.free_gaps(device):
                if end - start >= size:
                    candidate = (end - start - size, Region(device.uuid, start, size))
                    if best is None or candidate < best:
                        best = candidate
        return None if best is None else best[1]

    def free_gaps(self, device: Device) -> list[tuple[int, int]]:
        """Free [start, end) ranges of a device, aligned to 2 MiB (draining regions are not free)."""
        used = sorted(r for r in self._taken() if r.device_uuid == device.uuid)
        gaps, cursor, limit = [], 0, _usable_size(device)
        for region in used:
            if region.offset > cursor:
                gaps.append((cursor, min(region.offset, limit)))
            cursor = max(cursor, align_up(region.end))
        if cursor < limit:
            gaps.append((cursor, limit))
        return [(s, e) for s, e in gaps if e > s]

    def overlapping_pairs(self) -> list[tuple[Claim, Claim]]:
        pairs = []
        for i, a in enumerate(self.claims):
            pairs += [(a, b) for b in self.claims[i + 1:] if a.region.overlaps(b.region)]
        return pairs

    def to_json(self) -> str:
        """The stored form; `draining` only when there is one (an older operator ignores the key:
        it would free draining regions at once, as it always did)."""
        raw: dict[str, Any] = {"format": LEDGER_FORMAT, "claims": [c.to_dict() for c in self.claims]}
        if self.draining:
            raw["draining"] = [d.to_dict() for d in self.draining]
        return json.dumps(raw, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> Ledger:
        if not text:
            return cls()
        raw = json.loads(text)
        if raw.get("format") != LEDGER_FORMAT:
            raise ValueError(f"ledger format {raw.get('format')!r} is not {LEDGER_FORMAT}; "
                             "upgrade the operator before it manages this cluster")
        return cls(tuple(sorted((Claim.from_dict(c) for c in raw.get("claims", [])), key=lambda c: c.region)),
                   tuple(sorted((Drain.from_dict(d) for d in raw.get("draining", [])), key=lambda d: d.region)))


def _usable_size(device: Device) -> int:
    return device.size // ALIGN * ALIGN


def rebuild(ledger: Ledger, live: Mapping[str, CacheRef], recorded: Iterable[Claim],
            listed_after: frozenset[str] | None = None) -> tuple[Ledger, list[str]]:
    """Reconcile the stored ledger with the caches that exist (operator start).

    `live` maps UID -> cache for every MaruCache in the cluster; `recorded`
    are the claims the caches' own status says they hold. Claims of caches
    that no longer exist are dropped — but only those in `listed_after` (the
    UIDs the ledger held before `live` was listed, when given), so a claim
    another operator made after the listing is never mistaken for an orphan.
    A claim recorded only in a status is restored unless it would overlap
    another (reported as a problem; the cache gets a fresh region on its
    next reconcile).
    """
    problems: list[str] = []
    kept = Ledger(tuple(c for c in ledger.claims if c.owner.uid in live
                        or (listed_after is not None and c.owner.uid not in listed_after)),
                  ledger.draining)  # pods may still map them, whether or not their cache exists
    for claim in recorded:
        if claim.owner.uid not in live or kept.claim_of(claim.owner.uid) is not None:
            continue
        clash = next((c for c in kept.claims if c.region.overlaps(claim.region)), None)
        if clash is not None:
            problems.append(f"{claim.owner.key} records region {claim.region} that overlaps "
                            f"{clash.owner.key}; it will be reallocated")
            continue
        drain = next((d for d in kept.draining if d.owner.uid != claim.owner.uid
                      and d.region.overlaps(claim.region)), None)
        if drain is not None:
            problems.append(f"{claim.owner.key} records region {claim.region} that overlaps the region "
                            f"{drain.owner.key} left, still draining; it will be reallocated")
            continue
        kept = kept._with(claim)[0]
    return kept, problems
