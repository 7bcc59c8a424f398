"""The pure parts of the several-GPU harness (``bench/multi_gpu.py``): which
process runs on which GPU, which prefix each engine writes and loads, how
much pool the run needs, the floors a hit is measured against, and the
summary of the figures every process reports. No torch, no processes: CI
tests these on any machine.

Two experiments:

- ``tp``: one engine of ``processes`` tensor-parallel ranks. Rank ``r``
  computes and stores its own shard of the prefix's KV (keys carry the TP
  rank), then loads it back into other blocks and computes the first token,
  with an all-reduce after each attention and MLP as a TP model does.
- ``engines``: ``processes`` independent engines (TP 1) on one pool. Engine
  ``i`` writes prefix ``i``; then every engine loads a hit at the same
  moment, all from prefix 0 (``same``) or engine ``j`` from prefix
  ``(j + 1) % n`` (``different``: n prefixes at once, none its own).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median

GB = 1e9
EXPERIMENTS = ("tp", "engines")
PREFIX_CASES = ("same", "different")
COLLECTIVES = ("auto", "nccl", "gloo")
MODES = ("sync", "overlap")
#: A hit's TTFT is good when within this factor of its floor.
FLOOR_FACTOR = 1.15
#: Pool room per object besides its payload (slot headers, page rounding)
#: and for the index's own regions.
POOL_SLACK, POOL_FIXED = 1.1, 256 << 20


class PlanError(ValueError):
    """Arguments that cannot make a run; the message says what to change."""


@dataclass(frozen=True)
class ProcessPlan:
    rank: int
    device: int  # CUDA device index (ignored on the CPU)
    tp_rank: int  # 0 in the engines experiment
    tp_size: int
    writes: tuple[int, ...]  # prefixes this process computes and stores
    loads: dict  # prefix case ("tp", "same", "different") -> prefix it loads


@dataclass(frozen=True)
class Plan:
    experiment: str
    processes: int
    gpus: int
    collective: str  # resolved: "nccl" or "gloo" (tp), "none" (engines)
    num_prefixes: int
    procs: tuple[ProcessPlan, ...]

    @property
    def shares_devices(self) -> bool:
        return self.processes > self.gpus

    def as_dict(self) -> dict:
        return asdict(self)


def device_of(rank: int, processes: int, gpus: int) -> int:
    """Ranks spread round-robin over the GPUs: distinct GPUs first, then
    ``processes // gpus`` on each (as a TP group fills a host)."""
    return rank % gpus


def check_shape(experiment: str, processes: int, gpus: int, heads: int, kv_heads: int,
                ffn: int, available_gpus: int | None = None) -> None:
    """Raise :class:`PlanError` for a run the harness cannot make."""
    if experiment not in EXPERIMENTS:
        raise PlanError(f"experiment must be one of {EXPERIMENTS}, not {experiment!r}")
    if processes < 1:
        raise PlanError(f"--processes must be at least 1, got {processes}")
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    if gpus > processes:
        raise PlanError(f"--gpus {gpus} exceeds --processes {processes}: each process uses "
                        "one GPU; use as many processes as GPUs or more")
    if processes % gpus:
        raise PlanError(f"--processes {processes} is not a multiple of --gpus {gpus}: every "
                        "GPU must carry the same number of processes")
    if available_gpus is not None and gpus > available_gpus:
        raise PlanError(f"--gpus {gpus} but this machine has {available_gpus} CUDA device(s)")
    if experiment == "tp":
        for name, value in (("query heads", heads), ("KV heads", kv_heads), ("MLP width", ffn)):
            if value % processes:
                raise PlanError(f"TP={processes} does not divide the model's {name} ({value}); "
                                "choose a TP size that does (2, 4 or 8 for Llama-3-8B)")


def resolve_collective(collective: str, processes: int, gpus: int, device: str) -> str:
    """``auto``: NCCL where every rank has a GPU of its own, gloo where ranks
    share one (NCCL refuses two ranks on one device) or on the CPU."""
    if collective not in COLLECTIVES:
        raise PlanError(f"--collective must be one of {COLLECTIVES}, not {collective!r}")
    if device == "cpu":
        if collective == "nccl":
            raise PlanError("--collective nccl needs CUDA; use gloo (or auto) with --cpu")
        return "gloo"
    if collective == "auto":
        return "gloo" if processes > gpus else "nccl"
    return collective


def build_plan(experiment: str, processes: int, gpus: int, collective: str = "auto",
               device: str = "cuda") -> Plan:
    """Which process runs where and which prefixes it writes and loads."""
    # engines are TP 1 each: no collective
    resolved = (resolve_collective(collective, processes, gpus, device)
                if experiment == "tp" else "none")
    procs = []
    for rank in range(processes):
        dev = device_of(rank, processes, gpus)
        if experiment == "tp":
            procs.append(ProcessPlan(rank, dev, rank, processes, (0,), {"tp": 0}))
        else:
            procs.append(ProcessPlan(rank, dev, 0, 1, (rank,),
                                     {"same": 0, "different": (rank + 1) % processes}))
    return Plan(experiment, processes, gpus, resolved,
                1 if experiment == "tp" else processes, tuple(procs))


def pool_bytes_needed(plan: Plan, tokens: int, kv_bytes_per_token: int) -> int:
    """Pool size for every prefix the plan stores (``kv_bytes_per_token``:
    all layers, whole model; a TP rank stores its share of it)."""
    payload = plan.num_prefixes * tokens * kv_bytes_per_token
    return (int(payload * POOL_SLACK) + POOL_FIXED) // (2 << 20) * (2 << 20) + (2 << 20)


def check_room(need: int, free: int, where: str = "/dev/shm") -> None:
    """Refuse a pool that ``where`` cannot hold before any prefix is made."""
    if need > free:
        raise PlanError(f"the pool needs {need / 2**30:.1f} GiB but {where} has "
                        f"{free / 2**30:.1f} GiB free; use fewer --tokens or processes, or "
                        f"free {where}")


def floor_s(bytes_by_device: dict[int, int], peak_gbps_by_device: dict[int, float]) -> float | None:
    """The time the slowest GPU needs to take in its bytes at its pinned
    peak: ranks that share a GPU share its link, so their bytes add up."""
    if not bytes_by_device or any(peak_gbps_by_device.get(d) is None for d in bytes_by_device):
        return None
    return max(n / (peak_gbps_by_device[d] * GB) for d, n in bytes_by_device.items())


def _per_device(values: dict[int, float | None], devices: dict[int, int]) -> dict[int, float]:
    """Per device, the lowest value its processes measured (alone)."""
    out: dict[int, float] = {}
    for rank, value in values.items():
        if value is not None:
            dev = devices[rank]
            out[dev] = min(out.get(dev, value), value)
    return out


def summarize_runs(plan: Plan, results: list[dict], case: str, mode: str) -> dict:
    """Figures of one case and mode from every process's report.

    Each report has ``rank``, ``pinned_peak_gbps`` (None on the CPU) and
    ``runs[case][mode]``: ``times``, a list of ``{"start", "loaded",
    "first_token"}`` per timed hit (``time.monotonic`` of one host, the same
    clock in every process, hits started together), ``bytes`` and
    ``verified``.
    """
    devices = {p.rank: p.device for p in plan.procs}
    rows = {r["rank"]: r["runs"][case][mode] for r in results}
    repeats = min(len(row["times"]) for row in rows.values())
    ttft, load_span = [], []
    for i in range(repeats):
        start = min(row["times"][i]["start"] for row in rows.values())
        ttft.append(max(row["times"][i]["first_token"] for row in rows.values()) - start)
        load_span.append(max(row["times"][i]["loaded"] for row in rows.values()) - start)
    per_rank = {rank: median(t["first_token"] - t["start"] for t in row["times"][:repeats])
                for rank, row in rows.items()}
    bytes_by_rank = {rank: row["bytes"] for rank, row in rows.items()}
    bytes_by_device: dict[int, int] = {}
    for rank, n in bytes_by_rank.items():
        bytes_by_device[devices[rank]] = bytes_by_device.get(devices[rank], 0) + n
    peaks = _per_device({r["rank"]: r.get("pinned_peak_gbps") for r in results}, devices)
    floor = floor_s(bytes_by_device, peaks)
    total = sum(bytes_by_rank.values())
    out = {
        "case": case, "mode": mode, "repeats": repeats,
        "ttft_s": ttft, "median_ttft_s": median(ttft) if ttft else None,
        "per_rank_median_s": per_rank, "bytes_by_rank": bytes_by_rank,
        "aggregate_gbps": (total / median(load_span) / GB) if load_span else None,
        "verified": all(row["verified"] for row in rows.values()),
        "pinned_peak_gbps_by_device": peaks, "floor_s": floor,
    }
    if floor is not None and out["median_ttft_s"] is not None:
        out["ttft_over_floor"] = out["median_ttft_s"] / floor
        out["within_target"] = out["ttft_over_floor"] <= FLOOR_FACTOR
    if plan.experiment == "engines" and peaks:
        one_peak = median(peaks.values())
        one_floor = max(bytes_by_rank.values()) / (one_peak * GB)
        n = plan.processes
        out["n_times_peak_gbps"] = n * one_peak
        out["one_hit_floor_s"] = one_floor
        out["n_times_one_hit_floor_s"] = n * one_floor
        if out["aggregate_gbps"] is not None:
            out["aggregate_over_n_peak"] = out["aggregate_gbps"] / (n * one_peak)
        if out["median_ttft_s"] is not None:
            out["last_token_over_n_floors"] = out["median_ttft_s"] / (n * one_floor)
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def table(summaries: list[dict], plan: Plan) -> str:
    """A Markdown table of the summaries of one run."""
    head = ["case", "mode", "TTFT (last first token)", "floor", "TTFT / floor",
            f"<= {FLOOR_FACTOR} x floor", "GB/s from the pool", "n x one peak",
            "TTFT / (n x one hit's floor)", "bits equal"]
    lines = [f"{plan.experiment}: {plan.processes} processes on {plan.gpus} GPU(s), "
             f"collective {plan.collective}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        def num(key, fmt="{:.2f}"):
            return "-" if s.get(key) is None else fmt.format(s[key])
        lines.append("| " + " | ".join([
            s["case"], s["mode"], ms(s.get("median_ttft_s")), ms(s.get("floor_s")),
            num("ttft_over_floor"), str(s.get("within_target", "-")),
            num("aggregate_gbps", "{:.1f}"), num("n_times_peak_gbps", "{:.1f}"),
            num("last_token_over_n_floors"), str(s["verified"])]) + " |")
    return "\n".join(lines)
