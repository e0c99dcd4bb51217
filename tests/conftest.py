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


def pytest_collection_finish(session):
    """The interpreted kernel tests run in a process of their own for minutes: start it now, beside the
    rest of the run, and check its result last. The image install checks' virtualenvs start now too."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        installs = getattr(getattr(item, "module", None), "INSTALLS", {})  # tests/fleet/test_images.py's
        if item.name in installs:
            item.module.installing(installs[item.name])
    chosen = [item for item in session.items if item.name == "test_kernel_and_fast_path_tests_pass_under_the_interpreter"]
    if not chosen:
        return
    from tests.engine.test_kernels_interpreted import ON_GPU, interpreter_run

    for item in chosen:
        session.items.remove(item)
        session.items.append(item)
    if not ON_GPU:
        interpreter_run()
