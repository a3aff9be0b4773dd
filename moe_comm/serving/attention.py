"""Attention of new tokens against the KV cache, reading only the positions each token can see.

``model.attend_gather`` (the torch version, the default) gathers every token's whole cache row,
[max_seq, heads, head_dim] for K and for V, and masks the positions past the token's own: its bytes
grow with ``max_seq`` whatever the sequence lengths are (14.7 MB per token at DeepSeek-V3's 56 heads
and 512 positions). ``attend_triton`` below reads K and V only up to each token's position, the way
serving engines' decode attention does, with an online softmax in float32 (one pass over the cache).
Capturable: the positions are read on the device.

Grid = (tokens, heads): program (t, h) reads q[t, h] and positions 0..positions[t] of cache slot
slots[t], head h, BLOCK_S positions per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpreter import kernel_for
from ..triton_kernels.quant import cast_rne

# Positions per step: [32, head_dim] float32 tiles of K and V keep a program near 128 registers (64
# positions took 233), so more programs share an SM to keep loads in flight.
BLOCK_S = 32


@triton.jit
def decode_attention_kernel(
    q_ptr,        # [T, HEADS, HEAD_DIM] queries
    k_ptr,        # [num_slots, max_seq, HEADS, HEAD_DIM] this layer's key cache (written before the launch)
    v_ptr,        # same shape: value cache
    out_ptr,      # out [T, HEADS, HEAD_DIM] in q's dtype
    slots_ptr,    # int64 [T]: cache slot of token t
    positions_ptr,  # int64 [T]: position of token t; it sees positions 0..positions[t] of its slot
    s_qt, s_qh, s_ks, s_kp, s_kh, s_ot, s_oh, max_seq, scale,
    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D_P2)
    d_live = d < HEAD_DIM
    q = tl.load(q_ptr + t * s_qt + h * s_qh + d, mask=d_live, other=0.0).to(tl.float32) * scale
    slot = tl.load(slots_ptr + t)
    # Never past the cache, even for a position that lies (out of range positions see the whole row).
    seen = tl.minimum(tl.load(positions_ptr + t), max_seq - 1) + 1
    base = slot * s_ks + h * s_kh
    s = tl.arange(0, BLOCK_S)
    m = tl.full([], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([], dtype=tl.float32)          # running sum of exp(score - m)
    acc = tl.zeros([D_P2], dtype=tl.float32)    # running sum of exp(score - m) * v
    for p0 in range(0, seen, BLOCK_S):
        p_live = p0 + s < seen
        off = base + (p0 + s)[:, None].to(tl.int64) * s_kp + d[None, :]
        live = p_live[:, None] & d_live[None, :]
        k = tl.load(k_ptr + off, mask=live, other=0.0).to(tl.float32)
        scores = tl.where(p_live, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        w = tl.exp(scores - m_new)
        v = tl.load(v_ptr + off, mask=live, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(w[:, None] * v, axis=0)
        l = l * alpha + tl.sum(w, axis=0)
        m = m_new
    tl.store(out_ptr + t * s_ot + h * s_oh + d, cast_rne(acc / l, out_ptr.dtype.element_ty), mask=d_live)


def attend_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """q [T, heads, head_dim]; k_cache/v_cache [num_slots, max_seq, heads, head_dim] (same strides, last dim
    contiguous); slots/positions int64 [T] on the device -> [T, heads, head_dim] in q's dtype:
    softmax(q . k[0..pos] / sqrt(head_dim)) . v[0..pos] per token and head, in float32."""
    T, heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != (
            heads, head_dim) or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"attend_triton: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} with strides {k_cache.stride()} / {v_cache.stride()}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    kernel_for(decode_attention_kernel, q.device)[(T, heads)](
        q, k_cache, v_cache, out, slots, positions, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), k_cache.shape[1], head_dim ** -0.5,
        HEAD_DIM=head_dim, D_P2=triton.next_power_of_2(head_dim), BLOCK_S=BLOCK_S)
    return out


def _compile_configs() -> list[dict]:
    """DeepSeek-V3-shaped decode attention (56 heads of 128) in bf16: what ``compile_report`` compiles."""
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", slots_ptr="*i64",
                 positions_ptr="*i64", s_qt="i32", s_qh="i32", s_ks="i64", s_kp="i64", s_kh="i64", s_ot="i32",
                 s_oh="i32", max_seq="i32", scale="fp32")
    return [dict(kernel="decode_attention_kernel", label="bf16 head_dim 128", types=types,
                 constexprs=dict(HEAD_DIM=128, D_P2=128, BLOCK_S=BLOCK_S))]


COMPILE_CONFIGS = _compile_configs()
