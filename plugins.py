"""General plugins: code a deployment loads into every engine and worker process.

vLLM's general plugins (``VLLM_PLUGINS``) in small. ``PAGEDSERVE_PLUGINS`` is a
comma-separated list; each entry is an importable module name or the path of a ``.py``
file. A path is loaded from the file itself, so a plugin need not be on ``sys.path`` of a
Ray actor (a test's plugin in tests/, say). A plugin module may define either hook:

    install_engine(engine)   called at the end of LLMEngine.__init__ (the engine process)
    install_runner(runner)   called at the end of ModelRunner.__init__ (every TP rank)

Each plugin is imported once per process; its hooks run for every engine or runner built.
The variable is read when an engine or runner is built (a few times per process, never on
a step), so with it unset the hooks cost one dictionary look-up. It reaches the engine
replicas (cluster/app.py ENGINE_ENV) and their worker actors (cluster/executors/ray_executor.py).

A file's module is registered under its stem (``/x/my_hooks.py`` -> ``my_hooks``), the
name it has when imported from its own folder, so a process that imported it that way
already gets that module, not a second copy.

Imports nothing of the package: worker/ and cluster/engine both call it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

PLUGINS_ENV = "PAGEDSERVE_PLUGINS"

_loaded: dict[str, ModuleType] = {}  # entry as written in the variable -> its module


def _load_file(path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ImportError(f"{PLUGINS_ENV}: plugin file {path!r} does not exist.")
    name = os.path.splitext(os.path.basename(full))[0]
    have = sys.modules.get(name)
    if have is not None:
        if os.path.abspath(getattr(have, "__file__", None) or "") == full:
            return have
        raise ImportError(f"{PLUGINS_ENV}: plugin file {path!r} would be module {name!r}, "
                          f"which is already {getattr(have, '__file__', None) or 'a built-in module'}; rename the file.")
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ImportError(f"{PLUGINS_ENV}: cannot load plugin file {path!r} (not a Python source file?).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickle look it up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load(entry: str) -> ModuleType:
    if entry.endswith(".py") or os.sep in entry:
        return _load_file(entry)
    try:
        return importlib.import_module(entry)
    except ModuleNotFoundError as e:
        raise ImportError(f"{PLUGINS_ENV}: cannot import plugin module {entry!r}: {e}") from e


def load_plugins() -> list[ModuleType]:
    """The plugins ``PAGEDSERVE_PLUGINS`` names now, each imported on its first mention."""
    spec = os.environ.get(PLUGINS_ENV)
    if not spec:
        return []
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry not in _loaded:
            _loaded[entry] = _load(entry)
        out.append(_loaded[entry])
    return out


def on_engine(engine) -> None:
    """Each plugin's ``install_engine(engine)``, if it has one."""
    for plugin in load_plugins():
        hook = getattr(plugin, "install_engine", None)
        if hook is not None:
            hook(engine)


def on_runner(runner) -> None:
    """Each plugin's ``install_runner(runner)``, if it has one."""
    for plugin in load_plugins():
        hook = getattr(plugin, "install_runner", None)
        if hook is not None:
            hook(runner)
