"""The low-precision formats compiled on a GPU (docs/formats.md): nvfp4 dispatch bit for bit against
``reference.quantize_nvfp4`` (EPBuffer at world 1 and on a loopback world of 4, PrefillBuffer on a loopback
world of 4), the fp8 combine against ``reference.combine(..., fp8=True)`` (within the float32 sum's fused
multiply-adds, as the bf16 combine's GPU test) and, at world 1 and world 4, the same bits for the same
tokens (every row enters the sum through the same quantize-dequantize, in place or from a peer); a MoE
layer through ``prefill_moe`` + ``local_experts`` in every fp8 scale format and nvfp4. The inputs, the
format references (quantize, dequantize, the UE8M0 packing, the global scale) and the stand-in expert
stage all run on the device: none of them is moved to the CPU first (issue 46: the UE8M0 packing built
its shifts on the CPU and raised on CUDA inputs, which no test here saw). Only the op references
(``reference.dispatch`` / ``combine``, host loops) and the comparisons read results back. Skipped
without CUDA (conftest)."""

import pytest
import torch

import moe_comm
from moe_comm import reference

pytestmark = pytest.mark.gpu
DEV = "cuda:0"
H, K, L, M = 2048, 8, 8, 9   # hidden (16 nvfp4 column blocks, 16 fp8 groups), top-8, experts per rank, tokens


def _inputs(world, seed):
    """Per rank: x [T, H] bf16, topk_idx [T, K] (-1 slots), topk_weights [T, K] float32, on the device."""
    g = torch.Generator().manual_seed(seed)
    E = L * world
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = (M, 1, 0, 7)[r % 4]
        xs.append((torch.randn(t, H, generator=g) * 3).to(torch.bfloat16).to(DEV))
        idx = torch.rand(t, E, generator=g).topk(K, dim=1).indices
        idx[torch.rand(idx.shape, generator=g) < 0.125] = -1
        idxs.append(idx.to(DEV))
        ws.append(torch.rand(t, K, generator=g).to(DEV))
    return xs, idxs, ws


def _experts(x, scales, rank, gs):
    """Dequantize on the device (the stand-in expert stage), then global expert e's rows times (e + 1) / 4,
    in bf16."""
    x = reference.dequantize_nvfp4(x, scales, gs) if gs is not None else x.float()
    f = (torch.arange(x.shape[0], dtype=torch.float32, device=x.device) + rank * x.shape[0] + 1) / 4
    return (x * f.view(-1, 1, 1)).to(torch.bfloat16)


def _ep_round(world, xs, idxs, ws, gs):
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=30.0)
    eps = [moe_comm.EPBuffer(g, L * world, H, M, K, dispatch_format="nvfp4" if gs is not None else None,
                             combine_format="e4m3") for g in groups]
    phase = "both" if world == 1 else "send"
    out = [ep.dispatch(x, i, phase=phase, global_scale=gs) for ep, x, i in zip(eps, xs, idxs)]
    ds = out if world == 1 else [ep.dispatch(phase="recv") for ep in eps]
    eos = [_experts(d.x, d.scales, r, gs) for r, d in enumerate(ds)]
    got = [dict(x=d.x.cpu(), scales=None if d.scales is None else d.scales.cpu(), counts=d.counts.cpu()) for d in ds]
    out = [ep.combine(eo, w, d.handle, phase=phase) for ep, eo, w, d in zip(eps, eos, ws, ds)]
    ys = out if world == 1 else [ep.combine(phase="recv") for ep in eps]
    for g in groups:
        g.check()
    return got, [y.cpu() for y in ys], [eo.cpu() for eo in eos]


def _cpu(ts):
    return [t.cpu() for t in ts]


@pytest.mark.parametrize("world", [1, 4])
def test_ep_nvfp4_dispatch_bit_exact_and_fp8_combine_compiled(world):
    xs, idxs, ws = _inputs(world, 10 + world)
    gs = reference.nvfp4_global_scale(torch.cat(xs))
    assert gs.device == xs[0].device
    got, ys, eos = _ep_round(world, xs, idxs, ws, gs)
    xs, idxs, ws = _cpu(xs), _cpu(idxs), _cpu(ws)   # the op references loop on the host
    exp = reference.dispatch(xs, idxs, L * world, M, nvfp4_scale=gs)
    for r in range(world):
        assert torch.equal(got[r]["counts"], exp[r]["counts"]), r
        for e, n in enumerate(exp[r]["counts"].tolist()):
            assert torch.equal(got[r]["x"][e, :n], exp[r]["x"][e, :n]), (r, e)
            assert torch.equal(got[r]["scales"][e, :n].view(torch.uint8), exp[r]["scales"][e, :n].view(torch.uint8))
    want = reference.combine(eos, ws, idxs, L * world, M, fp8=True)
    plain = reference.combine(eos, ws, idxs, L * world, M)
    for r in range(world):
        torch.testing.assert_close(ys[r].float(), want[r].float(), rtol=1e-2, atol=1e-2)
        if ys[r].numel():   # and it is the fp8 path: bf16 rows would be much closer to the exact sum
            assert (ys[r].float() - want[r].float()).abs().max() < (plain[r].float() - want[r].float()).abs().max()


def test_fp8_combine_gives_the_same_bits_at_world_1_and_4():
    """Rank 0 of a world of 4 and a world of 1 combine the same tokens with the same expert rows (world 1
    holds all 32 experts): the same bits, though at world 4 most rows come from peers."""
    xs, idxs, ws = _inputs(4, 21)
    E = L * 4
    groups = moe_comm.init(backend="loopback", world_size=1, device=DEV, timeout_s=30.0)
    ep1 = moe_comm.EPBuffer(groups[0], E, H, 4 * M, K, combine_format="e4m3")
    d1 = ep1.dispatch(xs[0], idxs[0])
    f = (torch.arange(E, dtype=torch.float32, device=DEV) + 1) / 4
    y1 = ep1.combine((d1.x.float() * f.view(-1, 1, 1)).to(torch.bfloat16), ws[0], d1.handle).cpu()
    _, ys, _ = _ep_round(4, xs, idxs, ws, None)
    assert torch.equal(y1, ys[0])


def test_prefill_nvfp4_dispatch_bit_exact_and_fp8_combine_compiled():
    world = 4
    xs, idxs, ws = _inputs(world, 31)
    gs = reference.nvfp4_global_scale(torch.cat(xs))
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=30.0)
    bufs = [moe_comm.PrefillBuffer(g, L * world, H, M, K, dispatch_format="nvfp4", combine_format="e4m3")
            for g in groups]
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        b.dispatch(x, i, w, phase="send", global_scale=gs)
    ds = [b.dispatch(phase="recv") for b in bufs]
    exp = reference.prefill_dispatch(_cpu(xs), _cpu(idxs), _cpu(ws), L * world, M, nvfp4_scale=gs)
    parts = []
    for r, (d, e) in enumerate(zip(ds, exp)):
        v = e["valid"]
        assert torch.equal(d.recv_x.cpu()[v], e["x"][v]) and torch.equal(
            d.recv_scales.cpu()[v].view(torch.uint8), e["scales"][v].view(torch.uint8)), r
        # the expert stage on the device, from what was received (rows not valid are zeros in the reference)
        x = torch.where(v.to(DEV)[:, None], reference.dequantize_nvfp4(d.recv_x, d.recv_scales, gs), 0.0)
        parts.append((x * (1 + r)).to(torch.bfloat16))
    for b, p, d in zip(bufs, parts, ds):
        b.combine(p, d.handle, phase="send")
    ys = [b.combine(phase="recv").cpu() for b in bufs]
    want = reference.prefill_combine(_cpu(parts), _cpu(idxs), L * world, M, fp8=True)
    for r in range(world):
        torch.testing.assert_close(ys[r].float(), want[r].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-pow2", "e4m3-ue8m0", "nvfp4"])
def test_prefill_moe_with_local_experts_on_the_device(fmt):
    """A MoE layer through prefill_moe + local_experts (the library's stand-in expert stage, which
    dequantizes with ``reference.dequantize_fp8`` / ``dequantize_nvfp4`` on the rows' device) at world 1,
    every dispatch format, bf16 combine: y is the expert sum of the dequantized rows, computed on the
    device from the format references, bit for bit (each row's ops are the same elementwise ops in the
    same order on both sides). Before issue 46's fix "e4m3-ue8m0" raised a device mismatch here."""
    from moe_comm.prefill_chunks import local_experts, num_chunks, prefill_moe  # noqa: PLC0415
    g = torch.Generator().manual_seed(46)
    E, HID, KK, T = 4, 512, 3, 11
    buf = moe_comm.PrefillBuffer(moe_comm.init(backend="loopback", device=DEV)[0], E, HID, 5, KK, zones=2,
                                 dispatch_format=fmt)
    x = (torch.randn(T, HID, generator=g) * 3).to(torch.bfloat16).to(DEV)
    idx = torch.randint(0, E, (T, KK), generator=g)
    idx[3, 1], idx[7] = -1, -1
    idx, w = idx.to(DEV), torch.rand(T, KK, generator=g).to(DEV)
    scale = (torch.rand(E, generator=g) + 0.5).to(DEV)
    gs = reference.nvfp4_global_scale(x) if fmt == "nvfp4" else None

    def expert(e, rows):
        return (rows.float() * scale[e] + 0.3 * e).to(torch.bfloat16)

    y = prefill_moe(buf, x, idx, w, local_experts(buf, expert), num_chunks(T, buf), global_scale=gs)
    if fmt == "nvfp4":
        xin = reference.dequantize_nvfp4(*reference.quantize_nvfp4(x, gs), gs).to(torch.bfloat16)
    else:
        xin = reference.dequantize_fp8(*reference.quantize_fp8(x, fmt=fmt)).to(torch.bfloat16)
    want = torch.zeros(T, HID, device=DEV)
    for k in range(KK):
        for t in range(T):
            if idx[t, k] >= 0:
                want[t] += w[t, k] * expert(int(idx[t, k]), xin[t:t + 1])[0].float()
    assert y.device == x.device and torch.equal(y, want.to(torch.bfloat16)), fmt
    buf.close()


def test_nvfp4_global_scales_that_differ_raise_compiled():
    """The compiled receive checks every source's global scale (issue 46): loopback world 2, rank 1's x 100
    times rank 0's, every token to expert 0, each rank's scale from its own x: both ranks raise
    GlobalScaleError naming the other; the next call, with one scale, is bit for bit the reference."""
    m = M
    groups = moe_comm.init(backend="loopback", world_size=2, device=DEV, timeout_s=30.0)
    eps = [moe_comm.EPBuffer(g, 2 * L, H, m, 1, dispatch_format="nvfp4") for g in groups]
    g = torch.Generator().manual_seed(46)
    xs = [(torch.randn(m, H, generator=g) * f).to(torch.bfloat16).to(DEV) for f in (1.0, 100.0)]
    idx = torch.zeros(m, 1, dtype=torch.int64, device=DEV)
    ones = torch.ones(m, 1, device=DEV)
    for scales, bad in (([reference.nvfp4_global_scale(x) for x in xs], True),
                        ([reference.nvfp4_global_scale(torch.cat(xs))] * 2, False)):
        for ep, x, gs in zip(eps, xs, scales):
            ep.dispatch(x, idx, phase="send", global_scale=gs)
        ds = []
        for r, ep in enumerate(eps):
            if bad:
                with pytest.raises(moe_comm.GlobalScaleError, match=f"rank {1 - r} quantized") as info:
                    ep.dispatch(phase="recv")
                ds.append(info.value.result)
            else:
                ds.append(ep.dispatch(phase="recv"))
        if not bad:   # expert 0 is rank 0's: its rows from both sources, each the source's quantization
            for s in range(2):
                want = reference.quantize_nvfp4(xs[s], scales[0])
                assert torch.equal(ds[0].x[0, s * m:(s + 1) * m], want[0]) and torch.equal(
                    ds[0].scales[0, s * m:(s + 1) * m].view(torch.uint8), want[1].view(torch.uint8)), s
        for ep, d in zip(eps, ds):
            ep.combine(torch.zeros(*d.x.shape[:2], H, dtype=torch.bfloat16, device=DEV), ones, d.handle, phase="send")
        for ep in eps:
            ep.combine(phase="recv")
    for gr in groups:
        gr.check()
