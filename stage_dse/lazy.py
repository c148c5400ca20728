"""Package names that load their module on first use (PEP 562): a package lists where each
public name lives, and importing the package imports none of those modules (the symbolic
layer's sympy stays out of processes that only evaluate compiled families)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

__all__ = ["lazy_names"]


def lazy_names(
    package: str, home: dict[str, str], namespace: dict
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose public names live in the
    submodules ``home`` gives (name -> submodule); a name, once loaded, joins ``namespace``
    (the package's globals), so it is looked up once."""

    def __getattr__(name: str) -> object:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{home[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(home))

    return __getattr__, __dir__
