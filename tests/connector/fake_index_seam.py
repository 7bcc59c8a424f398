"""Type-checked (not run) by ``test_fake_index_conforms.py``: mypy refuses this
module when ``FakeClient`` or ``IndexClient`` stops implementing ``IndexApi``,
the seam the connector is typed against."""

from __future__ import annotations

from maru_core.index.api import IndexApi
from maru_core.index.client import IndexClient

from fake_index import FakeClient, FakeIndex


def fake_client(index: FakeIndex) -> IndexApi:
    return FakeClient(index)


def real_client(url: str) -> IndexApi:
    return IndexClient(url)
