"""AllToAllvDynamic test cases shared by the shm (multi-process) and loopback (one process) tests.

Every rank can rebuild every rank's inputs from the case seed, so each rank checks its own outputs
against ``moe_comm.reference`` and returns a short list of mismatches (empty = pass).
"""

from __future__ import annotations

import torch

from moe_comm import reference

DTYPES = (torch.bfloat16, torch.float32, torch.int32)
ROW_SHAPES = ((64,), (3, 32))
PATTERNS = ("random", "zeros", "one_destination", "full")
POISON = {torch.bfloat16: float("nan"), torch.float32: float("nan"), torch.int32: -777}


def make_counts(pattern: str, world: int, cap: int, seed: int) -> list[torch.Tensor]:
    """send_counts of every rank for one case."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        if pattern == "random":  # includes zeros
            c = torch.randint(0, cap + 1, (world,), generator=g)
        elif pattern == "zeros":
            c = torch.zeros(world, dtype=torch.int64)
        elif pattern == "one_destination":  # every rank sends everything to one rank
            c = torch.zeros(world, dtype=torch.int64)
            c[seed % world] = cap
        elif pattern == "full":
            c = torch.full((world,), cap)
        else:
            raise ValueError(pattern)
        out.append(c.to(torch.int32 if (seed + r) % 2 else torch.int64))
    return out


def make_sends(counts, row_shape, dtype, seed: int, extra_rows: int = 1) -> list[torch.Tensor]:
    """Rows of every rank; N = sum of counts + extra_rows (rows past the sum must not be sent)."""
    g = torch.Generator().manual_seed(seed + 1)
    sends = []
    for c in counts:
        n = int(c.sum()) + extra_rows
        if dtype.is_floating_point:
            s = torch.randn((n, *row_shape), generator=g).to(dtype)
        else:
            s = torch.randint(-10**6, 10**6, (n, *row_shape), generator=g, dtype=dtype)
        sends.append(s)
    return sends


def poison(op) -> None:
    """Fill the op's output sets so rows the kernels should have written but did not stand out."""
    for t in op._recv:
        t.fill_(POISON[t.dtype])


def check_forward(rank, res, sends, counts, cap, tag) -> list[str]:
    exp_recv, exp_counts = reference.alltoallv(sends, counts, cap)[rank]
    errs = []
    got_counts = res.recv_counts.cpu()
    if got_counts.dtype != torch.int32 or not torch.equal(got_counts, exp_counts):
        return [f"{tag}: recv_counts {got_counts.tolist()} != {exp_counts.tolist()}"]
    for j, n in enumerate(exp_counts.tolist()):
        if not torch.equal(res.recv[j, :n].cpu(), exp_recv[j, :n]):
            errs.append(f"{tag}: rows from rank {j} differ")
    return errs


def check_reverse(rank, back, rows_per_rank, sends, counts, tag) -> list[str]:
    exp = reference.alltoallv_combine(rows_per_rank, counts, [s.shape[0] for s in sends])[rank]
    n = int(counts[rank].sum())
    if tuple(back.shape) != tuple(exp.shape):
        return [f"{tag}: combine shape {tuple(back.shape)} != {tuple(exp.shape)}"]
    if not torch.equal(back[:n].cpu(), exp[:n]):
        return [f"{tag}: combine rows differ"]
    return []


def transform(recv: torch.Tensor) -> torch.Tensor:
    """What the 'experts' do to received rows before they go back: a dtype-preserving change."""
    return recv + 1 if not recv.dtype.is_floating_point else (recv.float() * 2 - 1).to(recv.dtype)


def case_list(world: int):
    seed = 1000 * world
    for dtype in DTYPES:
        for row_shape in ROW_SHAPES:
            for pattern in PATTERNS:
                seed += 7
                yield dtype, row_shape, pattern, seed


CAP = 3  # max_rows_per_peer: small and odd


def run_shm_cases(group) -> list[str]:
    """Every case on one rank of a launched group (forward, reverse, phase split)."""
    world, rank = group.world_size, group.rank
    errs, ops = [], {}
    from moe_comm import AllToAllvDynamic

    for dtype, row_shape, pattern, seed in case_list(world):
        key = (dtype, row_shape)
        if key not in ops:
            ops[key] = AllToAllvDynamic(group, CAP, row_shape, dtype)
        op = ops[key]
        counts = make_counts(pattern, world, CAP, seed)
        sends = make_sends(counts, row_shape, dtype, seed)
        tag = f"rank{rank} {dtype} {row_shape} {pattern}"
        poison(op)
        split = seed % 3 == 0  # some cases run as two phases
        if split:
            assert op(sends[rank], counts[rank], phase="send") is None
            res = op(phase="recv")
        else:
            res = op(sends[rank], counts[rank])
        errs += check_forward(rank, res, sends, counts, CAP, tag)
        all_rows = [transform(recv) for recv, _ in reference.alltoallv(sends, counts, CAP)]
        back = op.combine(transform(res.recv), res.handle)
        errs += check_reverse(rank, back, all_rows, sends, counts, tag)
    return errs


def run_loopback_cases(groups, cap: int = CAP, plan_device=None, cases=None) -> list[str]:
    """Every case (or ``cases``) on a loopback world, phase by phase. ``plan_device="cuda"`` gives the ops
    the GPU launch plan (run by the interpreter on the CPU)."""
    from moe_comm import AllToAllvDynamic
    from moe_comm.planner import plan_alltoallv

    world = len(groups)
    errs, ops = [], {}
    for dtype, row_shape, pattern, seed in (cases if cases is not None else case_list(world)):
        key = (dtype, row_shape)
        if key not in ops:
            ops[key] = [AllToAllvDynamic(g, cap, row_shape, dtype) for g in groups]
            if plan_device is not None:
                for op in ops[key]:
                    op.plan = plan_alltoallv(world, cap, row_shape, dtype, torch.device(plan_device))
        rank_ops = ops[key]
        counts = make_counts(pattern, world, cap, seed)
        sends = make_sends(counts, row_shape, dtype, seed)
        for op in rank_ops:
            poison(op)
        for r, op in enumerate(rank_ops):
            op(sends[r], counts[r], phase="send")
        res = [op(phase="recv") for op in rank_ops]
        for r in range(world):
            errs += check_forward(r, res[r], sends, counts, cap, f"loopback rank{r} {dtype} {row_shape} {pattern}")
        all_rows = [transform(res[i].recv) for i in range(world)]
        for r, op in enumerate(rank_ops):
            op.combine(all_rows[r], res[r].handle, phase="send")
        backs = [op.combine(phase="recv") for op in rank_ops]
        ref_rows = [transform(recv) for recv, _ in reference.alltoallv(sends, counts, cap)]
        for r in range(world):
            errs += check_reverse(r, backs[r], ref_rows, sends, counts, f"loopback rank{r} {dtype} {row_shape} {pattern}")
    return errs
