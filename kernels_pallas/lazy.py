"""Lazy package exports (PEP 562), shared by `kernels_pallas`, `jax_impl` and `torch_bridge`.

A package lists `name -> submodule`; a name is imported on first use, so importing the
package costs nothing: `kernels_triton` reads `kernels_pallas.contract` and the torch
path reads `jax_impl.config` without importing jax. Standard library only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`: exports[name] is the submodule defining name.

    A submodule itself (`jax_impl.tables`) is imported on first attribute access too.
    """

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        elif importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
