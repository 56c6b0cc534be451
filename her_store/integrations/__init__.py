"""Integrations: the HER APIs users already know (SB3, rllte, the simple API, SB2's wrappers) over the disk store.

Each module imports its optional dependency lazily (:func:`require`) and calls only the public API of the core;
the core never imports this package.
"""

from __future__ import annotations

from her_store.extras import require

__all__ = ["require"]
