"""The fault model and real concurrency on a GPU (loopback worlds on one device).

- Send and receive phases of every rank on their own CUDA streams, all in flight at once (grids small
  enough to be co-resident), for 10 000 steps with changing token counts and routing, every step
  checked on the device: the flags, epochs and the send-after-previous-receive ordering under real
  concurrent CTAs.
- CUDA graphs across faults: per-rank phase graphs captured once; a rank that skips a replay makes the
  others' receives fail (NaN outputs, CommTimeoutError from the pinned error word without a device
  sync of the failing step), ``reset()`` recovers and replays are exact again; then a rank "dies" (its
  graphs are no longer replayed), the survivors ``exclude`` it and the same graphs, replayed without
  re-capture, are exact against the reference over the survivors.
Skipped without CUDA (conftest).
"""

import random

import pytest
import torch

import moe_comm
from moe_comm import CommTimeoutError, GroupError, reference

from test_gpu_ep import DEV, check_combine, check_dispatch, make_inputs, sync_check, toy_experts

EPBuffer = pytest.importorskip("moe_comm.ep").EPBuffer
pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_concurrent_streams_soak_10000_steps():
    world, E, K, H, M, steps = 4, 16, 4, 256, 8, 10_000
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    eps = [EPBuffer(g, E, H, M, K, dtype=torch.bfloat16) for g in groups]
    assert eps[0].plan.send_programs * world + eps[0].plan.recv_programs * world <= 132 * 2
    send_s = [torch.cuda.Stream() for _ in range(world)]
    recv_s = [torch.cuda.Stream() for _ in range(world)]
    main = torch.cuda.current_stream()
    host, bad = random.Random(3), torch.zeros(steps, 2, dtype=torch.int32, device=DEV)
    for step in range(steps):
        tokens = [host.randint(0, M) for _ in range(world)]
        xs, idxs, ws = make_inputs(tokens, E, K, H, 90_000 + step)
        for s in send_s + recv_s:
            s.wait_stream(main)
        for r, ep in enumerate(eps):  # every send in flight ...
            with torch.cuda.stream(send_s[r]):
                ep.dispatch(xs[r], idxs[r], phase="send")
        ds = []
        for r, ep in enumerate(eps):  # ... while every receive spins on its own stream
            with torch.cuda.stream(recv_s[r]):
                ds.append(ep.dispatch(phase="recv"))
        for s in recv_s:
            main.wait_stream(s)
        for r, d in enumerate(ds):
            want = torch.zeros(E // world, dtype=torch.int32, device=DEV)
            for i in idxs:
                v = i[(i >= r * (E // world)) & (i < (r + 1) * (E // world))] - r * (E // world)
                want += torch.bincount(v, minlength=E // world).int()
            bad[step, 0] |= (d.counts != want).any().int()
        if step % 97 == 0:  # every 97th step: every row and every sum against the reference, on the host
            check_dispatch(ds, xs, idxs, E, M, False)
        eos = [toy_experts(ep, d) for ep, d in zip(eps, ds)]
        for s in send_s + recv_s:
            s.wait_stream(main)
        for r, ep in enumerate(eps):
            with torch.cuda.stream(send_s[r]):
                ep.combine(eos[r], ws[r], ds[r].handle, phase="send")
        ys = []
        for r, ep in enumerate(eps):
            with torch.cuda.stream(recv_s[r]):
                ys.append(ep.combine(phase="recv"))
        for s in recv_s:
            main.wait_stream(s)
        if step % 97 == 0:
            check_combine(ys, eos, ws, idxs, E, M)
        for y in ys:
            bad[step, 1] |= torch.isnan(y.float()).any().int()
        if step % 500 == 499 or step == steps - 1:
            sync_check(eps)
            failed = bad[:step + 1].any(dim=1).nonzero()
            assert failed.numel() == 0, f"step {int(failed[0])}: (counts, combine NaN) = {bad[int(failed[0])].tolist()}"
    for ep in eps:
        ep.close()


def test_graphs_recover_with_reset_and_survive_an_exclude():
    world, E, K, H, M = 4, 16, 4, 256, 8
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=0.5)
    eps = [EPBuffer(g, E, H, M, K, dtype=torch.bfloat16) for g in groups]
    xs = [torch.zeros(M, H, dtype=torch.bfloat16, device=DEV) for _ in range(world)]
    idxs = [torch.full((M, K), -1, dtype=torch.int64, device=DEV) for _ in range(world)]
    ws = [torch.zeros(M, K, device=DEV) for _ in range(world)]
    ds, eos, ys = [None] * world, [None] * world, [None] * world

    def dispatch_send(r):
        eps[r].dispatch(xs[r], idxs[r], phase="send")

    def dispatch_recv(r):
        ds[r] = eps[r].dispatch(phase="recv")
        eos[r] = toy_experts(eps[r], ds[r])

    def combine_send(r):
        eps[r].combine(eos[r], ws[r], ds[r].handle, phase="send")

    def combine_recv(r):
        ys[r] = eps[r].combine(phase="recv")

    phases = (dispatch_send, dispatch_recv, combine_send, combine_recv)
    for phase in phases:  # allocate and compile outside the capture
        for r in range(world):
            phase(r)
    sync_check(eps)
    graphs = [[torch.cuda.CUDAGraph() for _ in range(world)] for _ in phases]
    for p, phase in enumerate(phases):
        for r in range(world):
            with torch.cuda.graph(graphs[p][r]):
                phase(r)

    def step(live, seed, skip=None):
        tokens = [random.Random(seed * 8 + r).randint(0, M) for r in range(world)]
        nx, ni, nw = make_inputs(tokens, E, K, H, 7000 + seed)
        for r in range(world):
            xs[r].zero_()[:tokens[r]] = nx[r]
            idxs[r].fill_(-1)[:tokens[r]] = ni[r]
            ws[r].zero_()[:tokens[r]] = nw[r]
        for p in range(len(phases)):
            for r in live:
                if (p, r) != skip:
                    graphs[p][r].replay()

    def check(live, gone=()):
        torch.cuda.synchronize()
        for r in live:
            groups[r].check()
        want = reference.combine([e.cpu() for e in eos], [w.cpu() for w in ws], [i.cpu() for i in idxs], E, M,
                                 excluded=set(gone))
        for r in live:
            torch.testing.assert_close(ys[r].cpu().float(), want[r].float(), rtol=1e-2, atol=1e-2)

    everyone = list(range(world))
    for seed in range(3):
        step(everyone, seed)
        check(everyone)
    step(everyone, 3, skip=(2, 1))  # rank 1 skips its combine send
    torch.cuda.synchronize()
    raised = 0
    for r in everyone:
        try:
            groups[r].check()
        except GroupError as e:
            raised += 1
            assert isinstance(e, CommTimeoutError) and e.peer == 1, e
    assert raised >= world - 1
    assert all(torch.isnan(ys[r].float()).all() for r in (0, 2, 3) if ys[r].numel())
    for g in groups:
        g.reset()
    for seed in range(4, 7):
        step(everyone, seed)
        check(everyone)
    survivors = [0, 1, 2]  # rank 3 "dies": its graphs are not replayed any more
    for r in survivors:
        assert groups[r].exclude([3]) == [3]
    for seed in range(7, 12):
        step(survivors, seed)  # the graphs captured before the exclude: no re-capture
        check(survivors, gone=[3])
    del graphs
    for ep in eps:
        ep.close()
