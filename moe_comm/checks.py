"""Host-side input checks shared by the ops: they read only metadata, never a device value."""

from __future__ import annotations

import torch
from torch import Tensor


def check_tensor(name: str, t, device: torch.device, dtypes, shape=None, dtype_fix: str = "") -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor on ``device`` with a dtype in ``dtypes`` (a dtype or
    a tuple of them) and, if ``shape`` is given, that shape (None entries match any size). ``dtype_fix``:
    how to use another dtype, ``{dtype}`` standing for the tensor's (e.g. the constructor argument that
    chooses it).

    This runs for every tensor of every op call, so a passing tensor takes one chain of comparisons (~0.4-0.8
    µs); only a failing one reaches ``_explain``, which finds what is wrong and says how to fix it."""
    if (isinstance(t, Tensor) and t.device == device
            and (t.dtype in dtypes if type(dtypes) is tuple else t.dtype == dtypes)):
        if shape is None:
            return
        have = t.shape
        if have == shape:   # every size given and equal
            return
        if len(have) == len(shape):   # a loop, not any(...) over a generator
            for size, want in zip(have, shape):
                if want is not None and size != want:
                    break
            else:
                return
    _explain(name, t, device, dtypes, shape, dtype_fix)


def check_words(name: str, t, word_bytes: int = 4) -> None:
    """Raise ValueError unless ``t`` starts on a ``word_bytes`` boundary: the kernels copy its rows as words
    of that size (a view that starts at an odd element, e.g. ``flat[1:].view(T, H)`` of bf16, does not). A
    non-contiguous ``t`` passes: the op copies it (``.contiguous()``) into a new, aligned tensor."""
    off = t.data_ptr() % word_bytes
    if off and t.is_contiguous():
        raise ValueError(f"{name} starts {off} bytes past a {word_bytes}-byte boundary (a view at an odd element "
                         f"offset): its rows are copied as {word_bytes}-byte words; pass {name}.clone() (a new "
                         f"tensor starts aligned)")


def _explain(name: str, t, device: torch.device, dtypes, shape, dtype_fix: str) -> None:
    """Raise the error ``check_tensor`` found, naming the fix."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, this group is on {device}: move it with .to({str(device)!r}) "
                         f"or build the group on {t.device} (moe_comm.init(..., device=...))")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        fix = f"; to use {t.dtype}, " + dtype_fix.format(dtype=t.dtype) if dtype_fix else ""
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {dtypes}{fix}")
    want = ", ".join("any" if s is None else str(s) for s in shape)
    raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({want})")
