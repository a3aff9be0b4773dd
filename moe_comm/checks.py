"""Host-side input checks shared by the ops: they read only metadata, never a device value."""

from __future__ import annotations

import torch


def check_tensor(name: str, t, device: torch.device, dtypes, shape=None, dtype_fix: str = "") -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor on ``device`` with a dtype in ``dtypes`` and,
    if ``shape`` is given, that shape (None entries match any size). ``dtype_fix``: how to use another
    dtype, ``{dtype}`` standing for the tensor's (e.g. the constructor argument that chooses it)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, this group is on {device}: move it with .to({str(device)!r}) "
                         f"or build the group on {t.device} (moe_comm.init(..., device=...))")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        fix = f"; to use {t.dtype}, " + dtype_fix.format(dtype=t.dtype) if dtype_fix else ""
        raise TypeError(f"{name} has dtype {t.dtype}, expected one of {dtypes}{fix}")
    if shape is None:
        return
    have = t.shape
    if have == shape:   # every size given and equal (one comparison: this runs at every op call)
        return
    if len(have) == len(shape):   # a loop, not any(...) over a generator
        for size, want in zip(have, shape):
            if want is not None and size != want:
                break
        else:
            return
    want = ", ".join("any" if s is None else str(s) for s in shape)
    raise ValueError(f"{name} has shape {tuple(have)}, expected ({want})")
