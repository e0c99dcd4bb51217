"""Property-based requests from the server's own OpenAPI document (schemathesis, a fixed small budget)
against a real server: whatever a client sends, no 5xx, and every error is OpenAI's body."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.engine.conftest_server import ServerProcess, module_servers, tiny_checkpoint_in


def start_servers(session, tmp_path_factory) -> dict[str, ServerProcess]:
    # short generations: a case asking for 100k tokens would otherwise run for minutes on a CPU
    return {"server": ServerProcess(tiny_checkpoint_in(tmp_path_factory), tmp_path_factory.mktemp("log") / "server.log",
                                    "--max-model-len", "64")}


@pytest.fixture(scope="module")
def server(request):
    proc = module_servers(request).pop("server")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_no_request_makes_the_server_fail(case, server):
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
