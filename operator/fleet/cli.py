"""`deepseek-operator`: run the Kopf operator with our settings."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

import kopf

from fleet.settings import OperatorSettings


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags and environment, register the handlers, run until signalled (or the lease is lost)."""
    settings = OperatorSettings.load(sys.argv[1:] if argv is None else argv)
    kopf.configure(verbose=settings.verbose)
    import fleet.handlers  # noqa: F401  (registers the handlers)

    lost, stop_renewing, renewing = threading.Event(), threading.Event(), None
    if settings.leader_election:
        waiting = threading.Event()
        handlers = {sig: signal.signal(sig, lambda *_: waiting.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        elector = _elector(settings.leader_election)
        if not elector.wait_until_leader(waiting):  # a waiting candidate stops when asked, too
            return
        for sig, handler in handlers.items():  # from here on Kopf handles the signals
            signal.signal(sig, handler)

        def step_down() -> None:  # stop the way a SIGTERM stops Kopf
            lost.set()
            os.kill(os.getpid(), signal.SIGTERM)

        renewing = threading.Thread(target=elector.keep_leading, args=(stop_renewing, step_down), name="lease",
                                    daemon=True)
        renewing.start()
    kopf.run(
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        # One active replica: alone, or the Lease holder. Kopf's own peering is not used (it would
        # pause Kopf's handlers but not the resync and autoscaler tasks).
        standalone=True,
        liveness_endpoint=settings.liveness_endpoint,
        memo=kopf.Memo(settings=settings),
    )
    if lost.is_set():
        sys.exit(1)  # restarted by the kubelet, as a candidate again
    if renewing is not None:  # a clean stop: every handler has returned, so the next candidate may act now
        stop_renewing.set()
        renewing.join(timeout=10)  # a renewal in flight lands before the release, not after it
        elector.release()


def _elector(lease: str):  # noqa: ANN202
    from kubernetes import client, config

    from fleet.leader import LeaderElector

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    namespace, _, name = lease.rpartition("/")
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    return LeaderElector(client.CoordinationV1Api(client.ApiClient()), namespace or "default", name, identity)
