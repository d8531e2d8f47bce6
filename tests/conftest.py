"""Shared fixtures. Ray and Serve start once per session, lazily (only tests that ask for
them pay the ~6 s Ray start-up and ~10 s Serve start-up), and are shut down at the end."""

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


@pytest.fixture(scope="session")
def ray_session():
    from pagedserve.cluster.ray_utils import init_ray
    import ray

    init_ray()
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()


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


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory):
    from pagedserve.worker.random_models import make_test_model

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
    serve.delete("openai-test")
