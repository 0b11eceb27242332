"""Start-up hook (imported by ``fs_fedpa.pth`` in every interpreter): registers the plugin with FS in time.

FederatedScope builds ``global_cfg`` while ``federatedscope.core.configs.config`` is imported,
which is the first import of its ``main.py``; a ``fedpa:`` section must be registered before
that. This module puts a one-shot finder first on ``sys.meta_path`` that answers only for
``federatedscope.contrib.configs`` (executed by ``config.py`` just before it builds
``global_cfg``), runs the real module, then calls ``register_all()`` and removes itself.
Importing this module costs one finder object: no torch, no FederatedScope.

``FS_FEDPA_DISABLE=1`` in the environment turns the hook off for that process: FS then runs as if the plugin were
not installed (its own methods unchanged; a yaml with a ``fedpa:`` section fails with FS's own config error).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "federatedscope.contrib.configs"
DISABLE = "FS_FEDPA_DISABLE"  # set to anything but "" or "0": no registration in this process


class _RegisterAfterExec(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterExec(spec.loader)
        return spec


def _register() -> None:
    try:
        from fs_fedpa.plugin.registration import register_all

        register_all()
    except Exception as exc:  # never break an interpreter start; say why the plugin is missing
        print(f"fs_fedpa: could not register with FederatedScope: {exc!r}", file=sys.stderr)


def install() -> None:
    if os.environ.get(DISABLE, "") not in ("", "0"):
        return
    if TARGET in sys.modules:  # FS already imported (e.g. the hook was installed late): register now
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
