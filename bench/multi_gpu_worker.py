"""One process of the several-GPU harness (started by ``bench/multi_gpu.py``,
never by hand): one TP rank, or one engine, on its GPU.

    python3 bench/multi_gpu_worker.py CONFIG.json

It computes the prefixes its plan says it writes (the Llama-8B-sized
stand-in of ``tests/connector/llama_layer.py``, its shard of the heads and
MLP under TP, an all-reduce after each attention and MLP), stores them
through the connector's ``Storer`` into the real index's pool, measures its
GPU's pinned host-to-device peak alone, then, at the same moment as every
other process (a barrier), loads its hit through ``resolve_load`` and the
real transfer engine (the payload checked against the writer's checksums,
as the connector loads by default; ``--verify-payload off``: not) and
computes the first token. After every hit the
loaded blocks are checked against the writer's: bit for bit when this
process wrote them (TP), by a per-layer fingerprint that any one changed
element changes when another process did (engines).

Writes ``rank<R>.json`` into the run's directory: its times (one host's
``time.monotonic``, shared by every process), bytes, verdicts, or the
error that stopped it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "connector")]

import vllm_shim  # noqa: E402  (vLLM's base classes, where vLLM is not installed)

vllm_shim.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from llama_layer import LLAMA3_8B, TINY, Batch, LlamaStack, layer_name, paged_kv_caches, token_rows  # noqa: E402
from maru_core.index.client import IndexClient  # noqa: E402
from maru_core.keys import KeyNamespace, chunk_keys  # noqa: E402
from maru_core.pool import Pool  # noqa: E402
from maru_core.stats import ConnectorStats  # noqa: E402

from maru_connector.metadata import StoreSpec  # noqa: E402
from maru_connector.resolve import packed_object_keys, release_pins, resolve_load  # noqa: E402
from maru_connector.store import Storer  # noqa: E402
from maru_connector.transfer import TransferEngine, create_engine  # noqa: E402
from ttft_gpu import pinned_peak_gbps  # noqa: E402

WAIT_S = 120.0  # longest wait for one load's copies


def progress(rank: int, line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} rank {rank}] {line}", flush=True)


def geometry(cfg: dict, tp_size: int):
    """The whole model's geometry, and this rank's shard of it."""
    geo = TINY if cfg["cpu"] else LLAMA3_8B
    if cfg.get("layers"):
        geo = geo.scaled(layers=cfg["layers"])
    return geo, geo.scaled(heads=geo.heads // tp_size, kv_heads=geo.kv_heads // tp_size,
                           ffn=geo.ffn // tp_size)


def shard_weights(model: LlamaStack, tp_rank: int) -> None:
    """Give this rank's projections their own values (a rank holds other
    heads and MLP columns than its peers: identical shards would hide a
    load of another rank's KV); embeddings and norms stay replicated."""
    gen = torch.Generator(device=model.device).manual_seed(1000 + tp_rank)
    for layer in model.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            w = layer[name]
            fan_in = w.shape[1] if model.out_in else w.shape[0]
            w.normal_(0, fan_in ** -0.5, generator=gen)


def make_reduce(group, backend: str):
    """The TP all-reduce of a partial sum, in place. Gloo reduces on the host
    in float32 (where ranks share a GPU, which NCCL refuses)."""
    if group is None:
        return lambda x: x
    if backend == "nccl":
        def reduce(x):
            dist.all_reduce(x, group=group)
            return x
    else:
        def reduce(x):
            y = x.float().cpu()
            dist.all_reduce(y, group=group)
            x.copy_(y)
            return x
    return reduce


def forward(model: LlamaStack, rows: list, batch: Batch, reduce, wait=None) -> torch.Tensor:
    """The stand-in's eager forward as a TP rank runs it: its heads' attention
    over its KV shard, an all-reduce of the output projection's and of the
    MLP's partial sums. ``wait(i)`` before layer ``i``'s attention (a load's
    layer landing)."""
    m, g = model, model.geo
    h = m.embed[batch.tokens]
    attn = torch.empty(len(batch.tokens), g.heads * g.head, dtype=h.dtype, device=h.device)
    for i in range(g.layers):
        q, kv = m.pre_attention(i, h, batch.positions)
        if wait is not None:
            wait(i)
        m.attend(rows[i], q, kv, batch, attn)
        p = m.layers[i]
        h = h + reduce(m._linear(attn, p["wo"]))
        gate, up = m._linear(m._rms(h, p["ln2"]), p["w13"]).chunk(2, dim=-1)
        h = h + reduce(m._linear(F.silu(gate) * up, p["w2"]))
    return m.logits(h, batch.last_index)


def prompt(prefix: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(7919 * (prefix + 1))
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def position_weights(n: int, layer: int, device) -> torch.Tensor:
    """``n`` odd pseudo-random int64 weights, from integer arithmetic alone
    (a device's random generator may draw other values on another GPU
    model; wrap-around multiplication gives the same bits everywhere)."""
    w = torch.arange(n, dtype=torch.int64, device=device) * 0x5851F42D4C957F2D
    w += 0x14057B7EF767814F + layer
    w ^= w >> 29
    w *= 0x2545F4914F6CDD1D
    return w | 1


def fingerprint(layers: list[torch.Tensor], block_ids: list[int]) -> list[int]:
    """Per layer, the sum of every 16-bit element of these blocks (token
    order) times an odd weight of its position, modulo 2**64: the same bytes
    give the same value in any process, and a change of any one element
    always changes it (an odd weight times a nonzero difference below 2**16
    is never 0 modulo 2**64)."""
    ids = torch.tensor(block_ids, device=layers[0].device)
    out = []
    for i, t in enumerate(layers):
        x = t.index_select(0, ids).reshape(-1).view(torch.int16).to(torch.int64)
        x *= position_weights(x.numel(), i, x.device)
        out.append(int(x.sum()))
        del x
    return out


class Rank:
    """This process's model, KV cache, pool, index client and transfer engine."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.proc = cfg["plan"]["procs"][cfg["rank"]]
        self.rank, self.world = cfg["rank"], cfg["plan"]["processes"]
        self.cuda = not cfg["cpu"]
        self.device = torch.device(f"cuda:{self.proc['device']}" if self.cuda else "cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.tp_rank, self.tp_size = self.proc["tp_rank"], self.proc["tp_size"]
        self.geo, self.local = geometry(cfg, self.tp_size)
        self.bs, self.chunk, self.tokens = cfg["block_size"], cfg["chunk_tokens"], cfg["tokens"]
        self.prefix_blocks = self.tokens // self.bs
        self.hit_blocks = -(-(self.tokens + cfg["new_tokens"]) // self.bs)
        self.closers: list = []

    # ---- set-up ------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        timeout = timedelta(seconds=cfg["timeout_s"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                                rank=self.rank, world_size=self.world, timeout=timeout)
        # no destroy_process_group: a process group whose NCCL communicator
        # failed can hang in it; the process exits right after (os._exit)
        self.collective = self._collective(timeout)
        torch.manual_seed(0)
        self.model = LlamaStack(self.local, self.device, seed=0)
        if self.tp_size > 1:
            shard_weights(self.model, self.tp_rank)
        writes = len(self.proc["writes"])
        self.num_blocks = writes * self.prefix_blocks + self.hit_blocks + 4
        self.kv = paged_kv_caches(self.local, self.num_blocks, self.bs, self.device,
                                  seed=self.rank + 1)
        self.layers = [self.kv[layer_name(i)] for i in range(self.local.layers)]
        self.rows = [token_rows(t) for t in self.layers]
        self.pool = Pool.attach(cfg["pool_path"])
        self.closers.append(self.pool.close)
        if self.cuda:
            from maru_connector.transfer.cudart import register_host, unregister_host

            view = torch.frombuffer(self.pool.buffer, dtype=torch.uint8)
            ptr, size = view.data_ptr(), view.numel()
            del view
            if register_host(ptr, size):
                self.closers.append(lambda: (torch.cuda.synchronize(), unregister_host(ptr)))
        fmt = TransferEngine.detect(self.kv, self.chunk, cfg["format"] == "layerwise", self.bs)
        self.engine = create_engine(self.pool.buffer, self.kv, fmt)
        self.closers.append(self.engine.close)
        self.client = IndexClient(cfg["index_url"], token=cfg["index_token"],
                                  client_name="marucache-bench", timeout_s=30)
        self.closers.append(self.client.close)
        # the hit's blocks: spread over the reader's region, in a shuffled order
        first = self.read_first = writes * self.prefix_blocks
        self.read_ids = list(range(first, first + self.hit_blocks))
        random.Random(self.rank).shuffle(self.read_ids)

    def _collective(self, timeout):
        """The TP group and backend: (group, backend, note)."""
        if self.tp_size == 1:
            return None, None, "none (TP 1)"
        if self.cfg["plan"]["collective"] != "nccl":
            shared = self.cfg["plan"]["processes"] > self.cfg["plan"]["gpus"]
            return dist.group.WORLD, "gloo", ("gloo (ranks share a GPU)" if shared else "gloo")
        group = None
        probe = torch.ones(1, device=self.device)
        try:  # a refusal shows at the first collective, or, where NCCL hangs, at the timeout
            group = dist.new_group(backend="nccl", timeout=min(timeout, timedelta(seconds=60)))
            dist.all_reduce(probe, group=group)
            torch.cuda.synchronize()
            ok = probe.item() == self.world
            why = "" if ok else f"all-reduce of ones gave {probe.item()}"
        except Exception as exc:  # e.g. two ranks on one device
            ok, why = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        verdicts = [None] * self.world
        dist.all_gather_object(verdicts, (ok, why))
        if all(v[0] for v in verdicts):
            return group, "nccl", "nccl"
        reason = next(v[1] for v in verdicts if not v[0])
        progress(self.rank, f"NCCL refused this placement ({reason}); the all-reduce runs on gloo")
        return dist.group.WORLD, "gloo", f"gloo: NCCL refused ({reason})"

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception as exc:  # the others still close
                progress(self.rank, f"closing: {type(exc).__name__}: {exc}")

    # ---- pieces -------------------------------------------------------------
    def namespace(self) -> KeyNamespace:
        c = self.cfg
        return KeyNamespace(model="llama-stand-in-multi-gpu", dtype="bfloat16", kv_dtype="auto",
                            layout=f"{self.device.type}/packed", block_size=self.bs,
                            chunk_tokens=self.chunk, fmt=c["format"], tp_rank=self.tp_rank,
                            tp_size=self.tp_size)

    def hit_tokens(self, prefix: int) -> list[int]:
        return prompt(prefix, self.tokens + self.cfg["new_tokens"], self.geo.vocab)

    def chunk_blocks(self, ids: list[int]) -> list[tuple[int, ...]]:
        per = self.chunk // self.bs
        return [tuple(ids[c * per:(c + 1) * per]) for c in range(self.tokens // self.chunk)]

    def reduce(self):
        group, backend, _ = self.collective
        return make_reduce(group, backend)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ---- write ---------------------------------------------------------------
    def write(self, slot: int, prefix: int) -> list[int]:
        """Prefill ``prefix`` into writer blocks ``slot``, store this rank's
        shard of it; its block ids."""
        ids = list(range(slot * self.prefix_blocks, (slot + 1) * self.prefix_blocks))
        toks = self.hit_tokens(prefix)[: self.tokens]
        step, reduce = self.cfg["prefill_chunk"], self.reduce()
        with torch.no_grad():  # not inference_mode: the copy thread writes these tensors in place
            for start in range(0, self.tokens, step):
                new = toks[start:start + step]
                forward(self.model, self.rows, Batch.build([(new, start, ids)], self.bs, self.device),
                        reduce)
        self.sync()
        keys = chunk_keys(self.namespace(), toks)
        by_rank = tuple(tuple(keys) if r == self.tp_rank else () for r in range(self.tp_size))
        storer = Storer(lambda: IndexClient(self.cfg["index_url"], token=self.cfg["index_token"],
                                            client_name="marucache-bench-writer", timeout_s=30),
                        self.pool, self.engine, self.tp_rank, ConnectorStats(), async_store=False)
        try:
            storer.submit(StoreSpec(f"write-{prefix}", by_rank, tuple(self.chunk_blocks(ids)), step=1))
            storer.apply_verdicts({1: True})
        finally:
            storer.close()
        objects = packed_object_keys(self.engine.fmt, keys)
        found = self.client.match_prefix(objects)
        if found != len(objects) // 16:
            raise RuntimeError(f"prefix {prefix} (TP rank {self.tp_rank}) was not stored: the index "
                               f"holds {found} of its {len(objects) // 16} objects (pool full? see the "
                               "index log)")
        return ids

    # ---- one hit --------------------------------------------------------------
    def hit(self, prefix: int, mode: str) -> dict:
        """Load ``prefix`` and compute the first token, started with every
        other process; times on the shared monotonic clock."""
        toks = self.hit_tokens(prefix)
        keys = chunk_keys(self.namespace(), toks[: self.tokens])
        reduce = self.reduce()
        with torch.no_grad():  # not inference_mode: the copy thread writes these tensors in place
            for t in self.layers:  # never zeros or old bytes: random values where the hit lands
                t[self.read_first:self.read_first + self.hit_blocks].normal_()
            batch = Batch.build([(toks[self.tokens:], self.tokens, self.read_ids)], self.bs,
                                self.device)
            self.sync()
            dist.barrier()
            start = time.monotonic()
            verify = self.cfg["verify_payload"]
            pinned = resolve_load(self.client, self.pool, self.engine.fmt, keys,
                                  self.chunk_blocks(self.read_ids), verify_payload=verify)
            try:  # with the payload check, as the connector loads by default
                handle = self.engine.submit_load(pinned.chunks,
                                                 check=pinned.check if verify else None)
                if mode == "sync":
                    self._check(handle.wait_all(WAIT_S), handle, "the load")
                    loaded = time.monotonic()
                    logits = forward(self.model, self.rows, batch, reduce)
                else:
                    names = self.engine.layout.layer_names
                    order = [names.index(layer_name(i)) for i in range(self.local.layers)]
                    logits = forward(self.model, self.rows, batch, reduce, wait=lambda i: self._check(
                        handle.wait_layer_on_device(order[i], WAIT_S), handle, f"layer {i}"))
                token = int(logits.argmax(-1)[0])  # a host read: the forward is done
                first_token = time.monotonic()
                self._check(handle.wait_all(WAIT_S), handle, "the load")
                if mode != "sync":
                    loaded = first_token  # landed before the last layer's attention
            finally:
                release_pins(self.client, pinned)
        return {"start": start, "loaded": loaded, "first_token": first_token, "token": token,
                "payload_checked": verify and pinned.check is not None}

    @staticmethod
    def _check(ok: bool, handle, what: str) -> None:
        if not ok:
            raise RuntimeError(f"{what} did not land within {WAIT_S:.0f} s: {handle.error!r}")

    # ---- checks ----------------------------------------------------------------
    def verify(self, prefix: int, written: dict, fingerprints: dict) -> bool:
        """The hit's blocks against the writer's: bit for bit when this
        process wrote ``prefix``, else by the writer's fingerprints."""
        loaded = self.read_ids[: self.prefix_blocks]
        if prefix in written:
            src = torch.tensor(written[prefix], device=self.device)
            dst = torch.tensor(loaded, device=self.device)
            return all(torch.equal(t.index_select(0, src), t.index_select(0, dst))
                       for t in self.layers)
        return fingerprint(self.layers, loaded) == fingerprints[prefix]


def run(r: Rank, result: dict) -> None:
    cfg = r.cfg
    r.start()
    result["collective"] = r.collective[2]
    progress(r.rank, f"on {r.device}, TP {r.tp_rank}/{r.tp_size}, collective {r.collective[2]}")
    written = {}
    for slot, prefix in enumerate(r.proc["writes"]):
        t = time.monotonic()
        written[prefix] = r.write(slot, prefix)
        progress(r.rank, f"prefix {prefix} computed and stored in {time.monotonic() - t:.1f} s")
    fingerprints: dict = {}
    if cfg["plan"]["experiment"] == "engines":
        mine = {p: fingerprint(r.layers, ids) for p, ids in written.items()}
        every = [None] * r.world
        dist.all_gather_object(every, mine)
        for theirs in every:
            fingerprints.update(theirs)
    dist.barrier()  # every prefix stored before any load
    for k in range(r.world):  # each GPU's peak measured alone
        dist.barrier()
        if k == r.rank and r.cuda:
            result["pinned_peak_gbps"] = pinned_peak_gbps()
    nbytes = r.tokens * r.local.kv_bytes_per_token_layer * r.local.layers
    result["runs"] = {}
    for case in cfg["cases"]:
        prefix = r.proc["loads"][case]
        for mode in cfg["modes"]:
            times, verified = [], True
            for i in range(cfg["repeats"] + 1):  # the first is a warm-up
                times.append(r.hit(prefix, mode))
                verified = r.verify(prefix, written, fingerprints) and verified
            result["runs"].setdefault(case, {})[mode] = {
                "prefix": prefix, "bytes": nbytes, "verified": verified, "times": times[1:],
                "payload_checked": all(t["payload_checked"] for t in times)}
            ttft = sorted(t["first_token"] - t["start"] for t in times[1:])
            progress(r.rank, f"{case}/{mode}: prefix {prefix}, own TTFT median "
                             f"{ttft[len(ttft) // 2] * 1e3:.1f} ms, bits equal {verified}")
    dist.barrier()


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    result = {"rank": cfg["rank"], "ok": False}
    r = None
    try:
        r = Rank(cfg)
        run(r, result)
        result["ok"] = True
    except BaseException as exc:  # reported in the JSON and the log, never silently
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        progress(cfg["rank"], f"FAILED: {result['error']}\n{result['traceback']}")
    with open(os.path.join(cfg["out_dir"], f"rank{cfg['rank']}.json"), "w") as f:
        json.dump(result, f, indent=1)  # first: a close that hangs loses nothing
    if r is not None:
        r.close()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown (NCCL and CUDA destructors)
