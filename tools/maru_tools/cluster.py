"""Engines with the connector, on one index and pool: what tests, demo and bench share.

`EngineFarm` starts engines on demand (one per name), keeps at most
`max_alive` of them running (closing the least recently used), and hands out
`CacheEngine`s: an `EngineProcess` plus the stats directory where its
connector's processes write their counters.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

from .engine import EngineProcess, EngineSpec, RequestResult
from .stats_reader import read_connector_stats


@dataclass
class CacheEngine:
    """A running engine; `stats_dir` is None when it has no connector."""

    name: str
    process: EngineProcess
    stats_dir: str | None

    def run(self, prompts: list[list[int]], max_tokens: int = 8, **kwargs: Any) -> list[RequestResult]:
        return self.process.generate(prompts, max_tokens=max_tokens, **kwargs)

    def outputs(self, prompts: list[list[int]], max_tokens: int = 8, **kwargs: Any) -> list[list[int]]:
        return [r.token_ids for r in self.run(prompts, max_tokens, **kwargs)]

    def counters(self) -> dict[str, Any]:
        """The connector's counters, summed over the engine's processes (exported names)."""
        if self.stats_dir is None:
            raise ValueError(f"engine {self.name} runs without the connector")
        return read_connector_stats(self.stats_dir)


class EngineFarm:
    """Starts and caches engines; `close()` ends all of them."""

    def __init__(self, workdir: str, base_spec: EngineSpec, max_alive: int = 4):
        self.workdir = workdir
        self.base_spec = base_spec
        self.max_alive = max_alive
        self._engines: OrderedDict[str, CacheEngine] = OrderedDict()
        self._serial = itertools.count()

    def get(
        self,
        name: str,
        kv_transfer_config: Callable[[str], dict[str, Any]] | None = None,
        **spec_overrides: Any,
    ) -> CacheEngine:
        """The engine called `name`, started on first use.

        `kv_transfer_config(stats_dir)` builds the connector's config (None:
        no connector) for an empty directory that is the engine's own: its
        `maru_stats_dir` in direct attach, or the directory of the socket of
        a sidecar started for this engine. `spec_overrides` replace fields
        of the base spec.
        """
        if spec_overrides:
            # Another spec is another engine, even under the same name.
            name = name + "[" + ",".join(f"{k}={v}" for k, v in sorted(spec_overrides.items())) + "]"
        engine = self._engines.get(name)
        if engine is not None and engine.process.alive():
            self._engines.move_to_end(name)
            return engine
        if engine is not None:
            self.close_one(name)
        while len(self._engines) >= self.max_alive:
            self.close_one(next(iter(self._engines)))
        serial = next(self._serial)
        stats_dir = None
        config = None
        if kv_transfer_config is not None:
            stats_dir = os.path.join(self.workdir, f"stats-{serial}")
            os.makedirs(stats_dir)
            config = kv_transfer_config(stats_dir)
        spec = replace(self.base_spec, kv_transfer_config=config, **spec_overrides)
        log = os.path.join(self.workdir, f"engine-{serial}-{_file_safe(name)}.log")
        engine = CacheEngine(name, EngineProcess(spec, log), stats_dir)
        self._engines[name] = engine
        return engine

    def close_one(self, name: str) -> None:
        engine = self._engines.pop(name, None)
        if engine is not None:
            engine.process.close()

    def close(self) -> None:
        for name in list(self._engines):
            self.close_one(name)


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:80]


def wait_until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy; raise TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        time.sleep(interval_s)
