"""The connector's loggers: inside vLLM's logging set-up, repeats collapsed.

vLLM configures one logger, ``vllm`` (its handler, format, level from
``VLLM_LOGGING_LEVEL``, an optional ``--log-config-file``), and keeps it from
propagating to the root. A logger named outside that tree is configured by
no one: its warnings reach Python's last-resort handler as bare lines and its
INFO lines are dropped. So every connector module logs under
``vllm.maru_connector.<module>`` (:func:`get_logger`): its records come out
beside vLLM's own, in vLLM's format, at vLLM's level. Nothing here imports
vLLM; outside a vLLM process the records propagate to the root as any other.

A fault that repeats (the index down, every lookup failing) would print a
line per request; :class:`RepeatFilter` lets the first warning of a kind
through, then at most one per interval carrying the count of those held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: vLLM's logger tree: the connector's loggers hang below it.
VLLM_LOGGER = "vllm"
#: The connector's own subtree (``--log-config-file`` can set its level apart).
ROOT_NAME = f"{VLLM_LOGGER}.maru_connector"
#: Warnings of one kind: the first, then at most one line per this many seconds.
REPEAT_INTERVAL_S = 10.0
_MAX_KINDS = 512  # kinds remembered; warnings carry client values, so bounded


@dataclass
class _Kind:
    shown_at: float  # when the last line of this kind was let through
    held: int = 0  # lines held back since


class RepeatFilter(logging.Filter):
    """Collapses repeated warnings (and errors) of one kind.

    A kind is the logger, the level and the message template (``"KV load for
    %s failed (%s)"`` is one kind whatever request it names), told apart
    further by a ``repeat_kind`` a call site passes in ``extra`` (e.g. the
    file a warning is about, where it paces itself per file). Its first record
    passes; later ones within ``interval_s`` are held back and counted; the
    first after the interval passes with ``[N more like this in the last T s]``
    appended. :meth:`flush` logs the counts still held (at shutdown). Records
    below WARNING always pass: DEBUG lines are asked for one by one.
    """

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: OrderedDict[tuple[str, int, str, str], _Kind] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg), str(getattr(record, "repeat_kind", "")))
        now = self._clock()
        with self._lock:
            kind = self._kinds.get(key)
            if kind is not None and now - kind.shown_at < self.interval_s:
                kind.held += 1
                return False
            self._kinds[key] = _Kind(shown_at=now)
            self._kinds.move_to_end(key)
            while len(self._kinds) > _MAX_KINDS:
                self._kinds.popitem(last=False)
        if kind is not None and kind.held:
            record.msg = f"{record.msg} [{kind.held} more like this in the last {now - kind.shown_at:.0f} s]"
        return True

    def reset(self) -> None:
        """Forget every kind without logging (each test starts with none held back)."""
        with self._lock:
            self._kinds.clear()

    def flush(self) -> None:
        """Log one line per kind with repeats still held back, and forget them."""
        with self._lock:
            pending = [(key, kind) for key, kind in self._kinds.items() if kind.held]
            self._kinds.clear()
        now = self._clock()
        for (name, level, template, _), kind in pending:
            logging.getLogger(name).log(
                level, "%d more warnings like %r in the last %.0f s", kind.held, template, now - kind.shown_at)


#: The one filter on every connector logger.
repeats = RepeatFilter()


def get_logger(module_name: str) -> logging.Logger:
    """The logger of connector module ``module_name`` (its ``__name__``), under vLLM's tree."""
    name = module_name if module_name.startswith(f"{VLLM_LOGGER}.") else f"{VLLM_LOGGER}.{module_name}"
    logger = logging.getLogger(name)
    if repeats not in logger.filters:
        logger.addFilter(repeats)
    return logger
