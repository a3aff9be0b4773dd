"""The open half of the fused layer: a kernel of your own waits on the dispatch's arrival words
(``EPBuffer.arrival``, ``moe_comm.triton_kernels.arrival``) and reads each source's rows of d.x as soon as the
receive has written them.

On a loopback world the consumer runs after the receive (one process, one kernel at a time), so these
tests show what the words say and that the wait really waits (launched before the receive, it times out
and names the source); they cannot show the overlap itself, which needs two streams on a GPU."""

import pytest
import torch
import triton
import triton.language as tl

import moe_comm
from moe_comm import CommTimeoutError, EPBuffer, reference
from moe_comm.interpreter import kernel_for
from moe_comm.planner import next_pow2
from moe_comm.protocol import EPOCH_SHIFT
from moe_comm.triton_kernels.arrival import arrival_flag, wait_source

from moe_cases import make_inputs

E_LOCAL, H, M, K = 3, 64, 4, 2


@triton.jit
def _consumer(words_ptr, counts_ptr, call_ptr, state_ptr, status_ptr, x_ptr, out_ptr, got_ptr, rank,
              WORLD: tl.constexpr, WORLD_P2: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, H: tl.constexpr,
              BR: tl.constexpr):
    """Program e: for each source in turn, wait for its rows, then copy its rows of expert e from d.x to out
    (a GEMM's stand-in) and mark got[e, s]."""
    e = tl.program_id(0)
    flag = arrival_flag(state_ptr, call_ptr)
    base = tl.zeros([], dtype=tl.int32)
    c = tl.arange(0, H)
    for s in range(WORLD):
        if wait_source(words_ptr, s, flag, state_ptr, status_ptr, rank, WORLD, WORLD_P2):
            n = tl.load(counts_ptr + s * (L + 1) + e)
            for r0 in range(0, n, BR):
                r = base + r0 + tl.arange(0, BR)
                live = (r0 + tl.arange(0, BR) < n)[:, None]
                rows = (e * CAP + r).to(tl.int64)[:, None] * H + c[None, :]
                tl.store(out_ptr + rows, tl.load(x_ptr + rows, mask=live), mask=live)
            tl.store(got_ptr + e * WORLD + s, 1)
            base += n


def _consume(ep, aw, group, out, got):
    kernel_for(_consumer, group.device)[(E_LOCAL,)](
        aw.words, aw.counts, aw.call, aw.state, aw.status, aw.x, out, got, group.rank, WORLD=group.world_size,
        WORLD_P2=next_pow2(group.world_size), L=E_LOCAL, CAP=ep.plan.capacity, H=H, BR=8)


@pytest.mark.timeout(120)
def test_a_consumer_reads_every_source_once_its_word_says_so():
    """Each rank's consumer, launched on the words of the pending call, gets every source (T = 0 ones
    too) and copies exactly the rows the reference dispatch put in d.x; the words hold the call's flag."""
    world = 3
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    eps = [EPBuffer(g, E_LOCAL * world, H, M, K) for g in groups]
    for call in (1, 2):
        xs, idxs, _ = make_inputs(world, [M, 0, 3], E_LOCAL * world, K, H, call)
        for ep, x, i in zip(eps, xs, idxs):
            ep.dispatch(x, i, phase="send")
        aws = [ep.arrival() for ep in eps]
        ds = [ep.dispatch(phase="recv") for ep in eps]
        exp = reference.dispatch(xs, idxs, E_LOCAL * world, M)
        for r, (ep, aw, d) in enumerate(zip(eps, aws, ds)):
            assert aw.words.tolist() == [call] * world   # epoch 0: the flag is the call number
            out = torch.full_like(d.x, float("nan"))
            got = torch.zeros(E_LOCAL * world, dtype=torch.int32)
            _consume(ep, aw, groups[r], out, got)
            assert got.tolist() == [1] * (E_LOCAL * world)
            for e, n in enumerate(exp[r]["counts"].tolist()):
                assert torch.equal(out[e, :n], exp[r]["x"][e, :n]), (call, r, e)
                assert aw.counts[:, e].sum() == n


@pytest.mark.timeout(120)
def test_a_consumer_launched_before_the_receive_waits_and_times_out_naming_the_source():
    """Before the receive has run (one process: it cannot run meanwhile) the consumer's bounded wait times
    out, records CommTimeoutError naming source 0, and the receive raises it; after reset() a call goes."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=0.3)
    eps = [EPBuffer(g, E_LOCAL * 2, H, M, K) for g in groups]
    xs, idxs, _ = make_inputs(2, [M, 2], E_LOCAL * 2, K, H, 5)
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    got = torch.zeros(E_LOCAL * 2, dtype=torch.int32)
    _consume(eps[0], eps[0].arrival(), groups[0], torch.zeros(E_LOCAL, 2 * M, H, dtype=torch.bfloat16), got)
    assert got.tolist() == [0] * (E_LOCAL * 2)
    with pytest.raises(CommTimeoutError, match="dispatch: rank 0 timed out .* peer rank 0"):
        eps[0].dispatch(phase="recv")
    for g in groups:
        g.reset()
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    assert [int(ep.arrival().call) for ep in eps] == [1, 1] and EPOCH_SHIFT > 0
    for ep in eps:
        ep.dispatch(phase="recv")
