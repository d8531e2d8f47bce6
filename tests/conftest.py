"""Shared fixtures. Ray and Serve start once per session, lazily (only tests that ask for
them pay the Ray and Serve start-up), and are shut down after the last test on them: the
Ray files run first, and an idle Ray with Serve apps still costs CPU (its controller,
GCS, proxy and replicas poll) that the tests after them would share."""

from __future__ import annotations

import pytest

# First, before any test module imports transformers: `python -m pytest` in the checkout puts
# its root on sys.path, where `kernels/` would shadow Hugging Face's `kernels`; importing
# pagedserve takes the root off (pagedserve/__init__.py says why).
import pagedserve  # noqa: F401,E402


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Work units for pytest-xdist's ``--dist loadgroup`` (``./dev test -n 2 --dist loadgroup``):
    every test file with a test on this session's Ray (the ``ray_session`` fixture, directly
    or through ``serve_url``) joins one unit, so one worker starts Ray and Serve once for
    all of them; every other test file is a unit of its own, so a module's fixtures are
    built once. The Ray unit goes first: it is the longest, and it waits on processes much
    of its time, which the other worker fills with in-process tests. Without xdist the
    marks do nothing and only the order changes (the Ray files first)."""
    def file_of(item):
        return item.nodeid.split("::")[0]

    ray_files = {file_of(i) for i in items if "ray_session" in getattr(i, "fixturenames", ())}
    for item in items if config.pluginmanager.hasplugin("xdist") else ():
        item.add_marker(pytest.mark.xdist_group("ray" if file_of(item) in ray_files else file_of(item)))
    items.sort(key=lambda item: file_of(item) not in ray_files)
    on_ray = [i for i in items if file_of(i) in ray_files]
    config._last_ray_test = on_ray[-1].nodeid if on_ray else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Ray and Serve go once the last test on them is done (see the module doc), after its
    module's fixtures have deleted their apps."""
    yield
    if nextitem is not None and item.nodeid == getattr(item.config, "_last_ray_test", None):
        _shutdown_ray()


def _shutdown_ray() -> None:
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_session():
    from pagedserve.cluster.ray_utils import init_ray
    import ray

    init_ray()
    yield ray
    _shutdown_ray()


@pytest.fixture(scope="session")
def serve_url(ray_session):
    """Base URL of one Serve HTTP proxy on 127.0.0.1 shared by all Serve tests; each
    test module deploys its own application under its own route prefix."""
    from ray import serve

    from pagedserve.cluster.ray_utils import get_open_port

    port = get_open_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


# The engine every Serve test talks to: a tiny random Llama (GQA 2:1), fp32, a small KV
# pool, at most 4 running and 2 waiting requests (so 429 is reachable in a test).
SERVE_ENGINE = dict(max_model_len=1024, num_gpu_blocks_override=256, max_num_seqs=4,
                    max_waiting_requests=2, dtype="float32", seed=0)


def delete_app(name: str) -> None:
    """A module's Serve app goes once its tests are done, without waiting for the last of
    its replicas to stop (Serve polls that once a second): the next module deploys
    meanwhile, and the session's serve.shutdown() waits for whatever is left."""
    import ray
    from ray import serve

    if ray.is_initialized():  # not after the last Ray test (a session-wide app's turn comes last)
        serve.delete(name, _blocking=False)


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory):
    from pagedserve.worker.loading.random_models import make_test_model

    return make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "serve-models")


@pytest.fixture(scope="session")
def openai_app(serve_url, serve_model):
    """The OpenAI app deployed once at route prefix "/" (shared by the API and cancel tests)."""
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=serve_model, **SERVE_ENGINE)
    serve.run(build_app(cfg), name="openai-test", route_prefix="/")
    yield serve_url
    delete_app("openai-test")
