"""Operator settings: namespace-scoped or cluster-wide, from flags or environment."""

from __future__ import annotations

import pytest

from fleet.settings import OperatorSettings


def test_cluster_wide_by_default() -> None:
    settings = OperatorSettings.load([], environ={})
    assert settings.clusterwide and settings.namespaces == ()
    assert settings.liveness_endpoint == "http://0.0.0.0:8080/healthz"


def test_namespaces_from_flags_or_environment() -> None:
    assert OperatorSettings.load(["-n", "a", "--namespace", "b"], environ={}).namespaces == ("a", "b")
    from_env = OperatorSettings.load([], environ={"DEEPSEEK_OPERATOR_NAMESPACES": "a, team-*"})
    assert from_env.namespaces == ("a", "team-*") and not from_env.clusterwide
    forced = OperatorSettings.load(["-A"], environ={"DEEPSEEK_OPERATOR_NAMESPACES": "a"})
    assert forced.clusterwide


def test_namespace_patterns_are_told_apart_from_names() -> None:
    from fleet.rbac import rules

    assert not OperatorSettings.load(["-n", "llm", "-n", "llm-staging"], environ={}).namespace_globs
    assert OperatorSettings.load(["-n", "llm-*"], environ={}).namespace_globs
    assert OperatorSettings.load(["-n", "!kube-system"], environ={}).namespace_globs
    namespaces = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}
    assert namespaces in rules(namespace_globs=True) and namespaces not in rules()


def test_liveness_and_verbosity() -> None:
    settings = OperatorSettings.load(["--liveness", "off", "-v"], environ={})
    assert settings.liveness_endpoint is None and settings.verbose


def test_conflicting_scopes_are_refused() -> None:
    with pytest.raises(SystemExit):
        OperatorSettings.load(["-A", "-n", "x"], environ={})


def test_engine_image_from_flag_environment_or_the_release() -> None:
    from fleet.options import DEFAULT_ENGINE_IMAGE

    assert OperatorSettings.load([], environ={}).engine_image == DEFAULT_ENGINE_IMAGE
    from_env = OperatorSettings.load([], environ={"DEEPSEEK_OPERATOR_ENGINE_IMAGE": "r/e:2"})
    assert from_env.build_options().engine_image == "r/e:2"
    flag = OperatorSettings.load(["--engine-image", "r/e:3"], environ={"DEEPSEEK_OPERATOR_ENGINE_IMAGE": "r/e:2"})
    assert flag.engine_image == "r/e:3"


def test_resync_interval() -> None:
    assert OperatorSettings.load([], environ={}).resync_seconds == 60
    assert OperatorSettings.load([], environ={"DEEPSEEK_OPERATOR_RESYNC_SECONDS": "0"}).resync_seconds == 0
    assert OperatorSettings.load(["--resync-seconds", "5"], environ={}).resync_seconds == 5


def test_leader_election_setting_and_its_rules() -> None:
    from fleet.rbac import rules

    assert OperatorSettings.load([], environ={}).leader_election is None
    assert OperatorSettings.load(["--leader-election", "ops/lease"], environ={}).leader_election == "ops/lease"
    leases = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
    assert leases in rules(leader_election=True) and leases not in rules()
