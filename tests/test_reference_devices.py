"""The references of the formats (``moe_comm.reference``: fp8 in every scale format with the UE8M0
packing, NVFP4, the global scale) compute on their input's device: every tensor they make follows it.
On a GPU a tensor they built on the CPU meets a CUDA tensor and raises (issue 46: ``pack_ue8m0`` /
``unpack_ue8m0`` built their shifts with ``torch.arange`` on the CPU, which broke ``prefill_moe`` and
``local_experts`` with "e4m3-ue8m0" and the ``quantize_fp8(..., fmt="e4m3-ue8m0")`` an error message
tells users to call). Here, without a GPU, the input is on the meta device (no data: a tensor of another
device fails the same way), and a dispatch mode records the device of every tensor each op makes, so a
CPU scalar that a CUDA op would tolerate is caught too. tests/gpu/test_gpu_formats.py runs the same
references on CUDA tensors."""

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from moe_comm import formats, reference

META = torch.device("meta")
H = 512   # a UE8M0 word's four 128-column groups


class _Devices(TorchDispatchMode):
    """Records (op, device) of every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(str(func), t.device) for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def _on_meta(fn, *args):
    """fn(*args) on meta tensors: its outputs, and every tensor made on another device (none expected)."""
    with _Devices() as mode:
        out = fn(*args)
    return out, [(op, d) for op, d in mode.made if d != META]


def _cases():
    x = torch.empty(3, H, dtype=torch.bfloat16, device=META)
    words = torch.empty(3, H // 512, dtype=torch.int32, device=META)
    gs = torch.empty(1, dtype=torch.float32, device=META)
    yield "pack_ue8m0", reference.pack_ue8m0, (torch.empty(3, H // 128, dtype=torch.int32, device=META),)
    yield "unpack_ue8m0", reference.unpack_ue8m0, (words,)
    for fmt in (formats.E4M3, formats.E4M3_POW2, formats.E4M3_UE8M0):
        yield f"quantize_fp8 {fmt}", lambda t, f=fmt: reference.quantize_fp8(t, fmt=f), (x,)
        yield f"dequantize_fp8 {fmt}", lambda t, f=fmt: reference.dequantize_fp8(*reference.quantize_fp8(t, fmt=f)), (x,)
    yield "fp8_round_trip", reference.fp8_round_trip, (x,)
    yield "nvfp4_global_scale", reference.nvfp4_global_scale, (x,)
    yield "nvfp4_global_scale of nothing", reference.nvfp4_global_scale, (x[:0],)
    yield "quantize_nvfp4", reference.quantize_nvfp4, (x, gs)
    yield "dequantize_nvfp4", lambda t, g: reference.dequantize_nvfp4(*reference.quantize_nvfp4(t, g), g), (x, gs)


@pytest.mark.parametrize("name, fn, args", [pytest.param(*c, id=c[0]) for c in _cases()])
def test_format_references_make_every_tensor_on_the_inputs_device(name, fn, args):
    out, elsewhere = _on_meta(fn, *args)
    assert not elsewhere, f"{name} made tensors off the input's device: {elsewhere}"
    assert all(t.device == META for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), name
