"""Closed sets of words the operator's modules hand each other: typed, so a misspelt one fails the type check
instead of counting under a label nobody watches or matching nothing."""

from __future__ import annotations

import enum


class _Word(str, enum.Enum):
    """A word that reads as itself: in f-strings and `str()` too (a plain str enum reads `Class.MEMBER` there
    from Python 3.11 on)."""

    def __str__(self) -> str:
        return str(self.value)


class ReconcileResult(_Word):
    """How a reconcile (or a delete) of one MaruCache ended: the `result` label of
    `maru_operator_reconciles_total`."""

    READY = "ready"  # children in place, index available
    PROGRESSING = "progressing"  # children in place, waiting for the index Deployment
    INVALID = "invalid"  # the spec cannot be served (ConfigValid=False)
    WAITING = "waiting"  # for capacity or for the device holding the region
    ERROR = "error"  # an API error: kopf retries
    RELEASED = "released"  # a deleted cache's region returned (or draining)

    @property
    def served(self) -> bool:
        """Whether the cache's children are in place (only the index's availability may still change)."""
        return self in (ReconcileResult.READY, ReconcileResult.PROGRESSING)


class EnsureAction(_Word):
    """What `KubeApi.ensure` did to make an object match its manifest."""

    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"
    KEPT = "kept"  # `ensure_once`: it exists already and is left alone


class EventType(_Word):
    """A Kubernetes Event's type."""

    NORMAL = "Normal"
    WARNING = "Warning"
