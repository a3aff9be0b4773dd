"""Which implementation of a Triton kernel runs a launch: compiled, or Triton's interpreter.

moe-comm never switches Triton's interpreter on for the process (``TRITON_INTERPRET=1`` would change every
other Triton user in it). Instead each launch picks its form from the tensors' device:

- CUDA tensors: the ``@triton.jit`` kernel as defined (compiled);
- CPU tensors (development and CI machines without a GPU): an *interpreted twin* of the kernel;
- ``MOE_COMM_INTERPRET=1`` forces the twin for every launch (debugging; only meaningful with CPU tensors,
  since our kernels dereference raw peer addresses).
- A user's ``TRITON_INTERPRET=1`` makes ``@triton.jit`` return interpreted kernels everywhere, ours too:
  launches on CPU tensors still go to the twin (which carries the patches below), and launches on CUDA
  tensors raise, saying to unset it (a kernel defined interpreted cannot be compiled).

The twin of a kernel module is the same source file imported a second time under the package
``moe_comm._interpreted`` while Triton's ``interpret`` knob is on (scoped: it is restored when the import
ends). Triton's interpreter executes a kernel in its module's globals, so the twin's kernels call the
twin's helpers: every ``@triton.jit`` function a twin kernel reaches is interpreted too. Twins are loaded
on first use; a process that only runs on CUDA never loads one.

Two things the interpreter needs are patched in here, once, and only take effect while an interpreted
kernel runs (inside the interpreter's own patch scope, undone when the launch ends):

- Triton's own ``@jit`` library functions (``tl.sum``, ``tl.cumsum``, ``tl.max``, ...) were defined
  compiled, since Triton was imported with the interpreter off; while an interpreted kernel runs, calling
  one runs its body interpreted (``JITFunction.__call__``, which otherwise only raises).
- NumPy >= 2.4 refuses ``int()`` of a one-element array of ndim > 0, which Triton 3.6's interpreter relies
  on to turn device scalars into loop bounds.
- A call of one ``@jit`` helper from another re-patches the language modules in Triton's interpreter
  (a third of the interpreted time of our kernels); inside a launch they are patched already, so nested
  calls go straight to the rewritten function.
- The interpreter's NumPy dtype of a Triton type (``_get_np_dtype``) builds a 20-entry dict on every call,
  several times per interpreted operation; inside a launch it is looked up once per element type and kept
  (the same answers: ``tests/test_interpret_order.py``; about 5 % of the interpreted time).

``MOE_COMM_INTERPRET_ORDER`` (``moe_comm/interpret_order.py``) runs the programs of our interpreted
launches in reverse or random order instead of grid order (a test of order independence).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import threading
import types

import torch

from . import interpret_order, jit_keys

ENV = "MOE_COMM_INTERPRET"
TWIN_ROOT = "moe_comm._interpreted"   # package under which kernel modules are imported interpreted
_ROOT = "moe_comm"
_lock = threading.Lock()
GLOBAL_INTERPRET_ON_CUDA = (
    "kernel {kernel} was defined while TRITON_INTERPRET=1 was set, so it cannot be compiled for {device} "
    "tensors; unset TRITON_INTERPRET (moe-comm interprets launches on CPU tensors by itself) or use CPU tensors")


def use_interpreter(device) -> bool:
    """True when launches on ``device`` run interpreted (CPU tensors, or MOE_COMM_INTERPRET=1)."""
    if os.environ.get(ENV, "0") == "1":
        return True
    return torch.device(device).type != "cuda"


def kernel_for(fn, device):
    """The launchable form of ``@triton.jit`` kernel ``fn`` for tensors on ``device``: ``fn`` itself when
    compiled, else the same kernel from its interpreted twin module (a kernel defined outside moe_comm,
    e.g. in a benchmark script, is interpreted in its own module: it may call other ``@triton.jit``
    functions, but module-level choices it makes at import stay the compiled ones)."""
    module = fn.fn.__module__
    if not use_interpreter(device):
        if _is_interpreted(fn):
            raise RuntimeError(GLOBAL_INTERPRET_ON_CUDA.format(kernel=fn.fn.__name__, device=device))
        jit_keys.settle_for(fn)   # the same cache key as every other process (Triton 3.6: see jit_keys)
        return fn
    if module.startswith(TWIN_ROOT + "."):
        interpreted = fn
    elif module.startswith(_ROOT + "."):  # also when TRITON_INTERPRET=1 made this module's kernels interpreted
        interpreted = getattr(twin_module(module), fn.fn.__name__)
    else:
        interpreted = _foreign(fn)
    return interpret_order.ordered(interpreted, fn.fn.__name__)  # MOE_COMM_INTERPRET_ORDER (testing)


_FOREIGN: dict = {}


def _foreign(fn):
    """A foreign kernel interpreted in its own module but calling moe_comm's interpreted twins, also when
    TRITON_INTERPRET=1 made it (and the helpers it imported) interpreted where it was defined."""
    interpreted = _FOREIGN.get(fn.fn)
    if interpreted is None:
        import triton.language as tl  # noqa: PLC0415
        from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
        body = _with_twin_helpers(fn.fn)
        with _lock:
            _patch_interpreter()
            body.__globals__.setdefault("_triton_language_core", tl.core)  # see twin_module
            interpreted = _FOREIGN[fn.fn] = InterpretedFunction(body)
    return interpreted


def _with_twin_helpers(py_fn):
    """A copy of a foreign kernel's function whose globals name the interpreted twins of the moe_comm
    ``@triton.jit`` helpers it imported (their compiled forms may use inline PTX, which the interpreter
    cannot run); the kernel's own module is left as it is."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415
    g = dict(py_fn.__globals__)
    for name, value in py_fn.__globals__.items():
        jitted = isinstance(value, (JITFunction, InterpretedFunction))
        module = getattr(getattr(value, "fn", None), "__module__", "") if jitted else ""
        if module.startswith(_ROOT + ".") and not module.startswith(TWIN_ROOT + "."):
            g[name] = getattr(twin_module(module), value.fn.__name__)
    return types.FunctionType(py_fn.__code__, g, py_fn.__name__, py_fn.__defaults__, py_fn.__closure__)


def is_interpreted_module(module_globals: dict) -> bool:
    """For module-level code of a kernel module: is this copy the interpreted twin?"""
    return module_globals.get("__name__", "").startswith(TWIN_ROOT + ".")


def _is_interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    return isinstance(fn, InterpretedFunction)


def twin_module(name: str) -> types.ModuleType:
    """Import module ``name`` (``moe_comm.<...>``) a second time with every ``@triton.jit`` interpreted."""
    if not name.startswith(_ROOT + "."):
        raise ValueError(f"only moe_comm modules have interpreted twins, got {name!r}")
    twin = TWIN_ROOT + name[len(_ROOT):]
    mod = sys.modules.get(twin)
    if mod is not None:
        return mod
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415
    with _lock:
        _patch_interpreter()
        _make_packages(twin)
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = True
            mod = importlib.import_module(twin)
        # A launch patches the language modules its kernel's globals hold; Triton's library functions
        # (run interpreted, see _patch_interpreter) call triton.language.core's builtins, so every twin
        # module holds that module too.
        for name, m in list(sys.modules.items()):
            if name.startswith(TWIN_ROOT + ".") and m is not None:
                m.__dict__.setdefault("_triton_language_core", tl.core)
        return mod


def _make_packages(twin: str) -> None:
    """Register ``moe_comm._interpreted`` and its subpackages as bare packages over the real directories,
    so that the twin's relative imports resolve inside the twin without running any ``__init__``."""
    real = importlib.import_module(_ROOT)
    parts = twin.split(".")
    for depth in range(2, len(parts)):  # moe_comm._interpreted, moe_comm._interpreted.<sub>, ...
        pkg = ".".join(parts[:depth])
        if pkg in sys.modules:
            continue
        real_pkg = _ROOT + pkg[len(TWIN_ROOT):]
        path = list(real.__path__) if real_pkg == _ROOT else list(importlib.import_module(real_pkg).__path__)
        mod = types.ModuleType(pkg, f"interpreted twin of {real_pkg}")
        mod.__path__ = path
        mod.__package__ = pkg
        mod.__spec__ = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        mod.__spec__.submodule_search_locations = path
        sys.modules[pkg] = mod


def _patch_interpreter() -> None:
    """Hook the interpreter's per-launch patching (see the module docstring)."""
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime import interpreter  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415
    if getattr(interpreter, "_moe_comm_patched", False):
        return
    original = interpreter._patch_lang_tensor
    rewritten = {}  # a JITFunction's Python function -> its body rewritten for the interpreter
    np_dtype_of = interpreter._get_np_dtype
    np_dtypes = {}  # a Triton element type -> the interpreter's NumPy dtype for it

    def cached_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):   # unhashable; always uint64
            return np_dtype_of(key)
        found = np_dtypes.get(key)
        if found is None:
            found = np_dtypes[key] = np_dtype_of(key)
        return found

    def call_interpreted(self, *args, **kwargs):
        fn = rewritten.get(self.fn)  # keyed by the plain function: hashing a JITFunction walks its body
        if fn is None:
            fn = rewritten[self.fn] = interpreter.InterpretedFunction(self.fn).rewrite()
        return fn(*args, **kwargs)

    def call_nested(self, *args, **kwargs):
        return self.rewrite()(*args, **kwargs)

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(interpreter, "_get_np_dtype", cached_np_dtype)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        scope.set_attr(JITFunction, "__call__", call_interpreted)
        scope.set_attr(interpreter.InterpretedFunction, "__call__", call_nested)

    interpreter._patch_lang_tensor = _patch_lang_tensor
    interpreter._moe_comm_patched = True
