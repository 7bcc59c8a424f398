"""What `marucache demo` prints and plots."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DemoReport:
    requests: list[Any]  # SharedPrefixRequest, in serving order
    reference: list[Any]  # RequestResult of the engine without the connector
    stored: dict[int, Any]  # request index -> RequestResult of engine A (misses that store)
    hits: list[Any]  # RequestResult of engine B, one per request
    hit_tokens: int
    prompt_tokens: int
    bytes_loaded: int
    bytes_stored: int
    load_failures: int
    kv_identical: int  # B's requests whose loaded prefix KV equals A's computed KV, byte for byte
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def matched(self) -> int:
        pairs = list(zip(self.hits, self.reference))
        pairs += [(r, self.reference[i]) for i, r in self.stored.items()]
        return sum(a.token_ids == b.token_ids for a, b in pairs)

    @property
    def compared(self) -> int:
        return len(self.hits) + len(self.stored)

    @property
    def proved(self) -> bool:
        """Every hit loaded exactly the KV that was computed, and it was a real hit."""
        return self.hit_tokens > 0 and self.kv_identical == len(self.hits) and self.load_failures == 0


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f} ms" if values else "-"


def print_report(report: DemoReport) -> None:
    from rich.console import Console
    from rich.table import Table

    reference = [r.ttft_s for r in report.reference]
    hits = [r.ttft_s for r in report.hits]
    stored = [r.ttft_s for r in report.stored.values()]
    table = Table(title="MaruCache demo: two vLLM engines, one shared KV cache")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("requests (documents × questions)", f"{len(report.requests)}")
    table.add_row("TTFT without the cache (median)", _ms(reference))
    table.add_row("TTFT engine A, miss + store (median)", _ms(stored))
    table.add_row("TTFT engine B, hit from the pool (median)", _ms(hits))
    if hits and reference:
        table.add_row("speed-up of the first token", f"{statistics.median(reference) / statistics.median(hits):.1f}×")
    table.add_row("hit rate (hit tokens / prompt tokens, engine B)",
                  f"{report.hit_tokens / max(1, report.prompt_tokens):.0%} ({report.hit_tokens} tokens)")
    table.add_row("bytes loaded from the pool (B)", _bytes(report.bytes_loaded))
    table.add_row("bytes stored into the pool (A)", _bytes(report.bytes_stored))
    table.add_row("load failures (recomputed)", str(report.load_failures))
    table.add_row("B's loaded KV byte-identical to A's computed KV",
                  f"{report.kv_identical}/{len(report.hits)}"
                  + ("" if report.kv_identical == len(report.hits) else "  MISMATCH"))
    table.add_row("outputs equal to recompute (float32 greedy tokens)", f"{report.matched}/{report.compared}")
    for key, value in report.config.items():
        table.add_row(f"  {key}", str(value))
    console = Console()
    console.print(table)
    if report.proved:
        console.print(
            f"Proved: engine B served all {len(report.hits)} requests from the pool, and for every one "
            "the KV it held for the shared prefix was byte for byte the KV engine A computed."
            + ("" if report.matched == report.compared else
               " Some greedy tokens differ from recompute: with identical KV that is a tie between "
               "two tokens of equal score, not a cache error.")
        )
    else:
        console.print("NOT proved: a hit did not load exactly the KV that was computed (see above).")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def write_plot(report: DemoReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    xs = list(range(len(report.requests)))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(xs, [r.ttft_s * 1e3 for r in report.reference], "o-", label="without the cache (recompute)")
    ax.plot(xs, [r.ttft_s * 1e3 for r in report.hits], "s-", label="engine B, KV from the pool")
    ax.plot(list(report.stored), [r.ttft_s * 1e3 for r in report.stored.values()], "^", label="engine A, miss + store")
    labels = [f"d{r.document}q{r.question}" for r in report.requests]
    ax.set_xticks(xs, labels, rotation=60, fontsize=7)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Per-request TTFT, two vLLM CPU engines sharing one MaruCache pool")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
