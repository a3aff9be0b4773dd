"""moe_comm.compat.deep_ep's normal (high-throughput) mode on a PrefillBuffer, against moe_comm.reference.

DeepEP's call sequence (get_dispatch_layout -> dispatch -> experts -> combine) on one rank (loopback) and
on three shm ranks in separate processes (uneven and empty ranks, all tokens to one expert, -1 slots,
two rounds): the packed receive (rows in (source rank, token) order, local ids, weights, per-expert
counts with alignment) and the combine, bitwise; then what does not map raises by name.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import PrefillBuffer, reference
from moe_comm.compat import deep_ep

HIDDEN, M, L, K = 64, 5, 3, 3   # hidden, tokens per rank (capacity), experts per rank, top-k


def make_inputs(world: int, seed: int, tokens=None, one_expert=None):
    """Per rank (x [T, H] bf16, topk_idx int64 [T, K] distinct experts with ~1/5 slots -1, weights)."""
    E = L * world
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 10 + r)
        T = (tokens or [M, 0, 3, 1])[r]
        x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.int64)
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        if one_expert is not None:
            idx = torch.full((T, K), -1, dtype=torch.int64)
            idx[:, 1] = one_expert
        out.append((x, idx, torch.rand(T, K, generator=g)))
    return out


def experts(x, local_idx, weights, rank):
    """Toy experts: global expert g multiplies by (g + 1) / 4; one partial row per row (float32 sum in k
    order, rounded once)."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(local_idx.shape[1]):
        g = local_idx[:, k].long() + rank * L
        scaled = (x.float() * ((g.float() + 1) / 4)[:, None]).to(x.dtype).float()
        acc += torch.where(local_idx[:, k, None] >= 0, weights[:, k, None] * scaled, 0.0)
    return acc.to(x.dtype)


def run_round(buf, rank, inputs, align=1):
    """One DeepEP-style round on ``buf`` for this rank; returns a list of mismatches."""
    world = len(inputs)
    E = L * world
    xs, idxs, ws = (list(t) for t in zip(*inputs))
    x, idx, w = inputs[rank]
    errs = []
    per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    owners = [reference.prefill_owners(ids, E, world) for ids in idx.tolist()]
    want_in_rank = torch.tensor([[r in o for r in range(world)] for o in owners], dtype=torch.bool).view(-1, world)
    if rdma is not None or not torch.equal(in_rank, want_in_rank) or \
            per_rank.tolist() != want_in_rank.sum(0).tolist() or \
            per_expert.tolist() != torch.bincount(idx[idx >= 0], minlength=E).tolist():
        errs.append(f"rank {rank}: layout")
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, expert_alignment=align)
    want = reference.prefill_dispatch(xs, idxs, ws, E, M)[rank]
    valid = want["valid"]
    if not (torch.equal(recv_x, want["x"][valid]) and recv_idx.dtype == torch.int64
            and torch.equal(recv_idx, want["topk_idx"][valid].long()) and torch.equal(recv_w, want["topk_weights"][valid])):
        errs.append(f"rank {rank}: received rows")
    if counts != [-(-c // align) * align for c in want["expert_counts"].tolist()]:
        errs.append(f"rank {rank}: counts {counts}")
    y, combined_w, _ = buf.combine(experts(recv_x, recv_idx, recv_w, rank), handle)
    partials = [experts(d["x"], d["topk_idx"], d["topk_weights"], r)
                for r, d in enumerate(reference.prefill_dispatch(xs, idxs, ws, E, M))]
    if combined_w is not None or not torch.equal(y, reference.prefill_combine(partials, idxs, E, M)[rank]):
        errs.append(f"rank {rank}: combine")
    return errs


def make_buffer(group):
    E = L * group.world_size
    budget = PrefillBuffer.required_bytes(group.world_size, E, HIDDEN, M, K)
    return deep_ep.Buffer(group, num_nvl_bytes=budget, num_rdma_bytes=0, low_latency_mode=False)


def _rank(group, rounds=4):
    """Rounds: uneven and empty ranks (expert_alignment 1, then 2), all tokens to the last expert, every
    rank empty (the shm run takes the first and the third)."""
    buf = make_buffer(group)
    world, last = group.world_size, L * group.world_size - 1
    cases = [(make_inputs(world, 0), 1), (make_inputs(world, 1), 2), (make_inputs(world, 7, one_expert=last), 1),
             (make_inputs(world, 8, tokens=[0] * world), 1)]
    errs = []
    for inputs, align in (cases if rounds == 4 else cases[0:3:2]):
        errs += run_round(buf, group.rank, inputs, align)
    if buf._prefill[(HIDDEN, L * world, K)].max_tokens_per_rank != M:   # the budget bought exactly M tokens
        errs.append(f"rank {group.rank}: capacity")
    return errs


def test_normal_mode_world1_equals_reference():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    assert _rank(g) == []


@pytest.mark.timeout(300)
def test_normal_mode_shm_world3_equals_reference():
    errs = moe_comm.launch(_rank, 3, 2, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


def test_what_does_not_map_raises_by_name():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    buf = make_buffer(g)
    x, idx, w = make_inputs(1, 3)[0]
    layout = dict(num_tokens_per_expert=torch.zeros(L, dtype=torch.int32), topk_idx=idx, topk_weights=w)
    for kw, what in ((dict(handle=object()), "cached dispatch"), (dict(num_worst_tokens=64), "num_worst_tokens")):
        with pytest.raises(NotImplementedError, match=what):
            buf.dispatch(x, **kw, **layout)
    with pytest.raises(NotImplementedError, match="pre-quantized fp8"):
        buf.dispatch((x, torch.ones(x.shape[0], 1)), **layout)
    with pytest.raises(ValueError, match="needs topk_idx"):   # internode_dispatch is dispatch (any group)
        buf.internode_dispatch(x)
    with pytest.raises(ValueError, match="needs topk_idx and num_tokens_per_expert"):
        buf.dispatch(x, topk_idx=idx)
    big = torch.randn(M + 1, HIDDEN).bfloat16()
    with pytest.raises(ValueError, match=r"raise num_nvl_bytes to moe_comm.PrefillBuffer.required_bytes\(1, 3, 64, 6, 3\)"):
        buf.dispatch(big, **dict(layout, topk_idx=torch.zeros(M + 1, K, dtype=torch.int64), topk_weights=None))
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    with pytest.raises(NotImplementedError, match="backward pass"):
        buf.combine(recv_x, handle, topk_weights=recv_w)
    with pytest.raises(NotImplementedError, match="bias"):
        buf.combine(recv_x, handle, bias=recv_x)
    y, _, _ = buf.combine(experts(recv_x, recv_idx, recv_w, 0), handle)   # still answers its dispatch
    assert y.shape == x.shape
    with pytest.raises(ValueError, match="num_nvl_bytes=16 is too small"):
        deep_ep.Buffer(g, num_nvl_bytes=16).dispatch(x, **layout)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    with pytest.raises(ValueError, match="no receive hook"):
        make_buffer(groups[0]).get_dispatch_layout(idx, 2 * L)
