"""The same Triton cache key for the same kernel in every process (Triton 3.6's keys depend on history).

Triton names a compiled kernel in its on-disk cache by a hash of the kernel's source and of everything it
calls, computed once per process (``JITFunction.cache_key``). Part of that hash is the ``tl.constexpr``
globals the kernel uses *including those of the functions it calls*, and Triton 3.6 merges a callee's
globals into its caller *before* computing the callee's key: a helper hashed for the first time inside
a caller contributes none of its globals. So a kernel's key depends on which other kernels this process
hashed first. Measured here: ``combine_recv_kernel``'s key differs depending on whether
``dispatch_local_kernel`` was hashed before it (they share ``sync.record_group_error``, whose own key
then differs too); a process that launches the kernels in another order than the one that filled the
cache misses it and compiles again, which defeats ``moe_comm warmup``. (Triton fixed this upstream
after 3.6: "Make JIT dependency cache keys deterministic", triton-lang/triton#10494.)

``settle()`` recomputes the keys of every ``@triton.jit`` function of the loaded moe_comm modules until
they stop changing: after the first round every function carries the globals it uses itself, and each
further round carries them one call level up, so the fixed point is every function with the globals of
all it calls, whatever the order. ``interpreter.kernel_for`` settles once before the first compiled
launch of a moe_comm kernel (and again when a kernel of a module loaded since shows up), so every
process computes these complete keys, and a cache filled by one is found by the others.
"""

from __future__ import annotations

import sys
import threading
import warnings

MAX_ROUNDS = 16          # deeper than any call chain of our kernels; reaching it raises
_ROOT = "moe_comm."
_TWINS = "moe_comm._interpreted."
_settled: set[int] = set()   # id() of every function whose key is settled
_lock = threading.Lock()


def _functions() -> list:
    """Every compiled ``@triton.jit`` function defined in a loaded moe_comm module (not the interpreted twins)."""
    from triton.runtime.jit import JITFunction  # noqa: PLC0415
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(_ROOT) or name.startswith(_TWINS):
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, JITFunction) and value.fn.__module__ == name:
                out.append(value)
    return out


def settle() -> list[str]:
    """Recompute the keys of every moe_comm ``@triton.jit`` function until a round changes none (module
    docstring); returns them. Thread-safe; a few milliseconds per function and round."""
    with _lock:
        fns = _functions()
        previous = None
        for _ in range(MAX_ROUNDS):
            for f in fns:
                f.hash = None
            keys = [f.cache_key for f in fns]
            if keys == previous:
                _settled.update(id(f) for f in fns)
                return keys
            previous = keys
        raise RuntimeError(f"Triton cache keys of moe_comm's kernels did not settle in {MAX_ROUNDS} rounds")


def settle_for(fn) -> None:
    """Settle before ``fn`` (a compiled ``@triton.jit`` kernel) is first launched, if it is one of moe_comm's
    and not settled yet. The check is one set lookup. A failure to settle costs cache hits, never a
    launch: it is warned about once and the keys stay as Triton computes them."""
    if id(fn) in _settled or not fn.fn.__module__.startswith(_ROOT):
        return
    try:
        settle()
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"moe_comm: Triton cache keys not settled ({type(e).__name__}: {e}); a warm Triton cache "
                      "may be missed", RuntimeWarning, stacklevel=2)
        _settled.update(id(f) for f in _functions())
