"""The low-precision formats compiled on a GPU (docs/formats.md): nvfp4 dispatch bit for bit against
``reference.quantize_nvfp4`` (EPBuffer at world 1 and on a loopback world of 4, PrefillBuffer on a loopback
world of 4), the fp8 combine against ``reference.combine(..., fp8=True)`` (within the float32 sum's fused
multiply-adds, as the bf16 combine's GPU test) and, at world 1 and world 4, the same bits for the same
tokens (every row enters the sum through the same quantize-dequantize, in place or from a peer). Skipped
without CUDA (conftest)."""

import pytest
import torch

import moe_comm
from moe_comm import reference

pytestmark = pytest.mark.gpu
DEV = "cuda:0"
H, K, L, M = 2048, 8, 8, 9   # hidden (16 nvfp4 column blocks, 16 fp8 groups), top-8, experts per rank, tokens


def _inputs(world, seed):
    g = torch.Generator().manual_seed(seed)
    E = L * world
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = (M, 1, 0, 7)[r % 4]
        xs.append((torch.randn(t, H, generator=g) * 3).to(torch.bfloat16))
        idx = torch.rand(t, E, generator=g).topk(K, dim=1).indices
        idx[torch.rand(idx.shape, generator=g) < 0.125] = -1
        idxs.append(idx)
        ws.append(torch.rand(t, K, generator=g))
    return xs, idxs, ws


def _experts(d, rank, gs):
    """Dequantize (the stand-in expert stage), then global expert e's rows times (e + 1) / 4, in bf16."""
    x = reference.dequantize_nvfp4(d["x"], d["scales"], gs) if gs is not None else d["x"].float()
    f = (torch.arange(x.shape[0], dtype=torch.float32) + rank * x.shape[0] + 1) / 4
    return (x * f.view(-1, 1, 1)).to(torch.bfloat16)


def _ep_round(world, xs, idxs, ws, gs):
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=30.0)
    eps = [moe_comm.EPBuffer(g, L * world, H, M, K, dispatch_format="nvfp4" if gs is not None else None,
                             combine_format="e4m3") for g in groups]
    phase = "both" if world == 1 else "send"
    out = [ep.dispatch(x.to(DEV), i.to(DEV), phase=phase, global_scale=None if gs is None else gs.to(DEV))
           for ep, x, i in zip(eps, xs, idxs)]
    ds = out if world == 1 else [ep.dispatch(phase="recv") for ep in eps]
    got = [dict(x=d.x.cpu(), scales=None if d.scales is None else d.scales.cpu(), counts=d.counts.cpu()) for d in ds]
    eos = [_experts(dict(x=d["x"], scales=d["scales"]), r, gs).to(DEV) for r, d in enumerate(got)]
    out = [ep.combine(eo, w.to(DEV), d.handle, phase=phase) for ep, eo, w, d in zip(eps, eos, ws, ds)]
    ys = out if world == 1 else [ep.combine(phase="recv") for ep in eps]
    for g in groups:
        g.check()
    return got, [y.cpu() for y in ys], [eo.cpu() for eo in eos]


@pytest.mark.parametrize("world", [1, 4])
def test_ep_nvfp4_dispatch_bit_exact_and_fp8_combine_compiled(world):
    xs, idxs, ws = _inputs(world, 10 + world)
    gs = reference.nvfp4_global_scale(torch.cat(xs))
    got, ys, eos = _ep_round(world, xs, idxs, ws, gs)
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
    d1 = ep1.dispatch(xs[0].to(DEV), idxs[0].to(DEV))
    f = ((torch.arange(E, dtype=torch.float32) + 1) / 4).to(DEV)
    y1 = ep1.combine((d1.x.float() * f.view(-1, 1, 1)).to(torch.bfloat16), ws[0].to(DEV), d1.handle).cpu()
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
        b.dispatch(x.to(DEV), i.to(DEV), w.to(DEV), phase="send", global_scale=gs.to(DEV))
    ds = [b.dispatch(phase="recv") for b in bufs]
    exp = reference.prefill_dispatch(xs, idxs, ws, L * world, M, nvfp4_scale=gs)
    parts = []
    for r, (d, e) in enumerate(zip(ds, exp)):
        v = e["valid"]
        assert torch.equal(d.recv_x.cpu()[v], e["x"][v]) and torch.equal(
            d.recv_scales.cpu()[v].view(torch.uint8), e["scales"][v].view(torch.uint8)), r
        parts.append((reference.dequantize_nvfp4(e["x"], e["scales"], gs) * (1 + r)).to(torch.bfloat16))
    for b, p, d in zip(bufs, parts, ds):
        b.combine(p.to(DEV), d.handle, phase="send")
    ys = [b.combine(phase="recv").cpu() for b in bufs]
    want = reference.prefill_combine(parts, idxs, L * world, M, fp8=True)
    for r in range(world):
        torch.testing.assert_close(ys[r].float(), want[r].float(), rtol=1e-2, atol=1e-2)
