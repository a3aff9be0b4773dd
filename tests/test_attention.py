"""The Triton decode attention (``serving/attention.py``) against the torch attention that gathers whole
cache rows (``model.attend_gather``), in Triton's interpreter: several cache blocks per token, a head size
that is not a power of two, tokens at position 0, at the last position and past it, repeated slots."""

import pytest
import torch

from moe_comm.serving.attention import attend_triton
from moe_comm.serving.model import attend_gather


def _case(dtype, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    slots_n, max_seq, heads = 4, 70, 3  # 70 positions: three 32-position blocks
    k = torch.randn(slots_n, max_seq, heads, head_dim, generator=g).to(dtype)
    v = torch.randn(slots_n, max_seq, heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([2, 0, 3, 2, 1, 0])
    positions = torch.tensor([0, 69, 64, 5, 63, 1000])  # 1000: past the cache, sees the whole row
    q = torch.randn(len(slots), heads, head_dim, generator=g).to(dtype)
    return q, k, v, slots, positions


@pytest.mark.parametrize("head_dim", [16, 24])
def test_matches_gather_attention_float32(head_dim):
    q, k, v, slots, positions = _case(torch.float32, head_dim, head_dim)
    got = attend_triton(q, k, v, slots, positions)
    want = attend_gather(q, k, v, slots, positions)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_matches_gather_attention_bfloat16():
    """bf16: the torch version rounds its scores and probabilities to bf16 on the way, the kernel keeps
    float32 until the output; both against the float32 result of the same bf16 inputs."""
    q, k, v, slots, positions = _case(torch.bfloat16, 16, 3)
    exact = attend_gather(q.float(), k.float(), v.float(), slots, positions)
    got = attend_triton(q, k, v, slots, positions)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)  # output rounding only
    torch.testing.assert_close(attend_gather(q, k, v, slots, positions).float(), exact, rtol=5e-2, atol=5e-2)


def test_reads_nothing_past_a_token_position_and_no_other_slot():
    """NaN everywhere a token may not look: its later positions and every other slot."""
    q, k, v, slots, positions = _case(torch.float32, 16, 5)
    slots, positions, q = slots[:5], positions[:5], q[:5]
    k2, v2 = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for s, p in zip(slots.tolist(), positions.tolist()):
        k2[s, :p + 1], v2[s, :p + 1] = k[s, :p + 1], v[s, :p + 1]
    for t in range(5):  # token by token: tokens of one slot see different lengths
        one = slice(t, t + 1)
        got = attend_triton(q[one], k2, v2, slots[one], positions[one])
        torch.testing.assert_close(got, attend_gather(q[one], k, v, slots[one], positions[one]), rtol=1e-5, atol=1e-5)


def test_no_tokens_and_bad_shapes():
    q, k, v, slots, positions = _case(torch.float32, 16, 1)
    assert attend_triton(q[:0], k, v, slots[:0], positions[:0]).shape == (0, 3, 16)
    with pytest.raises(ValueError, match="attend_triton"):
        attend_triton(q, k, v[:, :, :2], slots, positions)


def test_large_scores_stay_finite():
    """Scores in the thousands: the running maximum must carry across cache blocks (rescaling by a
    block's own maximum alone overflows exp when a later block's scores are much smaller)."""
    q, k, v, slots, positions = _case(torch.float32, 16, 7)
    k[:, 32:] *= 0.01  # the later blocks' scores far below the first's
    q = q * 300
    got = attend_triton(q, k, v, slots, positions)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attend_gather(q, k, v, slots, positions), rtol=1e-4, atol=1e-4)


def test_reference_model_rounds_where_each_attention_does():
    """bf16 prefill of one sequence: the reference model built for an attention kernel rounds its scores
    and probabilities where that kernel does (``ATTENTION_IN_FLOAT32``), so it matches it bit for bit
    here; built for the other kernel it differs in most elements. That rounding, not a bug, is what can
    flip a near-tie routing choice in the decode benchmark's bf16 check."""
    from moe_comm.serving.configs import model_config  # noqa: PLC0415
    from moe_comm.serving.model import cached_attention  # noqa: PLC0415
    from moe_comm.serving.reference_model import ReferenceModel  # noqa: PLC0415
    from moe_comm.serving.weights import build_weights  # noqa: PLC0415

    cfg = model_config("deepseek-v3", "cpu", dtype=torch.bfloat16)
    weights = build_weights(cfg)
    lw, S = weights.layers[0], 40
    h = torch.randn(S, cfg.hidden, generator=torch.Generator().manual_seed(0)).to(cfg.dtype)
    refs = {impl: ReferenceModel(weights, impl)._attention(lw, h).float() for impl in ("torch", "triton")}
    served = {}
    for impl in ("torch", "triton", None):  # None: the device's default, the torch attention on the CPU
        cache = torch.zeros(2, cfg.max_seq, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype)
        served[impl] = cached_attention(lw, h, cache, cache.clone(), torch.zeros(S, dtype=torch.int64),
                                        torch.arange(S), cfg.num_heads, cfg.head_dim, impl).float()
    for impl, other in [("torch", "triton"), ("triton", "torch")]:
        assert (served[impl] != refs[impl]).float().mean() < 0.01, impl
        assert (served[impl] != refs[other]).float().mean() > 0.3, impl
    assert torch.equal(served[None], served["torch"])
