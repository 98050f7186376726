"""What the stand-in packages are made of: modules whose every name is a `Placeholder`,
made on first import, so SGLang's import-time `from X.y import Z` succeeds while any use
of Z fails loudly, naming it. Nothing here runs unless SGLang really calls a stand-in."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Placeholder:
    """A name a stand-in module exports: usable in annotations, as a base class and as a
    default value; calling it, or anything found on it, raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"stand-in {self._name} was called: not available in the test tier")

    def __getattr__(self, attribute: str) -> Placeholder:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self._name}.{attribute}")

    def __or__(self, other: object) -> Any:
        return Any

    __ror__ = __or__

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class StandIn(types.ModuleType):
    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Placeholder(f"{self.__name__}.{attribute}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every submodule of the stand-in packages on demand."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self._roots = roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.partition(".")[0] in self._roots and "." in name:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def stand_in(package: str, version: str) -> None:
    """Make `package` (already being imported) a stand-in: its names and submodules."""
    module = sys.modules[package]
    module.__class__ = StandIn
    module.__version__ = version  # type: ignore[attr-defined]
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(("torchvision", "sgl_kernel")))
