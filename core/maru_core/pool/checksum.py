"""Payload checksums: what a reader checks before it trusts an object's bytes.

The slot header's CRC covers the header only; a flipped or overwritten byte
of the payload would be served as valid. So the writer computes a checksum of
the payload as it lies in the pool, after its copy completed and before it
writes the slot header, and the header carries it. A reader recomputes it
over the pinned slot before it copies (``verify_payload``): a mismatch is a
failed load (recompute), never used KV.

The function is XXH3-64 (xxHash): non-cryptographic (it guards against
accidents and late writers, not against someone who can write the pool,
who could write a matching header as well) and fast: about 10 GB/s on one
core of the development VM (``bench/payload_checksum.py``), with the GIL
released while it runs. A value of 0 is stored as 1, so
0 can mean "no checksum" in the header.
"""

from __future__ import annotations

import xxhash

__all__ = ["CHECKSUM_NAME", "payload_checksum"]

#: The checksum function, as the docs and metrics name it.
CHECKSUM_NAME = "xxh3_64"


def payload_checksum(data: bytes | bytearray | memoryview) -> int:
    """The XXH3-64 of ``data``, never 0 (0 marks a header without a checksum)."""
    return xxhash.xxh3_64_intdigest(data) or 1
