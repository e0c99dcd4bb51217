"""Deciding whether a child needs a write, and what the write removes."""

from __future__ import annotations

import json

from fleet import names
from fleet.drift import contains, merge_patch, record, with_record


def live_of(desired: dict, **server_side: dict) -> dict:
    """desired as the API server would return it: our record plus defaults it adds."""
    obj = json.loads(json.dumps(with_record(desired)))
    for key, extra in server_side.items():
        obj[key] = {**obj.get(key, {}), **extra}
    return obj


DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "v3", "labels": {"a": "1"}},
    "spec": {"replicas": 2, "template": {"metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "net"}},
                                         "spec": {"containers": [{"name": "engine", "image": "e:1",
                                                                  "resources": {"limits": {"memory": "1Gi", "cpu": "1"}}}]}}},
}


def test_server_defaults_are_not_drift() -> None:
    live = live_of(DEPLOYMENT, spec={"revisionHistoryLimit": 10, "progressDeadlineSeconds": 600})
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"readyReplicas": 2}
    assert merge_patch(with_record(DEPLOYMENT), live) is None


def test_canonicalised_quantities_are_not_drift() -> None:
    live = live_of(DEPLOYMENT)
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"memory": "1024Mi", "cpu": "1000m"}
    assert contains(live, with_record(DEPLOYMENT))
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "2Gi"
    assert not contains(live, with_record(DEPLOYMENT))


def test_changed_values_and_list_lengths_are_drift() -> None:
    live = live_of(DEPLOYMENT)
    live["spec"]["template"]["spec"]["containers"].append({"name": "sidecar", "image": "x"})
    patch = merge_patch(with_record(DEPLOYMENT), live)
    assert patch is not None and len(patch["spec"]["template"]["spec"]["containers"]) == 1


def test_fields_we_stop_setting_are_removed() -> None:
    live = live_of(DEPLOYMENT)
    without_rdma = json.loads(json.dumps(DEPLOYMENT))
    del without_rdma["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
    patch = merge_patch(with_record(without_rdma), live)
    assert patch["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] is None
    assert json.loads(patch["metadata"]["annotations"][names.LAST_APPLIED]) == json.loads(record(without_rdma))


def test_replicas_are_never_removed_when_another_owner_takes_them() -> None:
    live = live_of(DEPLOYMENT)
    live["spec"]["replicas"] = 7  # the autoscaler's choice
    autoscaled = json.loads(json.dumps(DEPLOYMENT))
    del autoscaled["spec"]["replicas"]
    assert merge_patch(with_record(autoscaled), live) is None
    assert "replicas" not in json.loads(record(DEPLOYMENT))["spec"]


def test_labels_others_add_are_kept() -> None:
    live = live_of(DEPLOYMENT)
    live["metadata"]["labels"]["argocd.argoproj.io/instance"] = "x"
    assert merge_patch(with_record(DEPLOYMENT), live) is None
