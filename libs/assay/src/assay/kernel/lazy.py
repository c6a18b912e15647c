"""A package's public names, imported on first use.

A package `__init__` that imports all of its modules makes every process that needs
one name pay for all of them: `assay serve verify` would load the HTTP client, the
numerical libraries and every stage's models before its first message. A package
names its surface for the type checker under `TYPE_CHECKING` and hands the same
names to `lazy_exports` for the interpreter:

    if TYPE_CHECKING:
        from assay.engine.chat_model import ChatCompletionsModel
    else:
        __getattr__ = lazy_exports(__name__, {"assay.engine.chat_model": ["ChatCompletionsModel"]})

`from assay.engine import ChatCompletionsModel` then imports `assay.engine.chat_model`
and nothing else of the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_exports(package: str, modules: Mapping[str, Sequence[str]]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `package` that imports each name's module on first use.

    Args:
        package: the package's `__name__`.
        modules: each module (absolute name) and the public names it provides.

    Returns:
        The function to bind as the package's `__getattr__`. It raises `AttributeError`
        for a name no module provides, as a module without it would; a name found is
        stored in the package, so it is looked up once.
    """
    where = {name: module for module, names in modules.items() for name in names}

    def attribute(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return attribute
