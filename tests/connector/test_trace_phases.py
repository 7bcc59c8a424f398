"""``bench/trace_phases.py`` counts a request as served alone only when no
other request was live beside it, so a burst's requests never pass for lone
ones in the benchmark's per-phase figures."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

from trace_phases import lone_requests  # noqa: E402


def _request(events, rid, arrive, first_token, external=0):
    events += [
        [arrive, 1, "main", "add_request>", rid],
        [arrive + 0.001, 1, "main", "update_state_after_alloc>", [f"{rid}-0", external, 1024]],
        [first_token, 1, "main", "token", rid],
    ]


def test_only_requests_with_nobody_beside_them_are_lone():
    events = []
    _request(events, "alone-before", 0.0, 0.1)
    # A burst: "b" arrives while "a" is live; "b"'s own window holds only its
    # own arrival, yet "a" was live beside it all along.
    _request(events, "a", 1.0, 1.5)
    _request(events, "b", 1.1, 1.3)
    _request(events, "alone-after", 2.0, 2.1, external=1023)
    events.sort(key=lambda e: e[0])

    lone = {e.window[0][4]: e for e in lone_requests(events)}

    assert set(lone) == {"alone-before", "alone-after"}
    assert lone["alone-after"].external_tokens == 1023
    assert lone["alone-before"].prompt_tokens == 1024
