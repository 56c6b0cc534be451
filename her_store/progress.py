"""Progress bars of long operations: tqdm when it is installed and enabled, else nothing."""

from __future__ import annotations

from typing import Any

__all__ = ["progress"]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int | None, desc: str, enabled: bool = True, unit: str = "it", unit_scale: bool = False) -> Any:
    """A progress bar with ``update(n)`` and ``close()`` (a context manager too), or one that shows nothing when
    ``enabled`` is false or tqdm is not installed.

    Examples
    --------
    >>> with progress(3, "copying", enabled=False) as bar:
    ...     bar.update(3)
    """
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, leave=False, dynamic_ncols=True)
