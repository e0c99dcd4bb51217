"""Fixtures of the operator's end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from operator_harness import Cluster, emulated_cluster


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    """An emulated API server that every Kubernetes client of the test (Kopf's too) talks to."""
    async with emulated_cluster(tmp_path, monkeypatch) as cluster:
        yield cluster
