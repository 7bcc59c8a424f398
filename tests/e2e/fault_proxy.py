"""A fault-injecting TCP proxy between the connector and the real index.

It speaks the index's framing (4-byte big-endian length, then a msgpack map)
so it can tamper with `retrieve` replies (or, armed with `op="retrieve_prefix"`,
with the lookup's pins) the way a faulty network, a buggy index or a racing
writer would:

- `short`: one location fewer than keys;
- `long`: one location more than keys;
- `miss`: the location at `position` becomes `null` (a miss in the middle
  of a chunk's layers, for the layerwise format);
- `delay`: the reply is held back `delay_s` seconds (a slow or hung index);
- `hold_request`: the request is held back `delay_s` seconds before it goes
  to the index (time to kill the index while a retrieve is in flight);
- `corrupt_header`: before forwarding, the slot header of the object at
  `position` is rewritten in the pool with another generation, as if the slot
  had been reused between retrieve and copy;
- `drop`: the connection is closed instead of answering.

Each fault is armed for `count` retrieve replies (or those of `op`: one op,
or a tuple of ops); `fired` counts how many replies were tampered with, so a
test can check that its fault really hit. `replies_seen` counts the replies
of each op: the round trips the index answered.
The proxy runs its own asyncio loop in a thread of the test process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import threading
from dataclasses import dataclass

import msgpack

FAULT_KINDS = ("short", "long", "miss", "delay", "hold_request", "corrupt_header", "drop")


@dataclass
class Fault:
    kind: str
    count: int = 1
    position: int | None = None  # None: the middle of the reply
    delay_s: float = 0.0
    op: str | tuple[str, ...] = "retrieve"

    def applies_to(self, op: str) -> bool:
        return op == self.op if isinstance(self.op, str) else op in self.op


class FaultProxy:
    """Listens on 127.0.0.1 (`self.url`) and forwards to `upstream_port`."""

    def __init__(self, upstream_port: int, pool_path: str | None = None):
        self.upstream_port = upstream_port
        self.pool_path = pool_path
        self.port = 0
        self.url = ""
        self.fired = 0
        self.replies_seen: dict[str, int] = {}
        self._fault: Fault | None = None
        self._lock = threading.Lock()
        self._corrupted: list[tuple[int, object]] = []
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    # -- control (test thread) ------------------------------------------------------

    def start(self) -> "FaultProxy":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        self.port = fut.result(10)
        self.url = f"tcp://127.0.0.1:{self.port}"
        return self

    def arm(self, kind: str, count: int = 1, position: int | None = None, delay_s: float = 0.0,
            op: str | tuple[str, ...] = "retrieve") -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS}")
        with self._lock:
            self._fault = Fault(kind, count, position, delay_s, op)
            self.fired = 0

    def disarm(self) -> None:
        with self._lock:
            self._fault = None

    def restore_headers(self) -> None:
        """Put back every slot header that `corrupt_header` rewrote."""
        if not self._corrupted:
            return
        from maru_core.pool import Pool
        from maru_core.pool.commit_records import CommitRecords

        pool = Pool.attach(self.pool_path)
        try:
            for offset, header in self._corrupted:
                pool.write_slot_header(offset, header)
                CommitRecords(pool)([offset])  # it was committed: the index had marked it so
        finally:
            pool.close()
        self._corrupted.clear()

    def close(self) -> None:
        async def _shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy (loop thread) -------------------------------------------------------

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            c_writer.close()
            return
        self._writers.update((c_writer, u_writer))
        ops: dict[int, str] = {}
        upstream = asyncio.ensure_future(self._pump_requests(c_reader, u_writer, ops))
        downstream = asyncio.ensure_future(self._pump_replies(u_reader, c_writer, ops))
        await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
        for task in (upstream, downstream):
            task.cancel()
        for writer in (c_writer, u_writer):
            writer.close()
            self._writers.discard(writer)

    async def _pump_requests(self, reader, writer, ops: dict[int, str]) -> None:
        while True:
            frame = await _read_frame(reader)
            if frame is None:
                return
            message = msgpack.unpackb(frame, raw=False)
            if isinstance(message, dict) and "id" in message:
                ops[message["id"]] = message.get("op", "")
                fault = self._take_request_fault(message.get("op", ""))
                if fault is not None:
                    await asyncio.sleep(fault.delay_s)
            writer.write(_frame(frame))
            await writer.drain()

    async def _pump_replies(self, reader, writer, ops: dict[int, str]) -> None:
        while True:
            frame = await _read_frame(reader)
            if frame is None:
                return
            message = msgpack.unpackb(frame, raw=False)
            op = ops.pop(message.get("id"), "") if isinstance(message, dict) else ""
            self.replies_seen[op] = self.replies_seen.get(op, 0) + 1
            fault = self._take_fault(op, message)
            if fault is not None:
                if fault.kind == "drop":
                    return
                if fault.kind == "delay":
                    await asyncio.sleep(fault.delay_s)
                else:
                    message = self._tamper(fault, message)
                frame = msgpack.packb(message, use_bin_type=True)
            writer.write(_frame(frame))
            await writer.drain()

    def _take_request_fault(self, op: str) -> Fault | None:
        with self._lock:
            fault = self._fault
            if fault is None or not fault.applies_to(op) or fault.kind != "hold_request":
                return None
            return self._consume(fault)

    def _consume(self, fault: Fault) -> Fault:
        fault.count -= 1
        if fault.count <= 0:
            self._fault = None
        self.fired += 1
        return dataclasses.replace(fault)

    def _take_fault(self, op: str, message: dict) -> Fault | None:
        with self._lock:
            fault = self._fault
            if fault is None or fault.kind == "hold_request" or not fault.applies_to(op) or not message.get("ok"):
                return None
            if op in ("retrieve", "retrieve_prefix") and not message.get("locations"):
                return None
            return self._consume(fault)

    def _tamper(self, fault: Fault, message: dict) -> dict:
        from maru_core.protocol.locations import LocationList, pack_locations

        locations = list(LocationList.from_wire(message["locations"]))
        position = len(locations) // 2 if fault.position is None else fault.position
        if fault.kind == "short":
            locations = locations[:-1]
        elif fault.kind == "long":
            locations = locations + [locations[-1]]
        elif fault.kind == "miss":
            locations[position] = None
        elif fault.kind == "corrupt_header":
            self._corrupt_header(locations[position][0])
        return {**message, "locations": pack_locations(locations)}

    def _corrupt_header(self, offset: int) -> None:
        from maru_core.pool import Pool

        pool = Pool.attach(self.pool_path)
        try:
            header = pool.read_slot_header(offset)
            self._corrupted.append((offset, header))
            pool.write_slot_header(offset, dataclasses.replace(header, generation=header.generation + 1_000_003))
        finally:
            pool.close()


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readexactly(4)
        (length,) = struct.unpack(">I", head)
        return await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload
