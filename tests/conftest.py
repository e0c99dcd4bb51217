import os

# Tests run several engines, servers and clients at once on a few cores: one OpenMP thread each, or
# their spinning workers starve one another (and every subprocess inherits this).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of the test's own, on a unix socket."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
