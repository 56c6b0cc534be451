"""Arguments of rllte's and the simple API: tensors or arrays as numpy, flags as bool, devices checked.

rllte hands over torch tensors on any device and termination flags as floats of 0.0 and 1.0; the simple API takes
tensors, arrays or lists. :mod:`~her_store.integrations.rllte` and :mod:`~her_store.integrations.simple` share these
conversions and checks (their counts, flags and callables go through :mod:`her_store.checks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["as_flags", "as_numpy", "checked_device"]


def as_numpy(x: Any) -> np.ndarray:
    """A tensor (on any device) or array-like as a numpy array.

    Examples
    --------
    >>> as_numpy(torch.ones(2))
    array([1., 1.], dtype=float32)
    """
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, refused (ValueError) when it cannot hold a tensor here, e.g. CUDA on a machine
    without it: better at construction than at the first sample, after the data is collected.

    Examples
    --------
    >>> checked_device("cpu")
    device(type='cpu')
    """
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, TypeError) as e:  # torch raises AssertionError when built without CUDA
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"device {device!r} is not available here ({why}); use device='cpu' or an available one"
        ) from e
    return dev


def as_flags(x: Any, name: str) -> np.ndarray:
    """Termination flags as bool: rllte's envs hand them over as float tensors of 0.0 and 1.0.

    Examples
    --------
    >>> as_flags(torch.tensor([0.0, 1.0]), "terminateds")
    array([False,  True])
    """
    a = as_numpy(x)
    if a.dtype == bool:
        return a
    if not np.issubdtype(a.dtype, np.number) or not np.isin(a, (0, 1)).all():
        raise ValueError(f"{name} must hold booleans or 0/1 (one per env), got {np.array2string(a, threshold=8)}")
    return a != 0

