"""How the training job stops and fails: SIGTERM as Ctrl-C, the step an error came from, and its one-line message.

:func:`~her_store.integrations.train.main` never prints a traceback: every failure is one line naming what failed
(the note :func:`doing` adds to an exception) and the error, and SIGTERM stops a run as Ctrl-C does (a checkpoint is
written first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from her_store.errors import StoreError

__all__ = ["CLEAR_ERRORS", "Terminated", "doing", "one_line"]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or ``docker stop``'s), raised where the job runs so that it stops as on Ctrl-C.

    :func:`~her_store.integrations.train.main` raises it from its SIGTERM handler: the run writes its checkpoint and
    ``main`` returns 143.

    Examples
    --------
    >>> issubclass(Terminated, KeyboardInterrupt)
    True
    """


@contextmanager
def doing(what: str) -> Iterator[None]:
    """Name the step of the job an exception came from (a note on it, unless it has one), for :func:`one_line`."""
    try:
        yield
    except Exception as e:
        if not getattr(e, "__notes__", None):
            e.add_note(what)
        raise


# errors whose message says what was wrong by itself (the job's own checks, the store's)
CLEAR_ERRORS = (ValueError, TypeError, ImportError, StoreError, OSError)


def one_line(e: BaseException) -> str:
    """``<what failed>: <Type>: <message>`` (an error of the job's own checks: its message alone), on one line.

    Examples
    --------
    >>> e = OSError("disk full")
    >>> e.add_note("writing the checkpoint runs/bits/checkpoints/step-000001000")
    >>> one_line(e)
    'writing the checkpoint runs/bits/checkpoints/step-000001000: OSError: disk full'
    """
    message = " ".join(str(e).split())
    notes = getattr(e, "__notes__", None)
    if not notes:
        return message if isinstance(e, CLEAR_ERRORS) else f"{type(e).__name__}: {message}"
    return f"{notes[0]}: {type(e).__name__}: {message}".rstrip(": ")
