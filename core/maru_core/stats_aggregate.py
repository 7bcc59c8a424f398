"""Summing the connectors' stats regions, and folding those of finished processes into a retained total.

Every vLLM process writes its counters into its own region file in the stats
directory (`maru_core.stats`). At each scrape the sidecar sums the files of
live processes; tools that read the counters without a sidecar (the
end-to-end harness, `marucache demo`) sum them the same way. A file whose writer has gone is folded: its counters (not its
gauges: a dead process parks nothing) are added to a retained total kept in
the same directory, then the file is removed. The directory outlives the
sidecar, so counters stay monotonic across sidecar and vLLM restarts.

Folding is crash-safe: the new total, with the names of the files it
includes, is written to a temporary file and renamed over the old one before
those files are removed; a file named in the total is never counted again.

A sidecar folds only regions it saw with a live writer (``attested``): any
process that can write into the shared directory could otherwise drop in a
region with no writer and have made-up counters folded into the total for
good. The names seen live are kept in the retained record, so a sidecar that
restarts still folds the regions of processes that ended while it was away. A
region whose writer ended before any scan saw it live is removed uncounted
(warned once): its process lived less than one scan interval. Tools that
read the counters after their engines ended (the end-to-end harness,
``marucache demo``) fold every finished region.
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import msgpack

from maru_core.stats import (
    GAUGE_SLOTS,
    LAYOUT_DIGEST,
    SLOT_NAMES,
    StatsRegionError,
    StatsRegionInvalid,
    read_region,
    region_files,
    zero_values,
)

log = logging.getLogger(__name__)

RETAINED_NAME = "maru-stats.retained"
LOCK_NAME = "maru-stats.lock"


@dataclass(frozen=True)
class Aggregate:
    """The sum over all regions at one scrape."""

    values: list[int | float]  # slot vector, see maru_core.stats.SLOT_NAMES
    live: int  # files of running processes
    foreign: int  # files of another counter layout (another MaruCache version), skipped
    folded: int  # files folded into the retained total during this scrape
    invalid: int = 0  # files that are no usable region (not a regular file, a value out of range), skipped
    # files of finished writers never seen live, removed uncounted by this aggregator so far (attested scans)
    unattested_removed: int = 0


class RegionAggregator:
    """Reads and folds the region files of one stats directory.

    Several readers of one directory (a sidecar and a test reading the same
    counters) are safe: each scan holds the directory's lock.
    """

    def __init__(self, directory: Path, *, attested: bool = False):
        self.directory = directory
        # Fold only the regions seen with a live writer (the sidecar), see the module's docstring.
        self.attested = attested
        self._warned_foreign: set[str] = set()
        self._unattested_removed = 0

    def scan(self) -> Aggregate:
        """Sum every region; fold the finished ones. Safe to call from several threads."""
        with self._directory_lock():
            retained, folded_names, seen = self._load_retained()
            live_sum = zero_values()
            dead: list[tuple[Path, list[int | float]]] = []
            live = foreign = invalid = 0
            newly_seen = False
            for path in region_files(self.directory):
                if path.name in folded_names:  # folded before a crash, not removed yet
                    path.unlink(missing_ok=True)
                    continue
                try:
                    reading = read_region(path)
                except StatsRegionInvalid as exc:
                    invalid += 1
                    self._warn_foreign(path, exc)
                    continue
                except StatsRegionError as exc:
                    foreign += 1
                    self._warn_foreign(path, exc)
                    continue
                except OSError:  # removed while we listed
                    continue
                if reading.alive:
                    live += 1
                    _add_into(live_sum, reading.values)
                    if path.name not in seen:
                        seen.add(path.name)
                        newly_seen = True
                elif self.attested and path.name not in seen:
                    self._unattested_removed += 1
                    log.warning("removing stats region %s uncounted: no scan saw its writer alive "
                                "(a process that lived less than a scan interval, or a file put there)", path)
                    path.unlink(missing_ok=True)
                else:
                    dead.append((path, reading.values))
            if dead or (self.attested and newly_seen):
                retained = self._save(retained, dead, seen)
            _add_into(live_sum, retained)
            return Aggregate(values=live_sum, live=live, foreign=foreign, folded=len(dead), invalid=invalid,
                             unattested_removed=self._unattested_removed)

    def _save(self, retained: list[int | float], dead: list[tuple[Path, list[int | float]]],
              seen: set[str]) -> list[int | float]:
        """Fold ``dead`` into the retained total and write it with the names seen live, then remove ``dead``."""
        total = list(retained)
        for _, values in dead:
            _add_into(total, [0 if i in GAUGE_SLOTS else v for i, v in enumerate(values)])
        names = [path.name for path, _ in dead]
        seen.difference_update(names)
        record = {"layout": LAYOUT_DIGEST, "slots": list(SLOT_NAMES), "values": total, "folded": names,
                  "seen": sorted(seen)}
        tmp = self.directory / f".{RETAINED_NAME}.tmp"
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(record, use_bin_type=True))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.directory / RETAINED_NAME)
        for path, _ in dead:
            path.unlink(missing_ok=True)
        if dead:
            log.debug("folded %d finished stats regions into the retained total", len(dead))
        return total

    def _load_retained(self) -> tuple[list[int | float], set[str], set[str]]:
        """The retained total, the names of the files it includes, and the names of regions seen live."""
        path = self.directory / RETAINED_NAME
        try:
            record = msgpack.unpackb(path.read_bytes(), raw=False)
        except FileNotFoundError:
            return zero_values(), set(), set()
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.warning("ignoring unreadable retained stats %s (%s); counters restart from zero", path, exc)
            return zero_values(), set(), set()
        if not isinstance(record, dict) or record.get("layout") != LAYOUT_DIGEST:
            log.warning("ignoring retained stats %s of another counter layout; counters restart from zero", path)
            return zero_values(), set(), set()
        values, folded, seen = record.get("values"), record.get("folded", ()), record.get("seen", ())
        if (not isinstance(values, list) or len(values) != len(SLOT_NAMES)
                or not all(isinstance(v, (int, float)) and 0 <= v < 2**63 for v in values)
                or not isinstance(folded, list) or not isinstance(seen, list)):  # fmt: skip
            log.warning("ignoring retained stats %s holding values out of range; counters restart from zero", path)
            return zero_values(), set(), set()
        return (list(values), {name for name in folded if isinstance(name, str)},
                {name for name in seen if isinstance(name, str)})

    def _warn_foreign(self, path: Path, exc: Exception) -> None:
        if path.name not in self._warned_foreign:
            self._warned_foreign.add(path.name)
            log.warning("skipping stats region %s: %s", path, exc)

    def _directory_lock(self) -> _FileLock:
        return _FileLock(self.directory / LOCK_NAME)


class _FileLock:
    """An exclusive flock on a lock file, held across one scan (also against a second sidecar by mistake)."""

    def __init__(self, path: Path):
        self._path = path
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def _add_into(total: list[int | float], values: list[int | float]) -> None:
    for i, v in enumerate(values):
        total[i] += v
