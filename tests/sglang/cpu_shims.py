"""Import-time stand-ins for the GPU-only packages that SGLang imports but the MoE dispatcher never uses.

SGLang 0.5.23 imports torchvision while loading its model configs (image preprocessing of vision models),
on every path to its MoE layers. PyPI's torchvision for Linux is built against CUDA torch and does not
load against the CPU torch of this test venv, so it is not installed; instead ``install()`` registers a
``torchvision`` placeholder whose every attribute is an object that raises if it is ever called. Nothing
in the tests calls it: a test that did would fail loudly, not pass silently.
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
    """Serves torchvision and all of its submodules as _StubModule."""

    ROOT = "torchvision"

    def find_spec(self, name, path=None, target=None):
        if name == self.ROOT or name.startswith(self.ROOT + "."):
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


def install() -> None:
    """Register the placeholder where SGLang is installed and the real torchvision is absent (idempotent)."""
    if not _found("sglang.srt") or _found("torchvision"):
        return
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
