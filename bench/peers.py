"""What moe-comm's ops are compared with, at world 1 (EP=1) on one GPU.

- ``torch_permute`` / ``torch_unpermute``: a pure-torch MoE dispatch and combine (sort the (token, k)
  slots by expert, gather the rows; weighted scatter-add back), what a model does without moe-comm.
- ``nccl_alltoallv``: torch.distributed ``all_to_all_single`` with splits read on the host (the counts
  are exchanged on the device, then ``.tolist()``: a device sync per call, and no CUDA graph).
- ``SymmMemAllToAllv``: ``torch.ops.symm_mem.all_to_all_vdev`` (NVSHMEM, splits stay on the device), if
  the installed torch has it. Its argument list changed across versions; both are handled.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from moe_comm.reference import quantize_fp8


# ---- pure torch --------------------------------------------------------------------------------

def random_topk(tokens: int, num_experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, topk] int64 distinct expert ids per token (uniform routing)."""
    scores = torch.rand(tokens, num_experts, generator=gen)
    return scores.topk(topk, dim=1).indices


def torch_permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, fp8: bool = False):
    """Pure-torch dispatch at EP=1: rows [T*K, H] sorted by expert (stable: by (token, k) within an
    expert), per-expert counts [E], and the source token of every row [T*K]. No host sync."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // topk_idx.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    if fp8:
        q, scale = quantize_fp8(x)
        rows = q.view(torch.uint8).index_select(0, token).view(torch.float8_e4m3fn)
        return rows, scale.index_select(0, token), counts, order
    return x.index_select(0, token), None, counts, order


def torch_unpermute(rows: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Pure-torch combine at EP=1: y[t] = sum_k w[t, k] * rows[slot (t, k)], float32 accumulation.
    rows [T*K, H] in the order of ``torch_permute``; returns [T, H] in rows' dtype."""
    T, K = topk_weights.shape
    w = topk_weights.reshape(-1).index_select(0, order).float()
    y = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    y.index_add_(0, order // K, rows.float() * w[:, None])
    return y.to(rows.dtype)


# ---- torch.distributed at world 1 ----------------------------------------------------------------

def init_world1(device: torch.device) -> None:
    """A one-rank default process group in this process (NCCL on a GPU, gloo on a CPU)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = dict(device_id=device) if device.type == "cuda" else {}
    from moe_comm.group import init_process_group  # noqa: PLC0415  (one that destroy_process_group ends)
    init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                       timeout=datetime.timedelta(seconds=60), **kw)


def nccl_alltoallv(send: torch.Tensor, out: torch.Tensor, send_counts: torch.Tensor,
                   recv_counts: torch.Tensor) -> torch.Tensor:
    """all_to_all_single with host-read splits. send [N, H]; send_counts int64 [world] on the device;
    recv_counts int64 [world] (scratch, filled here). Returns the received rows, out[:sum(recv)]."""
    dist.all_to_all_single(recv_counts, send_counts)
    in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()  # the device sync NCCL needs
    dst = out[:sum(out_splits)]
    dist.all_to_all_single(dst, send[:sum(in_splits)], out_splits, in_splits)
    return dst


# ---- torch symmetric memory ----------------------------------------------------------------------

def has_all_to_all_vdev() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401, PLC0415  (registers the ops)
        return hasattr(torch.ops.symm_mem, "all_to_all_vdev")
    except (ImportError, RuntimeError, AttributeError):
        return False


class SymmMemAllToAllv:
    """torch.ops.symm_mem.all_to_all_vdev on symmetric buffers [max_rows, H] (world 1 group).

    Splits count rows along dim 0. Newer torch: (input, out, in_splits [W], out_splits_offsets [2, W],
    group_name); older: (input, out, in_out_splits [3, W], group_name).
    """

    def __init__(self, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415
        if hasattr(symm_mem, "set_backend"):
            try:
                symm_mem.set_backend("NVSHMEM")
            except RuntimeError:
                pass  # already chosen (it can be set once, before the first allocation)
        self.group_name = dist.group.WORLD.group_name
        world = dist.get_world_size()
        self.input = symm_mem.empty(max_rows, hidden, dtype=dtype, device=device)
        self.out = symm_mem.empty(max_rows * world, hidden, dtype=dtype, device=device)
        schema = torch.ops.symm_mem.all_to_all_vdev.default._schema
        self.five_args = len(schema.arguments) == 5
        if self.five_args:
            self.splits = symm_mem.empty(world, dtype=torch.int64, device=device)
            self.out_splits_offsets = symm_mem.empty(2, world, dtype=torch.int64, device=device)
            tensors = (self.input, self.out, self.splits, self.out_splits_offsets)
        else:
            self.splits = symm_mem.empty(3, world, dtype=torch.int64, device=device)
            tensors = (self.input, self.out, self.splits)
        for t in tensors:
            symm_mem.rendezvous(t, self.group_name)

    def set_counts(self, counts: torch.Tensor) -> None:
        (self.splits if self.five_args else self.splits[0]).copy_(counts)

    def __call__(self) -> None:
        if self.five_args:
            torch.ops.symm_mem.all_to_all_vdev(self.input, self.out, self.splits, self.out_splits_offsets,
                                               self.group_name)
        else:
            torch.ops.symm_mem.all_to_all_vdev(self.input, self.out, self.splits, self.group_name)

    def recv_counts(self) -> torch.Tensor:
        return self.out_splits_offsets[0] if self.five_args else self.splits[1]
