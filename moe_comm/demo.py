"""AllToAllvDynamic round trips on N ranks with skewed random counts, checked against the reference.

    python -m moe_comm.demo [--world 4] [--calls 5] [--cap 8] [--hidden 256]

Runs on the shm heap in N local processes (on a machine without CUDA the kernels run in Triton's
interpreter, so the times are interpreter times, not GPU times) and prints rows sent/received and
the time per call for each rank.
"""

from __future__ import annotations

import argparse
import time

import torch

import moe_comm
from moe_comm import reference


def _skewed_counts(world: int, cap: int, seed: int) -> list[torch.Tensor]:
    """Per rank: counts drawn with a hot destination (rank seed % world gets most rows)."""
    g = torch.Generator().manual_seed(seed)
    hot = seed % world
    out = []
    for _ in range(world):
        c = torch.randint(0, cap // 2 + 1, (world,), generator=g)
        c[hot] = cap
        out.append(c.to(torch.int32))
    return out


def _rank(group, calls: int, cap: int, hidden: int):
    world, rank = group.world_size, group.rank
    op = moe_comm.AllToAllvDynamic(group, cap, (hidden,), torch.bfloat16)
    sent = recvd = 0
    times, ok = [], True
    for i in range(calls):
        counts = _skewed_counts(world, cap, i)
        g = torch.Generator().manual_seed(10_000 + i)
        sends = [torch.randn(int(c.sum()), hidden, generator=g).to(torch.bfloat16) for c in counts]
        group.barrier()
        t0 = time.perf_counter()
        res = op(sends[rank], counts[rank])
        back = op.combine(res.recv, res.handle)
        times.append(time.perf_counter() - t0)
        exp_recv, exp_counts = reference.alltoallv(sends, counts, cap)[rank]
        ok &= torch.equal(res.recv_counts, exp_counts)
        ok &= all(torch.equal(res.recv[j, :n], exp_recv[j, :n]) for j, n in enumerate(exp_counts.tolist()))
        ok &= torch.equal(back, sends[rank])
        sent += int(counts[rank].sum())
        recvd += int(exp_counts.sum())
    times.sort()
    return dict(rank=rank, sent=sent, received=recvd, median_us=times[len(times) // 2] * 1e6, ok=bool(ok))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--cap", type=int, default=8, help="max_rows_per_peer")
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args(argv)
    print(f"AllToAllvDynamic + combine, {a.world} ranks, {a.calls} calls, bf16 rows of {a.hidden}, "
          f"capacity {a.cap} rows per peer, skewed counts")
    rows = moe_comm.launch(_rank, a.world, a.calls, a.cap, a.hidden, timeout_s=60)
    interp = "Triton interpreter on CPU" if not torch.cuda.is_available() else "GPU"
    print(f"{'rank':>4} {'rows sent':>10} {'rows recv':>10} {'us/call (fwd+rev, median)':>27} {'matches reference':>18}")
    for r in rows:
        print(f"{r['rank']:>4} {r['sent']:>10} {r['received']:>10} {r['median_us']:>27.0f} {str(r['ok']):>18}")
    print(f"(times: {interp})")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
