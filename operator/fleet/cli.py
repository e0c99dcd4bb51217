"""`deepseek-operator`: run the Kopf operator with our settings."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import kopf

from fleet.settings import OperatorSettings


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags and environment, register the handlers, run until signalled."""
    settings = OperatorSettings.load(sys.argv[1:] if argv is None else argv)
    kopf.configure(verbose=settings.verbose)
    import fleet.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        standalone=True,  # one operator replica; no KopfPeering CRD needed
        liveness_endpoint=settings.liveness_endpoint,
        memo=kopf.Memo(settings=settings),
    )
