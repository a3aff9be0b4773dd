"""Import-time stand-ins for packages that SGLang imports but that cannot be installed on this CPU venv.

SGLang 0.5.23 imports torchvision while loading its model configs (image preprocessing of vision models),
on every path to its MoE layers. PyPI's torchvision for Linux is built against CUDA torch and does not
load against the CPU torch of this test venv, so it is not installed; instead ``install()`` registers a
``torchvision`` placeholder whose every attribute is an object that raises if it is ever called. Nothing
in the tests calls it: a test that did would fail loudly, not pass silently.

``install_cpu_engine()`` adds what SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) needs on a CPU without
Intel AMX, for tests/sglang/engine_run.py:
- ``sgl_kernel``, the same kind of placeholder: the engine imports it at module level
  (``sglang.kernels.ops.kvcache.cache_move``: ``from sgl_kernel import copy_all_layer_kv_cache_cpu``), but
  its CPU build is not on PyPI (the PyPI package is CUDA-only) and without AMX the engine calls none of it
  on the paths these tests run (a call would raise);
- ``TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value`` (returns 1, as SGLang's Intel AMX backend's
  does): SGLang's CPU engine calls it when it pads a batch for expert or data parallelism
  (``ForwardBatch._pad_inputs_to_size``), and only its AMX attention backend, which needs that kernel
  build, defines it (AttributeError otherwise).
"""

import importlib.machinery
import importlib.util
import sys
import types


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not available in this CPU test venv")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _StubFinder:
    """Serves the packages ``roots`` and all of their submodules as _StubModule."""

    def __init__(self, roots: tuple):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if any(name == root or name.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0"  # read by transformers' version checks; selects no torchvision feature
        return module

    def exec_module(self, module):
        pass


def _found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _stub(root: str) -> None:
    """Serve ``root`` as a placeholder where SGLang is installed and the real package is absent (idempotent)."""
    if not _found("sglang.srt") or _found(root):
        return
    if not any(isinstance(f, _StubFinder) and root in f.roots for f in sys.meta_path):
        sys.meta_path.append(_StubFinder((root,)))


def install() -> None:
    """Register the torchvision placeholder (module doc)."""
    _stub("torchvision")


def install_cpu_engine() -> None:
    """``install()``, the sgl_kernel placeholder and the attention backend's fill value (module doc)."""
    install()
    _stub("sgl_kernel")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: CPU_GRAPH_SEQ_LEN_FILL


CPU_GRAPH_SEQ_LEN_FILL = 1   # what SGLang's IntelAMXAttnBackend.get_cpu_graph_seq_len_fill_value returns
