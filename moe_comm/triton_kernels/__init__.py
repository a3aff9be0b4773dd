"""Device code, one op per file (kernels, then launchers); ``sync`` holds the shared signalling.

Under TRITON_INTERPRET=1 (CPU) Triton's interpreter holds scalars as one-element arrays and turns them
into loop bounds with ``int(array)``, which NumPy >= 2.4 refuses for arrays of ndim > 0; loops whose
bounds are device values (row counts) need it, so take the single element explicitly.
"""

import os

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    from triton.runtime import interpreter as _interp

    if not getattr(_interp, "_moe_comm_index_fix", False):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._moe_comm_index_fix = True
