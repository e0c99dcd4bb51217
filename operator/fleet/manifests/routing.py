"""The InferencePool (Gateway API Inference Extension) of a fleet, when the operator is set to make one.

It sits beside the ClusterIP Service (which stays the fleet's endpoint): a Gateway's HTTPRoute can
name the pool as its backend, and the endpoint picker it references chooses a replica per request.
The endpoint picker itself is not the operator's: deploy one named `<fleet>-epp` (the extension's
chart does) or route to the Service.
"""

from __future__ import annotations

from typing import Any

from fleet import names
from fleet.manifests.services import engine_metadata
from fleet.parent import Parent

API_VERSION = "inference.networking.k8s.io/v1"
ENDPOINT_PICKER_PORT = 9002


def endpoint_picker_name(parent: str) -> str:
    return f"{parent}-epp"


def build_inference_pool(parent: Parent) -> dict[str, Any]:
    """The fleet's serving pods (the leaders of multi-node replicas) on the engine's HTTP port."""
    return {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": engine_metadata(parent),
        "spec": {
            "selector": {"matchLabels": names.engine_selector(parent.name)},
            "targetPorts": [{"number": names.HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": endpoint_picker_name(parent.name),
                "port": {"number": ENDPOINT_PICKER_PORT},
                "failureMode": "FailOpen",  # a missing picker degrades to plain balancing, not errors
            },
        },
    }
