"""The fp8 dispatch formats (``moe_comm.fp8``: float32 amax / 448 scales, power-of-two float32, packed UE8M0)
and pre-quantized prefill input, end to end, against ``moe_comm.reference``.

Where the formats run elsewhere: tests/ep_cases.py and tests/prefill_cases.py hold a config of each
format, so the EPBuffer and PrefillBuffer matrices (test_ep, test_prefill: shm and loopback worlds 1-4,
EP shm world 3 under ``make test-long``), the emulated nodes (test_emulated_nodes: EPBuffer and the DeepEP
door across nodes, every cross-node byte on the emulated wire) and the put transport (test_put_transport)
check them bit for bit. Here: the EPBuffer formats on shm world 3; pre-quantized PrefillBuffer input
(codes and scales no quantizer produces, so a dequantize/requantize on the way would show) on
loopback worlds 1-3 and shm world 3, row-major and column-major scales; and every bad combination,
refused before anything is sent with the fix named, then an exact call on every rank.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import EPBuffer, PrefillBuffer, fp8, reference

from ep_cases import FORMAT_CONFIGS, Config, make_inputs, run_shm_cases
from prefill_cases import check_dispatch, make_buffer, partial_rows, poison, round_trip
from shm_files import own_shm_files

H = 512   # one UE8M0 word per row: the smallest hidden every format takes


@pytest.mark.timeout(300)
def test_ep_formats_shm_world3():
    errs = moe_comm.launch(run_shm_cases, 3, FORMAT_CONFIGS, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


# ---- pre-quantized PrefillBuffer input ------------------------------------------------------------

def prequantized(xs, fmt: str, seed: int, column_major: bool = False):
    """Per rank (codes, scales) of format ``fmt`` that no quantizer makes from any x: random finite codes
    (NaN bytes replaced) and random scales (float32 of 1e-6..1e6; UE8M0 bytes for 2**-27..2**27), so only a
    byte copy delivers them. ``column_major``: scales with stride 1 along the tokens (SGLang's layout)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for x in xs:
        T = x.shape[0]
        codes = torch.randint(0, 256, (T, H), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x11                     # e4m3fn NaN codes are not data
        cols = fp8.scale_columns(fmt, H)
        if fmt == fp8.E4M3_UE8M0:
            scales = reference.pack_ue8m0(torch.randint(100, 155, (T, 4 * cols), generator=g))   # 2**-27..2**27
        else:
            scales = torch.randn(T, cols, generator=g) * 10.0 ** torch.randint(-6, 6, (T, cols), generator=g)
        if column_major:
            scales = scales.t().contiguous().t()
        out.append((codes.view(torch.float8_e4m3fn), scales))
    return out


def _prequant_round(bufs, cfg, seed, column_major=False):
    """One checked dispatch -> combine of pre-quantized tokens on a loopback world, phase by phase."""
    xs, idxs, ws = make_inputs(cfg, len(bufs), "random", seed)
    return round_trip(bufs, cfg, prequantized(xs, cfg.fp8, seed, column_major), idxs, ws, f"seed{seed}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E4M3_UE8M0])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_prequantized_prefill_loopback(world, fmt):
    """recv_x and recv_scales hold the given codes and scales bit for bit, row-major or column-major
    scales given; the combine of their dequantized rows is exact; T = 0 ranks included."""
    cfg = Config(3, H, 3, 2, fp8=fmt)
    bufs = [make_buffer(g, cfg) for g in moe_comm.init(backend="loopback", world_size=world, device="cpu")]
    assert _prequant_round(bufs, cfg, 11 * world) == []
    assert _prequant_round(bufs, cfg, 11 * world + 1, column_major=True) == []


def _prequant_shm(group):
    errs = []
    for fmt in (fp8.E4M3_POW2, fp8.E4M3_UE8M0):
        cfg = Config(2, H, 3, 3, fp8=fmt)
        buf = make_buffer(group, cfg)
        world, rank = group.world_size, group.rank
        for seed in (5, 6):
            xs, idxs, ws = make_inputs(cfg, world, "random", seed)
            pre = prequantized(xs, fmt, seed, column_major=seed % 2 == 0)
            exp_d = reference.prefill_dispatch(pre, idxs, ws, cfg.experts_per_rank * world, cfg.max_tokens)
            group.barrier()   # every rank's previous combine has read this zone: it may be poisoned
            poison(buf)
            group.barrier()   # peers write this zone as soon as the dispatch starts: poisoned first
            d = buf.dispatch(pre[rank], idxs[rank], ws[rank])
            errs += check_dispatch(d, exp_d[rank], cfg, f"shm rank{rank} {fmt} seed{seed}")
            parts = [partial_rows(e["x"], e["scales"], r, cfg.dtype) for r, e in enumerate(exp_d)]
            want = reference.prefill_combine(parts, idxs, cfg.experts_per_rank * world, cfg.max_tokens)[rank]
            eo = partial_rows(d.recv_x, d.recv_scales, rank, cfg.dtype)
            if not torch.equal(buf.combine(eo, d.handle), want):
                errs.append(f"shm rank{rank} {fmt} seed{seed}: combine differs")
        buf.close()
    return errs


@pytest.mark.timeout(300)
def test_prequantized_prefill_shm_world3():
    errs = moe_comm.launch(_prequant_shm, 3, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []


# ---- bad combinations: refused before anything is sent, the fix named; then exact ------------------

@pytest.mark.parametrize("cls", [EPBuffer, PrefillBuffer])
def test_bad_formats_are_refused_at_construction(cls):
    (g,) = moe_comm.init(backend="loopback", device="cpu")
    with pytest.raises(ValueError, match=r"hidden % 512 == 0.*got hidden=256: pad hidden to 512, or use "
                                         r"fp8_dispatch='e4m3' or 'e4m3-pow2'"):
        cls(g, 4, 256, 2, 2, fp8_dispatch="e4m3-ue8m0")
    with pytest.raises(ValueError, match=r"hidden % 128 == 0.*dispatch bf16"):
        cls(g, 4, 192, 2, 2, fp8_dispatch="e4m3-pow2")
    with pytest.raises(ValueError, match=r"fp8_dispatch='ue8m0' is not a dispatch format: use one of False, True"):
        cls(g, 4, 512, 2, 2, fp8_dispatch="ue8m0")
    assert cls(g, 4, 512, 2, 2, fp8_dispatch=True).fp8_dispatch == "e4m3"
    assert cls(g, 4, 512, 2, 2).fp8_dispatch is False


def test_bad_prequantized_input_raises_on_every_rank_before_any_send_then_exact():
    """Every rank passes the same bad pre-quantized x (scales of another format, codes not fp8, a 3-tuple,
    a buffer without fp8, an EPBuffer): each raises before sending (naming the fix), nobody waits, and the
    next call is exact on every rank."""
    world, cfg = 2, Config(3, H, 3, 2, fp8=fp8.E4M3_UE8M0)
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0)
    bufs = [make_buffer(g, cfg) for g in groups]
    xs, idxs, ws = make_inputs(cfg, world, "random", 3)
    good = prequantized(xs, fp8.E4M3_UE8M0, 3)
    bf16 = [make_buffer(g, Config(3, H, 3, 2)) for g in groups]
    bad = [  # (buffers, every rank's x, error, what it says)
        (bufs, prequantized(xs, fp8.E4M3, 3), ValueError,
         r"x\[1\] \(the scales\) is torch.float32 .* takes torch.int32 .*fp8_dispatch='e4m3' for these scales"),
        (bufs, [(q.float(), s) for q, s in good], TypeError, r"x\[0\] \(the fp8 codes\) has dtype torch.float32"),
        (bufs, [(q, s, s) for q, s in good], ValueError, "a tuple of 3"),
        (bf16, good, TypeError, r"fp8_dispatch=False\): build it with fp8_dispatch='e4m3'")]
    for targets, inputs, kind, match in bad:
        for b, p, i, w in zip(targets, inputs, idxs, ws):
            with pytest.raises(kind, match=match):
                b.dispatch(p, i, w, phase="send")
    eps = [EPBuffer(g, 3 * world, H, 3, 2, fp8_dispatch=fp8.E4M3_UE8M0) for g in groups]
    for ep, p, i in zip(eps, good, idxs):
        with pytest.raises(TypeError, match="pre-quantized tokens with moe_comm.PrefillBuffer"):
            ep.dispatch(p, i, phase="send")
    for g in groups:
        g.check()
    assert _prequant_round(bufs, cfg, 4) == []
