"""Integrations: the HER APIs users already know (SB3, rllte, the simple API, SB2's wrappers) over the disk store.

Each module imports its optional dependency lazily (:func:`require`) and calls only the public API of the core;
the core never imports this package.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise ImportError saying which extra of her_store installs it.

    Examples
    --------
    >>> sb3 = require("stable_baselines3", "sb3")  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed for this part of her_store; install it with: pip install \"her_store[{extra}]\""
        ) from e
