"""Optional dependencies, imported only when a feature needs them, with the ``pip install`` line that adds them."""

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
