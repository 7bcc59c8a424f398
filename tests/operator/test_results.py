"""The operator's closed word sets: what they read as where they leave the operator."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest

from maru_operator.metrics import OperatorMetrics
from maru_operator.pods import core_event
from maru_operator.results import EnsureAction, EventType, ReconcileResult


@pytest.mark.parametrize("word", [*ReconcileResult, *EnsureAction, *EventType], ids=str)
def test_a_word_reads_as_its_value_in_strings_and_json(word):
    assert str(word) == f"{word}" == word.value and json.dumps(word) == json.dumps(word.value)


def test_every_reconcile_result_is_a_label_counted_from_zero():
    metrics = OperatorMetrics.create()
    metrics.count_reconcile(ReconcileResult.WAITING)
    text = generate_latest(metrics.registry).decode()
    for result in ReconcileResult:
        count = 1.0 if result is ReconcileResult.WAITING else 0.0
        assert f'maru_operator_reconciles_total{{result="{result.value}"}} {count}' in text
    assert ReconcileResult.READY.served and ReconcileResult.PROGRESSING.served
    assert not any(r.served for r in ReconcileResult if r not in (ReconcileResult.READY, ReconcileResult.PROGRESSING))


def test_an_event_carries_its_type_as_the_api_spells_it():
    event = core_event({"kind": "Pod", "name": "p", "namespace": "ns"}, EventType.WARNING, "R", "m", "now")
    assert json.loads(json.dumps(event))["type"] == "Warning"
