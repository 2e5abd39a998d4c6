"""Lazy re-exports for package ``__init__`` files: a name's module is imported on first use, so that
importing a frontend stays cheap and optional pieces (kernels, layers) load only when asked for."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """Return ``(__getattr__, __dir__)`` for ``package`` that resolve ``exports`` (name -> module)."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__():
        return sorted(exports)

    return __getattr__, __dir__
