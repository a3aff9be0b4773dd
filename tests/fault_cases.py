"""Shared by the serving-loop fault tests (test_fault_soak.py, test_exclude.py): one step's inputs for
every rank (dispatch -> combine and an AllToAllvDynamic round trip) and the check of one rank's results
against the references, with invalid ids unrouted and excluded ranks' experts and rows dropped."""

import torch

from moe_comm import reference


def step_inputs(seed, world, E, M, K, H, cap, row, fault=None):
    """Every rank's (xs, idxs, ws, sends, counts) of one step: T <= M tokens, top-K distinct experts
    (20 % of slots -1), AllToAllvDynamic counts <= cap. ``fault(r, idx, counts)`` may change rank r's
    ids and counts in place before its rows are drawn (so every rank computes the same reference)."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws, sends, counts = [], [], [], [], []
    for r in range(world):
        T = int(torch.randint(0, M + 1, (1,), generator=g))
        xs.append(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        ws.append(torch.rand(T, K, generator=g))
        c = torch.randint(0, cap + 1, (world,), generator=g).to(torch.int32)
        if fault is not None:
            fault(r, idx, c)
        idxs.append(idx)
        counts.append(c)
        sends.append(torch.randn(int(c.sum()), *row, generator=g))
    return xs, idxs, ws, sends, counts


def expert(x):
    """A deterministic 'expert' (exact in bf16 for these values)."""
    return (x.float() * 2 + 1).to(torch.bfloat16)


def check_rank(rank, inputs, d, y, res, back, E, M, cap, excluded=()):
    """Mismatches of this rank's dispatch ``d``, combine ``y``, AllToAllvDynamic ``res`` and its reverse
    ``back`` (rows times 3) against the references; [] when exact."""
    xs, idxs, ws, sends, counts = inputs
    clean = [torch.where((i >= 0) & (i < E), i, -1) for i in idxs]
    exp_d = reference.dispatch(xs, clean, E, M, excluded=excluded)
    errs = []
    if not torch.equal(d.counts, exp_d[rank]["counts"]):
        errs.append(f"counts {d.counts.tolist()} != {exp_d[rank]['counts'].tolist()}")
    for e, n in enumerate(exp_d[rank]["counts"].tolist()):
        if not torch.equal(d.x[e, :n], exp_d[rank]["x"][e, :n]):
            errs.append(f"d.x of expert {e}")
    eos = [expert(r["x"]) for r in exp_d]
    if not torch.equal(y, reference.combine(eos, ws, clean, E, M, excluded=excluded)[rank]):
        errs.append("combine y")
    recv, rc = reference.alltoallv(sends, counts, cap, excluded=excluded)[rank]
    if not torch.equal(res.recv_counts, rc):
        errs.append(f"recv_counts {res.recv_counts.tolist()} != {rc.tolist()}")
    for j in range(len(xs)):
        if not torch.equal(res.recv[j, :int(rc[j])], recv[j, :int(rc[j])]):
            errs.append(f"a2a rows from {j}")
    # reverse: the rows this rank sent come back where they were (rows it did not send are unspecified)
    for j, (off, n) in enumerate(reference.sent_rows(counts[rank].tolist(), cap, sends[rank].shape[0], excluded)):
        if not torch.equal(back[off:off + n], sends[rank][off:off + n] * 3):
            errs.append(f"a2a reverse rows for {j}")
    return errs
