"""The connector's knobs: one definition, one strict parser, one builder.

Every knob of ``kv_connector_extra_config`` is a field of
:class:`ConnectorKnobs`: its name is the key, its annotation the type, its
default the default and its metadata the one-line meaning. The connector
parses what vLLM hands it with :func:`parse_knobs` (its ``MaruConfig``
subclasses :class:`ConnectorKnobs`); the operator and
``make_kv_transfer_config`` write ``--kv-transfer-config`` with
:func:`kv_transfer_config`, which runs the same parser over what it writes.
Neither depends on the other: both import this module.

An unknown key, a value of the wrong type or an impossible combination
raises :class:`ConnectorConfigError`, naming the key and what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, TypedDict, TypeVar

from .protocol.url import parse_url
from .storage_format import StorageFormat

logger = logging.getLogger(__name__)

CONNECTOR_NAME: Final = "MaruKVConnector"
CONNECTOR_MODULE: Final = "maru_connector"
# A load the connector cannot complete safely becomes a recompute (vLLM's default, "fail", ends the request).
LOAD_FAILURE_POLICY: Final = "recompute"

# A knob's value as Python holds it, and as JSON (the extra config) carries it.
KnobValue = str | int | float | bool | StorageFormat | None
JsonKnob = str | int | float | bool | None

# Deprecated keys still accepted: old key -> the knob that replaced it.
DEPRECATED_KEYS: Final[Mapping[str, str]] = {"maru_use_layerwise": "maru_format"}


_T = TypeVar("_T")


class ConnectorConfigError(ValueError):
    """A knob in ``kv_connector_extra_config`` is unknown, ill-typed or conflicting."""


def _doc(default: _T, doc: str) -> _T:
    """A field's default with its one-line meaning (``docs/connector.md`` has the long one)."""
    field: _T = dataclasses.field(default=default, metadata={"doc": doc})
    return field


@dataclass(frozen=True)
class ConnectorKnobs:
    """The validated knobs (DESIGN §5 names); the connector's ``MaruConfig`` adds behaviour only."""

    # Optional with maru_sidecar_socket: the sidecar's hand-off carries the address.
    maru_index_url: str | None = _doc(
        None, "the index: tcp://HOST:PORT or unix:///PATH (with a sidecar: from its hand-off)")
    maru_pool_path: str | None = _doc(None, "attach the pool file directly; exactly one of this and the socket")
    maru_sidecar_socket: str | None = _doc(None, "receive the pool from the sidecar over this Unix socket")
    maru_token: str | None = _doc(None, "the cache's index token, inline")
    maru_token_file: str | None = _doc(None, "the file holding the cache's index token")
    maru_cache_name: str = _doc("default", "the cache's name in metrics")
    maru_kv_chunk_tokens: int = _doc(256, "tokens per chunk, rounded up to a multiple of vLLM's block size")
    maru_format: StorageFormat = _doc(StorageFormat.CHUNKWISE, "how a chunk's KV is cut into pool objects")
    maru_async_load: bool = _doc(False, "park a hit while its KV loads, when another request is live")
    maru_park_lone_hits: bool = _doc(False, "with maru_async_load, park a lone hit too")
    maru_overlap_load_with_compute: bool = _doc(False, "let the forward start before the load ends, per layer")
    maru_overlap_release_after_layers: int = _doc(1, "layers that must have landed before a parked request runs")
    maru_async_store: bool = _doc(True, "store without blocking the forward pass")
    # Pin what a lookup matched right after it, for a worker in the same
    # process (the connector's early_pins.py); off: the worker retrieves, one round trip more.
    maru_early_pins: bool = _doc(True, "pin a lookup's matches in its own round trip (one worker in-process)")
    # Block aliases (maru_core.keys.block_alias_keys): a prompt that shares only the
    # first blocks of a stored chunk loads them (CPU engines; every engine registers them).
    maru_block_aliases: bool = _doc(True, "hits down to vLLM's block, not whole chunks: register and "
                                          "look up block aliases")
    maru_lookup_timeout_s: float = _doc(0.05, "longest a scheduling pass waits for lookup replies")
    maru_load_timeout_s: float = _doc(10.0, "longest a load waits for the index; beyond it, recompute")
    maru_model_id: str | None = _doc(None, "a name for the model in keys, beside its files' fingerprint")
    maru_cache_salt: str = _doc("", "partitions keys, e.g. per tenant")
    maru_stats_dir: str | None = _doc(None, "direct attach: write the counters into stats files here")
    # None: on (both backends), see the connector's MaruConfig.verify_payload().
    maru_verify_payload: bool | None = _doc(None, "check each load's bytes against their checksum")
    # CPU backend: map the pool's pages in the background at start, so hits
    # and stores take no page fault per page they touch. None: on up to a
    # size, see the connector's MaruConfig.prefault_pool().
    maru_prefault_pool: bool | None = _doc(None, "CPU backend: map the pool's pages at start")
    # CPU backend: the cores the copy threads run on: "auto" (those vLLM's
    # CPU worker leaves out of the forward's OpenMP team, if any), "none"
    # (unpinned) or a list like "2,6-7". The connector checks the syntax.
    maru_copy_cpus: str = _doc("auto", "CPU backend: the cores the copy threads run on")
    # CPU backend: "idle" runs the load thread only on cores the forward
    # leaves idle (Linux SCHED_IDLE), "normal" as any other thread.
    maru_copy_priority: str = _doc("idle", "CPU backend: the load thread's priority, idle or normal")

    @property
    def storage_format(self) -> StorageFormat:
        """The storage format (``maru_format``)."""
        return self.maru_format

    @property
    def maru_use_layerwise(self) -> bool:
        """Deprecated spelling of ``maru_format == "layerwise"``, kept for readers of the old name."""
        return self.maru_format is StorageFormat.LAYERWISE

    @property
    def fmt_name(self) -> str:
        """The storage format as it appears in the key namespace."""
        return self.maru_format.value


KnobsT = TypeVar("KnobsT", bound=ConnectorKnobs)

FIELDS: Final[Mapping[str, dataclasses.Field[object]]] = {f.name: f for f in dataclasses.fields(ConnectorKnobs)}
KNOB_NAMES: Final[tuple[str, ...]] = tuple(FIELDS)
_TYPES: Final[Mapping[str, object]] = typing.get_type_hints(ConnectorKnobs)
_KIND_WORDS: Final[Mapping[type, str]] = {
    str: "a string", int: "an integer", float: "a number", bool: "true or false",
    StorageFormat: " or ".join(repr(f.value) for f in StorageFormat),
}


def knob_doc(name: str) -> str:
    """The one-line meaning of knob ``name``."""
    return str(FIELDS[name].metadata["doc"])


def _kind(name: str) -> tuple[type, bool]:
    """The knob's value type and whether it may be None."""
    hint = _TYPES[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    assert len(kinds) == 1 and isinstance(kinds[0], type), f"unhandled annotation {hint} of {name}"
    return kinds[0], len(kinds) < len(args)


def _check_value(name: str, value: object) -> KnobValue:
    """One raw value checked against its knob's type; ints pass for floats, names for formats."""
    kind, optional = _kind(name)
    if value is None and optional:
        return None
    if kind is StorageFormat:
        try:
            return StorageFormat.parse(value)
        except ValueError as exc:
            raise ConnectorConfigError(f"kv_connector_extra_config[{name!r}]: {exc}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, (str, int, float, bool)) and isinstance(value, kind) and (
            kind is bool or not isinstance(value, bool)):
        return value
    raise ConnectorConfigError(
        f"kv_connector_extra_config[{name!r}] must be {_KIND_WORDS[kind]}, got {type(value).__name__} {value!r}")


def _reject_unknown(raw: Mapping[str, object]) -> None:
    for key in raw:
        if key in FIELDS or key in DEPRECATED_KEYS:
            continue
        close = difflib.get_close_matches(key, [*FIELDS, *DEPRECATED_KEYS], n=1, cutoff=0.6)
        hint = ""
        if close:
            instead = DEPRECATED_KEYS.get(close[0])
            hint = f"; did you mean {close[0]!r}" + (f" (deprecated: write {instead!r})?" if instead else "?")
        raise ConnectorConfigError(
            f"unknown key {key!r} in kv_connector_extra_config{hint} (known keys: {', '.join(sorted(FIELDS))})")


def _replace_deprecated(raw: Mapping[str, object]) -> dict[str, object]:
    """``raw`` with ``maru_use_layerwise`` turned into ``maru_format``; a conflict is an error."""
    out = dict(raw)
    if "maru_use_layerwise" not in out:
        return out
    layerwise = out.pop("maru_use_layerwise")
    if not isinstance(layerwise, bool):
        raise ConnectorConfigError(
            f"kv_connector_extra_config['maru_use_layerwise'] must be true or false, got {layerwise!r}; "
            "better, replace it with maru_format ('chunkwise' or 'layerwise')")
    implied = StorageFormat.LAYERWISE if layerwise else StorageFormat.CHUNKWISE
    if "maru_format" in out and _check_value("maru_format", out["maru_format"]) is not implied:
        raise ConnectorConfigError(
            f"maru_use_layerwise={layerwise} contradicts maru_format={out['maru_format']!r}: "
            "remove maru_use_layerwise (deprecated), maru_format alone decides")
    # Not a warning: the operator writes this spelling on purpose (older connectors read only it).
    logger.debug("maru_use_layerwise is the older spelling of maru_format=%r", implied.value)
    out["maru_format"] = implied
    return out


def check_index_url(where: str, url: str) -> None:
    """``url`` as the index client parses it; ``where`` names its source in the error."""
    try:
        parse_url(url)  # the index client's own check of its address
    except ValueError as exc:
        raise ConnectorConfigError(f"{where}: {exc} (it must look like tcp://HOST:PORT or unix:///PATH)") from None


def same_index(a: str, b: str) -> bool:
    """Whether two index addresses name the same endpoint (spelled alike once parsed)."""
    return parse_url(a) == parse_url(b)


def check_combination(knobs: ConnectorKnobs) -> None:
    """Refuse combinations no connector can run with (each message says what to change)."""
    if knobs.maru_index_url is not None:
        check_index_url("maru_index_url", knobs.maru_index_url)
    elif knobs.maru_sidecar_socket is None:
        raise ConnectorConfigError(
            "kv_connector_extra_config needs 'maru_index_url' (tcp://HOST:PORT or unix:///PATH of the "
            "MaruCache index); only with maru_sidecar_socket may it be left out (the sidecar's hand-off carries it)")
    if (knobs.maru_pool_path is None) == (knobs.maru_sidecar_socket is None):
        raise ConnectorConfigError(
            "set exactly one of maru_pool_path (attach the pool file directly) "
            "or maru_sidecar_socket (receive it from the sidecar)")
    if knobs.maru_stats_dir is not None and knobs.maru_sidecar_socket is not None:
        raise ConnectorConfigError(
            "maru_stats_dir is for direct attach (maru_pool_path); with maru_sidecar_socket "
            "the counters go to the sidecar's directory: remove maru_stats_dir")
    if knobs.maru_token is not None and knobs.maru_token_file is not None:
        raise ConnectorConfigError("set maru_token or maru_token_file, not both")
    if knobs.maru_kv_chunk_tokens <= 0:
        raise ConnectorConfigError(f"maru_kv_chunk_tokens must be positive, got {knobs.maru_kv_chunk_tokens}")
    if knobs.maru_overlap_release_after_layers < 0:
        raise ConnectorConfigError(
            f"maru_overlap_release_after_layers must be at least 0, got {knobs.maru_overlap_release_after_layers}")
    for name, seconds in (("maru_lookup_timeout_s", knobs.maru_lookup_timeout_s),
                          ("maru_load_timeout_s", knobs.maru_load_timeout_s)):
        if seconds <= 0:
            raise ConnectorConfigError(f"{name} must be positive, got {seconds}")


def parse_knobs(raw: Mapping[str, object] | None, into: type[KnobsT]) -> KnobsT:
    """``kv_connector_extra_config`` as ``into`` (:class:`ConnectorKnobs` or a subclass), strictly.

    Raises:
        ConnectorConfigError: on an unknown key (with the closest known name),
            a missing ``maru_index_url`` (needed without ``maru_sidecar_socket``),
            an ill-typed value or a conflict.
    """
    raw = dict(raw or {})
    _reject_unknown(raw)
    values = {name: _check_value(name, value) for name, value in _replace_deprecated(raw).items()}
    knobs = into(**values)  # type: ignore[arg-type]  # each value checked against its field's type above
    check_combination(knobs)
    return knobs


class KvTransferConfig(TypedDict):
    """vLLM's ``--kv-transfer-config`` for MaruCache (``KVTransferConfig(**d)``)."""

    kv_connector: str
    kv_connector_module_path: str
    kv_role: str
    kv_load_failure_policy: str
    kv_connector_extra_config: dict[str, JsonKnob]


def _json(value: KnobValue) -> JsonKnob:
    return value.value if isinstance(value, StorageFormat) else value


def extra_config(knobs: ConnectorKnobs, names: Iterable[str] | None = None) -> dict[str, JsonKnob]:
    """``knobs`` as ``kv_connector_extra_config``: the knobs in ``names`` (in that order),
    by default those set to other than their default.

    Raises:
        ValueError: a name that is no knob, or a knob set to other than its
            default but missing from ``names`` (it would be lost silently).
    """
    differ = [n for n, f in FIELDS.items() if f.default is dataclasses.MISSING or getattr(knobs, n) != f.default]
    chosen = list(differ if names is None else names)
    unknown = [n for n in chosen if n not in FIELDS]
    lost = [n for n in differ if n not in chosen]
    if unknown or lost:
        raise ValueError(f"extra_config: no such knob {unknown}" if unknown else
                         f"extra_config: knobs {lost} are set but not written; add them to names")
    return {name: _json(getattr(knobs, name)) for name in chosen}


def kv_transfer_config(knobs: ConnectorKnobs, names: Iterable[str] | None = None) -> KvTransferConfig:
    """The complete ``--kv-transfer-config`` for ``knobs`` (see :func:`extra_config` for ``names``),
    checked by the parser the connector runs at start-up."""
    extra = extra_config(knobs, names)
    parse_knobs(extra, ConnectorKnobs)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": extra,
    }
