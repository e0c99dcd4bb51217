import os
import signal

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


# Modules whose tests start engine servers or rank processes, and so keep more than one core busy themselves.
# They run after the others (mostly one thread, or waiting on an emulated API server or a timeout), beside
# which the interpreted kernel tests' process (below) has a core of its own for most of its minutes; in
# collection order it took a core from the servers early on, and one of the two cores stood idle through the
# single-threaded rest. Among them first those whose single server mostly generates alone (the interpreted
# process finishing beside them), last those that start two and three servers at once.
LAST = ("tests/engine/test_server_", "tests/engine/test_parallel.py", "tests/engine/test_parallel_server.py",
        "tests/engine/test_operator_args.py", "tests/e2e/test_kv_fleet.py")


@pytest.fixture(scope="session")
def early_servers():
    """Servers started ahead of the tests that use them, by module name: {module: {name: server}}. A module's
    fixtures pop theirs (tests/engine/conftest_server.py's module_servers); any left at the end, whose module
    never ran (a run stopped early), are killed."""
    started: dict[str, dict] = {}
    yield started
    for servers in started.values():
        for server in servers.values():
            server.stop(signal.SIGKILL)


@pytest.fixture(scope="module", autouse=True)
def start_the_next_servers(request, early_servers):
    """A module with a `start_servers(session, tmp_path_factory) -> {name: server}` function gets its servers
    started (not waited for) when the module before it that has one begins (the first such module: when the
    run begins): a start takes seconds of mostly one core, which that module's tests leave idle for much of
    their time, instead of its own tests waiting for it."""
    items = request.session.items
    modules = [getattr(item, "module", None) for item in items]
    if request.module not in modules:
        yield
        return
    after = len(modules) - modules[::-1].index(request.module)
    for module in (request.module, next((m for m in modules[after:] if hasattr(m, "start_servers")), None)):
        if module is not None and hasattr(module, "start_servers") and module.__name__ not in early_servers:
            try:
                early_servers[module.__name__] = module.start_servers(request.session,
                                                                      request.getfixturevalue("tmp_path_factory"))
            except Exception:  # noqa: BLE001 - the module itself starts them again, and fails there
                pass
    yield


def pytest_collection_modifyitems(session, config, items):
    """The modules of LAST after the rest, in LAST's order; each module's tests in their own order (no test
    depends on the order of tests)."""
    def rank(item) -> int:
        return next((i + 1 for i, prefix in enumerate(LAST) if item.nodeid.startswith(prefix)), 0)

    items.sort(key=rank)


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
