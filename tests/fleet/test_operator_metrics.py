"""The operator's own /metrics: passes by result, child writes by verb and kind, autoscaler decisions."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from kubernetes.client.exceptions import ApiException

from fleet.autoscaler.decision import Decision
from fleet.autoscaler.registry import Autoscalers
from fleet.reconcile import Outcome
from fleet.runtime import Runtime


class Reconciler:
    def __init__(self) -> None:
        self.outcomes = [Outcome(actions=["Created Deployment v3", "Created Service v3"]), Outcome(),
                         ApiException(status=500)]

    def reconcile(self, namespace: str, name: str, **_: object) -> Outcome:
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_passes_writes_and_decisions_are_counted_and_served() -> None:
    runtime = Runtime(Reconciler(), Autoscalers(kube=None, post_event=lambda *a: None))  # type: ignore[arg-type]
    runtime.reconcile("ns", "v3", wait=True)
    runtime.reconcile("ns", "v3", wait=True)
    with pytest.raises(ApiException):
        runtime.reconcile("ns", "v3", wait=True)
    runtime.autoscalers.on_decision(Decision(2, 3, 12.0, True, "ScaledUp", "m"))
    port = free_port()
    runtime.metrics.serve(port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'deepseek_operator_reconcile_total{result="ok"} 2.0' in text
    assert 'deepseek_operator_reconcile_total{result="error"} 1.0' in text
    assert 'deepseek_operator_child_writes_total{kind="Deployment",verb="created"} 1.0' in text
    assert 'deepseek_operator_autoscaler_decisions_total{reason="ScaledUp"} 1.0' in text
    assert "deepseek_operator_reconcile_duration_seconds_count 3.0" in text
