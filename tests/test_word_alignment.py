"""Rows that do not start on a word boundary are refused, on every rank, and lose nothing.

The kernels copy a caller's rows as 4-byte words (EPBuffer's dispatch and combine send, PrefillBuffer's
dispatch and combine send, AllToAllvDynamic's rows, which it copies in words of its plan's size): they take
the caller's tensor in its own dtype and reinterpret the pointer (``copy.as_words``). A bf16 view that
starts at an odd element is not on a word: on a GPU, word loads from it fault (misaligned address); so
the op refuses it before launching, naming the fix. Every rank is given such a tensor here (a symmetric
input error): every rank raises, nobody waits, and the next calls are exact against the references.

What the CPU cannot show: that the compiled kernels would fault on such an address (the interpreter reads
any address); the refusal is what this tests, and that aligned inputs still run exact.
"""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, EPBuffer

from ep_cases import offset_copy
from fault_cases import CAP_A2A, E_PER_RANK, H, K, M, ROW, check_rank, expert
from prefill_cases import CONFIGS, make_buffer, make_inputs, round_trip

OFF_WORD = 2   # bytes past a 16-byte boundary: one bf16 element, not a 4-byte word
REFUSED = r"starts 2 bytes past a 4-byte boundary .* pass {}\.clone\(\)"


def _inputs(world: int, seed: int):
    """(xs, idxs, ws, sends, counts) with every rank's T = M > 0 and at least one row to every peer (so that
    every rank has a tensor with an address to offset), bf16 rows for AllToAllvDynamic."""
    g = torch.Generator().manual_seed(seed)
    E = E_PER_RANK * world
    xs = [torch.randn(M, H, generator=g).to(torch.bfloat16) for _ in range(world)]
    idxs = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]) for _ in range(world)]
    ws = [torch.rand(M, K, generator=g) for _ in range(world)]
    counts = [torch.randint(1, CAP_A2A + 1, (world,), generator=g).to(torch.int32) for _ in range(world)]
    sends = [torch.randn(int(c.sum()), *ROW, generator=g).to(torch.bfloat16) for c in counts]
    return xs, idxs, ws, sends, counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_ep_and_alltoallv_refuse_rows_off_a_word_then_run_exact(world):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0)
    eps = [EPBuffer(g, E_PER_RANK * world, H, M, K) for g in groups]
    a2as = [AllToAllvDynamic(g, CAP_A2A, ROW, torch.bfloat16) for g in groups]
    xs, idxs, ws, sends, counts = inputs = _inputs(world, 1)
    phase = "both" if world == 1 else "send"
    for r in range(world):
        with pytest.raises(ValueError, match=REFUSED.format("x")):
            eps[r].dispatch(offset_copy(xs[r], OFF_WORD), idxs[r], phase=phase)
        with pytest.raises(ValueError, match=REFUSED.format("send")):
            a2as[r](offset_copy(sends[r], OFF_WORD), counts[r], phase=phase)

    # The same values, on words: exact. On the way, a combine's expert_out and a reverse's rows off a word
    # are refused on every rank (EPBuffer's combine at world 1 reads expert_out in its dtype: accepted).
    for r in range(world):
        eps[r].dispatch(xs[r], idxs[r], phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    if world > 1:
        for r in range(world):
            with pytest.raises(ValueError, match=REFUSED.format("expert_out")):
                eps[r].combine(offset_copy(expert(ds[r].x), OFF_WORD), ws[r], ds[r].handle, phase="send")
    for r in range(world):
        eps[r].combine(expert(ds[r].x), ws[r], ds[r].handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    for r in range(world):
        a2as[r](sends[r], counts[r], phase="send")
    res = [op(phase="recv") for op in a2as]
    for r in range(world):
        with pytest.raises(ValueError, match=REFUSED.format("rows")):
            a2as[r].combine(offset_copy(res[r].recv * 3, OFF_WORD), res[r].handle, phase=phase)
    for r in range(world):
        a2as[r].combine(res[r].recv * 3, res[r].handle, phase="send")
    backs = [op.combine(phase="recv") for op in a2as]
    errs = [e for r in range(world)
            for e in check_rank(r, inputs, ds[r], ys[r], res[r], backs[r], E_PER_RANK * world, M, CAP_A2A)]
    assert errs == []
    for g in groups:
        g.check()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_prefill_refuses_rows_off_a_word_then_runs_exact(world):
    cfg = CONFIGS[0]   # bf16
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0)
    bufs = [make_buffer(g, cfg) for g in groups]
    phase = "both" if world == 1 else "send"
    xs, idxs, ws = make_inputs(cfg, world, "random", 5)
    assert all(x.numel() for x in xs)
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        with pytest.raises(ValueError, match=REFUSED.format("x")):
            b.dispatch(offset_copy(x, OFF_WORD), i, w, phase=phase)
    assert round_trip(bufs, cfg, xs, idxs, ws, "after x") == []
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        b.dispatch(x, i, w, phase="send")
    ds = [b.dispatch(phase="recv") for b in bufs]
    for b, d in zip(bufs, ds):   # a refused combine answers its dispatch (PrefillBuffer's rule)
        with pytest.raises(ValueError, match=REFUSED.format("expert_out")):
            b.combine(offset_copy(d.recv_x, OFF_WORD), d.handle, phase=phase)
    assert round_trip(bufs, cfg, *make_inputs(cfg, world, "random", 6), "after expert_out") == []
    for g in groups:
        g.check()
