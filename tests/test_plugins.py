"""plugins.py: PAGEDSERVE_PLUGINS, the one way code from outside (a test's planted
failures, a deployment's extension) reaches the engine and its workers.

- unset: nothing is loaded and the hooks do nothing;
- a .py file by its path: imported once per process, its install_engine / install_runner
  called for every engine or runner built; a file its folder already imported (the tests'
  fault_plugin.py) is that same module, so the test's InjectedFault is the one raised;
- a module name, in a comma-separated list with a file: each plugin's own hooks only;
- a path or a name that does not load: an ImportError naming it.
"""

from __future__ import annotations

import sys

import pytest

import fault_plugin
from pagedserve import plugins

HOOKS = """
LOADS = []
LOADS.append(1)  # module code: runs once per process
ENGINES, RUNNERS = [], []

def install_engine(engine):
    ENGINES.append(engine)

def install_runner(runner):
    RUNNERS.append(runner)
"""


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test loads its plugins anew and leaves none of its modules (ps_*) behind."""
    monkeypatch.setattr(plugins, "_loaded", {})
    yield
    for name in [n for n in sys.modules if n.startswith("ps_")]:
        del sys.modules[name]


def test_unset_loads_nothing(monkeypatch):
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    assert plugins.load_plugins() == []
    plugins.on_engine(object())
    plugins.on_runner(object())
    assert plugins._loaded == {}


def test_a_file_is_loaded_once_and_its_hooks_run_for_each_object(tmp_path, monkeypatch):
    path = tmp_path / "ps_test_hooks.py"
    path.write_text(HOOKS)
    monkeypatch.setenv(plugins.PLUGINS_ENV, str(path))
    engine, runner_a, runner_b = object(), object(), object()
    plugins.on_engine(engine)
    plugins.on_runner(runner_a)
    plugins.on_runner(runner_b)
    (mod,) = plugins.load_plugins()
    assert mod.__name__ == "ps_test_hooks" and sys.modules["ps_test_hooks"] is mod
    assert mod.LOADS == [1]
    assert mod.ENGINES == [engine] and mod.RUNNERS == [runner_a, runner_b]


def test_a_module_name_and_a_file_in_one_list(tmp_path, monkeypatch):
    pkg = tmp_path / "on_path"
    pkg.mkdir()
    (pkg / "ps_runner_only.py").write_text("RUNNERS = []\ndef install_runner(r):\n    RUNNERS.append(r)\n")
    (tmp_path / "ps_both.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv(plugins.PLUGINS_ENV, f" ps_runner_only , {tmp_path / 'ps_both.py'},")
    engine, runner = object(), object()
    plugins.on_engine(engine)  # ps_runner_only has no install_engine: skipped
    plugins.on_runner(runner)
    only, both = plugins.load_plugins()
    assert only.RUNNERS == [runner]
    assert both.ENGINES == [engine] and both.RUNNERS == [runner]


def test_the_fault_plugin_by_path_is_the_module_the_tests_import(monkeypatch):
    monkeypatch.setenv(fault_plugin.PLUGINS_ENV, fault_plugin.PLUGIN_PATH)
    assert plugins.load_plugins() == [fault_plugin]


@pytest.mark.parametrize("entry, message", [
    ("/no/such/dir/ps_hooks.py", "plugin file '/no/such/dir/ps_hooks.py' does not exist"),
    ("ps_no_such_plugin_module", "cannot import plugin module 'ps_no_such_plugin_module'"),
])
def test_a_plugin_that_does_not_load_is_named(monkeypatch, entry, message):
    monkeypatch.setenv(plugins.PLUGINS_ENV, entry)
    with pytest.raises(ImportError, match=message) as e:
        plugins.on_engine(object())
    assert plugins.PLUGINS_ENV in str(e.value)


def test_a_file_named_like_a_loaded_module_is_refused(tmp_path, monkeypatch):
    (tmp_path / "json.py").write_text(HOOKS)
    monkeypatch.setenv(plugins.PLUGINS_ENV, str(tmp_path / "json.py"))
    with pytest.raises(ImportError, match=r"json\.py.*would be module 'json'.*rename"):
        plugins.on_runner(object())
