"""What one client holding the cache's token could do to the others: the attacks of
`bench/index_attacks.py` that need the token and, some of them, the pool.

Each runs in its own process until ``stop`` is set, as ``attack(url, stop, attacker, pool_path)``:

- ``pin_flood``: retrieves 20,000 keys of its own again and again, never unpinning,
  keeping its lease alive (every occurrence of a pin used to be kept);
- ``reserve_hog``: reserves as much of the pool as it is given and never commits,
  heartbeating all along;
- ``evict_wipe``: stores batches of 16,000 one-page objects back to back, so every
  reserve evicts what others stored (the eviction bound used to be per call only);
- ``token_connection_hoard``: opens 1,024 connections with the token and holds them;
- ``token_slowloris``: 30 connections with the token, each announcing a 16 MiB frame
  (a map, as every message is) and sending one byte of it every 5 s.

Every connection of theirs, ``IndexClient`` and raw socket alike, leaves from
``attacker.address`` and presents ``attacker.token`` in its ``hello`` (an
``Attacker``, which ``bench/index_attacks.py`` makes from its flags): by
default another address than the normal clients' with the cache token, with
``--pods`` the normal clients' own address with a pod credential of its own.
Either way another peer than the normal clients, as another pod is, so the
per-peer quotas that stop the attack are the attacker's own.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from maru_core.index.client import IndexClient
from maru_core.pool import Pool, SlotHeader
from maru_core.protocol import PROTOCOL_VERSION, encode_frame, parse_url
from maru_core.protocol.framing import HEADER



@dataclass(frozen=True)
class Attacker:
    """Who an attack is: the address its connections leave from and what it presents in ``hello``
    (the cache token, or a pod credential minted from it). Passed to each attack's process."""

    address: str
    token: str


def _client(url: str, attacker: Attacker, timeout_s: float = 30) -> IndexClient:
    return IndexClient(url, token=attacker.token, timeout_s=timeout_s, client_name="attacker",
                       source_address=attacker.address)  # fmt: skip


def _keys(first: int, count: int) -> list[bytes]:
    return [(first + i).to_bytes(16, "little") for i in range(count)]


def _store(client: IndexClient, pool: Pool, keys: list[bytes]) -> int:
    """Reserve, write the headers of and commit ``keys`` (one page each); how many committed."""
    try:
        slots = client.reserve([(k, 16) for k in keys])
    except Exception:  # a quota or no space: this round stores nothing
        return 0
    placed = [(k, s) for k, s in zip(keys, slots) if s is not None]
    for key, slot in placed:
        pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=16))
    try:
        return sum(client.commit([k for k, _ in placed]))
    except Exception:
        return 0


def pin_flood(url: str, stop, attacker: Attacker, pool_path: str) -> None:
    keys = _keys(2 * 10**7, 20_000)
    with _client(url, attacker) as client, Pool.attach(pool_path) as pool:
        _store(client, pool, keys)
        packed = b"".join(keys)
        while not stop.is_set():
            try:
                client.retrieve(packed)  # pinned again, never unpinned
            except Exception:  # refused by a quota: try again, as a broken connector would
                time.sleep(0.01)


def reserve_hog(url: str, stop, attacker: Attacker, pool_path: str) -> None:
    first = 3 * 10**7
    with _client(url, attacker) as client:
        while not stop.is_set():
            try:
                client.reserve([(k, 4096) for k in _keys(first, 8_000)])
            except Exception:
                stop.wait(0.05)
            first += 8_000


def evict_wipe(url: str, stop, attacker: Attacker, pool_path: str) -> None:
    first = 4 * 10**7
    with _client(url, attacker) as client, Pool.attach(pool_path) as pool:
        while not stop.is_set():
            if not _store(client, pool, _keys(first, 16_000)):
                stop.wait(0.05)
            first += 16_000


def _token_socket(url: str, attacker: Attacker) -> socket.socket:
    address = parse_url(url)
    sock = socket.create_connection((address.host, address.port), timeout=10, source_address=(attacker.address, 0))
    sock.sendall(encode_frame({"id": 0, "op": "hello", "protocol": PROTOCOL_VERSION, "client": "attacker",
                               "token": attacker.token}))  # fmt: skip
    return sock


def still_open(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets the index has not closed (read without blocking); the others are closed here."""
    alive = []
    for s in socks:
        try:
            s.setblocking(False)
            if s.recv(1 << 16) == b"":
                s.close()
                continue
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            continue
        alive.append(s)
    return alive


def token_connection_hoard(url: str, stop, attacker: Attacker, pool_path: str) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    socks: list[socket.socket] = []
    while not stop.is_set():
        while len(socks) < 1024 and not stop.is_set():
            try:
                socks.append(_token_socket(url, attacker))
            except OSError:
                break
        stop.wait(0.5)
        socks = still_open(socks)  # the index may close some (displacement): open them again


def token_slowloris(url: str, stop, attacker: Attacker, pool_path: str) -> None:
    socks: dict[socket.socket, int] = {}
    # A map's first byte, as every message starts (a large frame that does not is refused at once).
    body = b"\xdf\x00\x00\x00\x01" + b"\x00" * (16 * 1024 * 1024 - 5)
    while not stop.is_set():
        while len(socks) < 30:
            try:
                s = _token_socket(url, attacker)
                s.sendall(HEADER.pack(len(body)))
                socks[s] = 0
            except OSError:
                break
        for s, sent in list(socks.items()):
            try:
                s.sendall(body[sent : sent + 1])
                socks[s] = sent + 1
            except OSError:
                s.close()
                del socks[s]
        stop.wait(5.0)


ATTACKS = {
    "pin_flood": pin_flood,
    "reserve_hog": reserve_hog,
    "evict_wipe": evict_wipe,
    "token_connection_hoard": token_connection_hoard,
    "token_slowloris": token_slowloris,
}
