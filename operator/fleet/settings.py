"""Operator settings: command-line flags over environment variables over defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.options import DEFAULT_ENGINE_IMAGE, BuildOptions

ENV_PREFIX = "DEEPSEEK_OPERATOR_"


class OperatorSettings(BaseModel):
    """How the operator runs."""

    model_config = ConfigDict(frozen=True)

    namespaces: tuple[str, ...] = ()
    """Namespaces (or Kopf globs) to watch; empty means the whole cluster."""
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz"
    """Where Kopf serves its liveness probe; None turns it off."""
    verbose: bool = False
    """Debug logging."""
    engine_image: str = Field(default=DEFAULT_ENGINE_IMAGE, min_length=1)
    """Engine image of fleets that name none in spec.engine.image."""
    resync_seconds: float = Field(default=60.0, ge=0)
    """Interval of the periodic pass over every fleet (0 turns it off)."""
    pod_monitors: bool = False
    """Give every fleet a PodMonitor for its engines (Prometheus Operator)."""
    inference_pools: bool = False
    """Give every fleet an InferencePool (Gateway API Inference Extension) beside its Service."""
    leader_election: str | None = None
    """`namespace/name` of the Lease that replicas of the operator elect a leader with; None: run alone."""
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    """Port of the operator's own Prometheus /metrics (0 turns it off)."""

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @property
    def namespace_globs(self) -> bool:
        """Whether a namespace is a Kopf pattern (`llm-*`, `!kube-*`), which needs the namespaces observed."""
        return any(c in ns for ns in self.namespaces for c in "*?!,")

    def build_options(self) -> BuildOptions:
        """The part of the settings that shapes every fleet's children."""
        return BuildOptions(engine_image=self.engine_image, pod_monitors=self.pod_monitors,
                            inference_pools=self.inference_pools)

    @classmethod
    def load(cls, argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> OperatorSettings:
        """Settings from flags, then DEEPSEEK_OPERATOR_* variables, then defaults."""
        parser = argparse.ArgumentParser(
            prog="deepseek-operator", description="Run the DeepSeekDeployment operator (Kopf)."
        )
        scope = parser.add_mutually_exclusive_group()
        scope.add_argument("-n", "--namespace", action="append", dest="namespaces", metavar="NS",
                           help="watch this namespace (repeatable; Kopf globs allowed); env DEEPSEEK_OPERATOR_NAMESPACES")
        scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch the whole cluster (default)")
        parser.add_argument("--liveness", metavar="URL", help="liveness endpoint; 'off' disables it")
        parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
        parser.add_argument("--resync-seconds", metavar="S", type=float,
                            help="interval of the periodic pass over every fleet, 0 = off (60); "
                            "env DEEPSEEK_OPERATOR_RESYNC_SECONDS")
        parser.add_argument("--pod-monitors", action="store_true",
                            help="a PodMonitor per fleet (Prometheus Operator); env DEEPSEEK_OPERATOR_POD_MONITORS")
        parser.add_argument("--inference-pools", action="store_true",
                            help="an InferencePool per fleet; env DEEPSEEK_OPERATOR_INFERENCE_POOLS")
        parser.add_argument("--leader-election", metavar="NS/NAME",
                            help="elect one active replica with this Lease; env DEEPSEEK_OPERATOR_LEADER_ELECTION")
        parser.add_argument("--metrics-port", metavar="PORT", type=int,
                            help="port of the operator's /metrics, 0 = off (9090); env DEEPSEEK_OPERATOR_METRICS_PORT")
        parser.add_argument("--engine-image", metavar="IMAGE",
                            help="engine image of fleets without spec.engine.image; env DEEPSEEK_OPERATOR_ENGINE_IMAGE")
        args = parser.parse_args(list(argv))
        env_namespaces = [n.strip() for n in environ.get(f"{ENV_PREFIX}NAMESPACES", "").split(",") if n.strip()]
        namespaces = () if args.all_namespaces else tuple(args.namespaces or env_namespaces)
        liveness = args.liveness or environ.get(f"{ENV_PREFIX}LIVENESS") or cls.model_fields["liveness_endpoint"].default
        return cls(
            namespaces=namespaces,
            liveness_endpoint=None if liveness == "off" else liveness,
            verbose=args.verbose or _true(environ.get(f"{ENV_PREFIX}VERBOSE")),
            pod_monitors=args.pod_monitors or _true(environ.get(f"{ENV_PREFIX}POD_MONITORS")),
            inference_pools=args.inference_pools or _true(environ.get(f"{ENV_PREFIX}INFERENCE_POOLS")),
            leader_election=args.leader_election or environ.get(f"{ENV_PREFIX}LEADER_ELECTION") or None,
            metrics_port=_first(args.metrics_port, environ.get(f"{ENV_PREFIX}METRICS_PORT"),
                                cls.model_fields["metrics_port"].default),
            engine_image=args.engine_image or environ.get(f"{ENV_PREFIX}ENGINE_IMAGE") or DEFAULT_ENGINE_IMAGE,
            resync_seconds=_first(args.resync_seconds, environ.get(f"{ENV_PREFIX}RESYNC_SECONDS"),
                                  cls.model_fields["resync_seconds"].default),
        )


def _true(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes")


def _first(*values: object) -> object:
    """The first value that is set (a flag, then an environment variable, then the default)."""
    return next(v for v in values if v is not None and v != "")
