"""The operator's own Prometheus metrics: reconcile passes, their errors, child writes, autoscaler decisions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from fleet.autoscaler.decision import Decision
from fleet.reconcile import Outcome


class OperatorMetrics:
    """One registry per operator (no module globals), served on --metrics-port."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter("deepseek_operator_reconcile_total", "Reconcile passes by result (ok, invalid, error).",
                                  ["result"], registry=self.registry)
        self.reconcile_seconds = Histogram("deepseek_operator_reconcile_duration_seconds",
                                           "Time one reconcile pass took.", registry=self.registry,
                                           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.child_writes = Counter("deepseek_operator_child_writes_total",
                                    "Children created, updated, adopted or deleted, by verb and kind.",
                                    ["verb", "kind"], registry=self.registry)
        self.autoscaler_decisions = Counter("deepseek_operator_autoscaler_decisions_total",
                                            "Autoscaler polls by the decision's reason (ScaledUp, Stable, ...).",
                                            ["reason"], registry=self.registry)
        self.leader = Gauge("deepseek_operator_leader", "1 while this operator replica holds the leader lease.",
                            registry=self.registry)
        self.fleets = Gauge("deepseek_operator_fleets", "Fleets this operator knows of.", registry=self.registry)

    def observe_pass(self, outcome: Outcome | None, seconds: float, *, failed: bool = False) -> None:
        """Count one pass (outcome None: it folded into a pass already running, or failed)."""
        if failed:
            self.reconciles.labels("error").inc()
        elif outcome is not None:
            self.reconciles.labels("invalid" if outcome.invalid is not None else "ok").inc()
            for action in outcome.actions:
                verb, kind = (action.split(" ") + ["", ""])[:2]
                self.child_writes.labels(verb.lower(), kind).inc()
        if outcome is not None or failed:
            self.reconcile_seconds.observe(seconds)

    def observe_decision(self, decision: Decision) -> None:
        self.autoscaler_decisions.labels(decision.reason).inc()

    def serve(self, port: int) -> None:
        """Serve /metrics on a background thread."""
        start_http_server(port, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
