"""What ``moe_comm.launch``'s fork server imports once (``group.FORKSERVER_PRELOAD``), so that every rank
process forked from it starts with it instead of paying for it: moe_comm itself and the interpreted twins
of its kernel modules (``interpreter.py``), their bodies already rewritten for Triton's interpreter. On a
2-core machine that is about 0.6 s of CPU per rank process (0.3 s importing moe_comm, whose ``@triton.jit``
decorators read their sources; 0.3 s loading and rewriting the twins at the first CPU launch).

Importing this module is its whole job: nothing else imports it. It loads code, no state: no group, heap,
thread, CUDA context or file. What an import decides from the environment (Triton's ``@jit`` chooses
interpreted or compiled by TRITON_INTERPRET) is the server's; a rank launched under other TRITON_*
variables imports moe_comm again (``group._rank_main``).
"""

import importlib
import pkgutil
import sys

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import moe_comm.serving  # noqa: F401  (the package, every module it imports, the serving models' kernels)
import moe_comm.triton_kernels

from .interpreter import TWIN_ROOT, twin_module

for _info in pkgutil.iter_modules(moe_comm.triton_kernels.__path__, "moe_comm.triton_kernels."):
    importlib.import_module(_info.name)


def _defines_kernels(name: str, module) -> bool:
    return any(isinstance(v, JITFunction) and v.fn.__module__ == name for v in vars(module).values())


for _name, _mod in list(sys.modules.items()):
    if _name.startswith("moe_comm.") and not _name.startswith(TWIN_ROOT) and _defines_kernels(_name, _mod):
        twin_module(_name)
for _name, _mod in list(sys.modules.items()):
    if _name.startswith(TWIN_ROOT + "."):
        for _fn in list(vars(_mod).values()):
            if isinstance(_fn, InterpretedFunction):
                _fn.rewrite()   # cached by Triton per function (InterpretedFunction.rewritten_fn)
