import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of the test's own, on a unix socket."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
