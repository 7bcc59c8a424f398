"""Head starts on the CUDA backend: a load's first fills copied before its
blocks exist (``TransferEngine.start_head``), then scattered by the load that
claims them. The oracle is the KV bytes: every block a load wrote is compared
with the block that was stored, so a head's fills scattered into another
load, or overwritten before their scatter ran, show as wrong bytes. Skipped
where no CUDA device is present (CI); run on a GPU machine, see
bench/RESULTS.md."""

import random
import time

import pytest
import torch

from kv_builders import block_bytes, make_kv_caches
from maru_connector.kv_layout import detect_kv_layout
from maru_connector.object_format import ObjectFormat
from maru_connector.transfer import ChunkLoad, ChunkStore
from test_transfer_cuda import ISSUE_PATHS, _issue_options, _plan, engines, pool  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU; passed on an H200, recorded in bench/RESULTS.md (CUDA tests)"),
]

KIND = "flash_nhd"
BLOCKS, CHUNKS, BPC, LAYERS = 36, 4, 2, 6  # three disjoint sets of a load's 8 blocks


class Stored:
    """Two different sets of chunks stored in the pool (``sources[0]``,
    ``sources[1]``) and a loader engine over a fresh KV cache."""

    def __init__(self, engines, pool, layerwise: bool, **options):
        rng = random.Random(f"head{layerwise}")
        self.src = [make_kv_caches(KIND, layers=LAYERS, blocks=BLOCKS, seed=s, device="cuda")
                    for s in (1, 2)]
        self.dst = make_kv_caches(KIND, layers=LAYERS, blocks=BLOCKS, seed=3, device="cuda")
        self.layout = detect_kv_layout(self.dst)
        self.fmt = ObjectFormat(self.layout, BPC * self.layout.block_size, layerwise)
        both = _plan(self.fmt, 2 * CHUNKS, rng, adjacent=False, pool_size=pool.map.size())
        self.sources = [both[:CHUNKS], both[CHUNKS:]]
        self.src_ids = rng.sample(range(BLOCKS), CHUNKS * BPC)
        for src, sources in zip(self.src, self.sources):
            storer = engines(src, ObjectFormat(detect_kv_layout(src), self.fmt.chunk_tokens, layerwise))
            h = storer.submit_store([ChunkStore(self._ids(self.src_ids, c), sources[c])
                                     for c in range(CHUNKS)])
            assert h.wait(30), h.error
        self.loader = engines(self.dst, self.fmt, **options)

    @staticmethod
    def _ids(ids, c):
        return tuple(ids[c * BPC:(c + 1) * BPC])

    def load(self, which: int, block_set: int, head=None, **submit):
        """Load stored set ``which`` into the blocks of ``block_set``."""
        ids = list(range(block_set * CHUNKS * BPC, (block_set + 1) * CHUNKS * BPC))
        chunks = [ChunkLoad(self._ids(ids, c), self.sources[which][c]) for c in range(CHUNKS)]
        return self.loader.submit_load(chunks, head=head, **submit), ids

    def check(self, which: int, ids) -> None:
        for name in self.layout.layer_names:
            for dst_block, src_block in zip(ids, self.src_ids):
                assert torch.equal(block_bytes(KIND, self.dst[name], dst_block),
                                   block_bytes(KIND, self.src[which][name], src_block)), (name, dst_block)


def _first_fill_bytes(stored: Stored) -> int:
    return CHUNKS * stored.fmt.layer_bytes  # the first fill is the first layer alone


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("issue", list(ISSUE_PATHS))
@pytest.mark.parametrize("head_size", ["one_fill", "whole_load"])
def test_a_head_start_s_fills_land_in_the_load_that_claims_it(engines, pool, layerwise, issue, head_size):
    options, submit = _issue_options(issue)
    stored = Stored(engines, pool, layerwise, **options)
    if head_size == "one_fill":
        stored.loader._head_start_bytes = _first_fill_bytes(stored)
    head = stored.loader.start_head(stored.sources[1])
    assert head is not None
    layers_in_head = sum(len(unit[0]) for unit, _ in head.fills)
    assert layers_in_head == (1 if head_size == "one_fill" else LAYERS)
    h, ids = stored.load(1, 0, head=head, **submit)
    assert h.wait_all(30) and h.error is None
    assert stored.loader.heads_used == 1
    stored.check(1, ids)


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_head_start_for_other_sources_is_dropped_not_scattered(engines, pool, layerwise):
    stored = Stored(engines, pool, layerwise)
    head = stored.loader.start_head(stored.sources[0])
    assert head is not None
    h, ids = stored.load(1, 0, head=head)  # another load: set 1's bytes, not the head's
    assert h.wait_all(30) and h.error is None
    assert stored.loader.heads_used == 0
    stored.check(1, ids)
    again = stored.loader.start_head(stored.sources[0])  # the buffer is free again
    assert again is not None
    h, ids = stored.load(0, 1, head=again)
    assert h.wait_all(30) and h.error is None and stored.loader.heads_used == 1
    stored.check(0, ids)


def test_one_head_start_at_a_time_and_a_dropped_one_frees_the_buffer(engines, pool):
    stored = Stored(engines, pool, layerwise=False)
    first = stored.loader.start_head(stored.sources[0])
    assert first is not None
    assert stored.loader.start_head(stored.sources[1]) is None  # the buffer is taken
    first.drop()
    first.drop()  # idempotent
    assert first.claim(stored.sources[0]) is None  # a dropped head is nobody's
    second = stored.loader.start_head(stored.sources[1])
    assert second is not None
    h, ids = stored.load(1, 0, head=second)
    assert h.wait_all(30) and h.error is None and stored.loader.heads_used == 1
    stored.check(1, ids)


@pytest.mark.parametrize("issue", ["inline", "copy_thread"])
def test_the_next_head_start_waits_for_the_last_one_s_scatters(engines, pool, issue):
    """Each head start is queued right after the load that claimed the one
    before, while that load's scatters may still be reading the buffer."""
    options, submit = _issue_options(issue)
    stored = Stored(engines, pool, layerwise=False, **options)
    loads = []
    head = stored.loader.start_head(stored.sources[0])
    for i in range(12):
        which = i % 2
        h, ids = stored.load(which, i % 3, head=head, **submit)
        head = None
        for _ in range(200):  # on the copy thread the buffer is free once its load was issued
            head = stored.loader.start_head(stored.sources[1 - which])
            if head is not None or issue == "inline":
                break
            time.sleep(0.001)
        assert head is not None
        loads.append((which, h, ids))
        if len(loads) == 2:  # the load before the last is done: check it, its blocks are not reused yet
            w, old, old_ids = loads.pop(0)
            assert old.wait_all(30) and old.error is None
            stored.check(w, old_ids)
    head.drop()
    assert stored.loader.heads_used == 12


def test_a_head_start_over_a_bad_extent_starts_nothing(engines, pool):
    stored = Stored(engines, pool, layerwise=False)
    bad = [(pool.map.size(),)] + stored.sources[0][1:]
    assert stored.loader.start_head(bad) is None
    assert stored.loader.start_head(stored.sources[0]) is not None  # nothing was left taken

