"""The index protocol: framing, messages, validation, addresses.

See ``docs/architecture.md`` (Index protocol) for the wire format.
"""

from maru_core.protocol.errors import REPLY_ERROR_TYPES, ErrorType, FrameError, FrameTooLarge, ProtocolError
from maru_core.protocol.framing import (
    HEADER_BYTES,
    MAX_FRAME_BYTES,
    FrameDecoder,
    Message,
    decode_payload,
    encode_frame,
    new_packer,
    payload_length,
    read_frame,
)
from maru_core.protocol.locations import (
    Location,
    LocationList,
    Slot,
    SlotList,
    pack_locations,
    pack_slots,
)
from maru_core.protocol.messages import (
    KEY_BYTES,
    MAX_BATCH_KEYS,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Request,
    error_reply,
    ok_reply,
    pack_counts,
    pack_keys,
    pack_lengths,
    negotiate,
    parse_request,
    request_id,
    unpack_keys,
)
from maru_core.protocol.ops import LEASE_STATE_OPS, OPS, Op
from maru_core.protocol.url import Address, TcpAddress, UnixAddress, parse_url

__all__ = [
    "Address",
    "ErrorType",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "HEADER_BYTES",
    "KEY_BYTES",
    "LEASE_STATE_OPS",
    "Location",
    "LocationList",
    "MAX_BATCH_KEYS",
    "MAX_FRAME_BYTES",
    "Message",
    "OPS",
    "Op",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "REPLY_ERROR_TYPES",
    "Request",
    "Slot",
    "SlotList",
    "TcpAddress",
    "UnixAddress",
    "decode_payload",
    "encode_frame",
    "error_reply",
    "new_packer",
    "ok_reply",
    "pack_counts",
    "pack_keys",
    "pack_lengths",
    "pack_locations",
    "pack_slots",
    "negotiate",
    "parse_request",
    "payload_length",
    "read_frame",
    "request_id",
    "unpack_keys",
    "parse_url",
]
