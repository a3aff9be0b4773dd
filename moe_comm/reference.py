"""Pure-torch references of every op, given every rank's inputs at once.

Tests compare the kernels against these (exactly for counts, order and moved bytes); docs use them to
say what each op computes. They are written for clarity, not speed, and read counts on the host.
"""

from __future__ import annotations

import torch


# ---- AllToAllvDynamic ----------------------------------------------------------------------------

def alltoallv(sends: list[torch.Tensor], send_counts: list[torch.Tensor], max_rows_per_peer: int):
    """Forward all-to-all-v. sends[r] [N_r, *row_shape]; send_counts[r] [world] (each <= capacity,
    sum <= N_r). Returns per receiving rank i: (recv [world, max_rows_per_peer, *row_shape] with rows
    past a count zero, recv_counts int32 [world])."""
    world = len(sends)
    counts = [[int(c) for c in sc.tolist()] for sc in send_counts]
    out = []
    for i in range(world):
        row_shape = sends[i].shape[1:]
        recv = torch.zeros((world, max_rows_per_peer, *row_shape), dtype=sends[i].dtype)
        rc = torch.zeros(world, dtype=torch.int32)
        for j in range(world):
            off = sum(counts[j][:i])
            n = counts[j][i]
            recv[j, :n] = sends[j][off:off + n].cpu()
            rc[j] = n
        out.append((recv, rc))
    return out


def alltoallv_combine(rows: list[torch.Tensor], send_counts: list[torch.Tensor], num_rows: list[int]):
    """Reverse of ``alltoallv``. rows[i] [world, max_rows_per_peer, *row_shape] on rank i; rows[i][j, :c]
    (c = rows rank j sent to i) go back to rank j at the offsets its forward rows had. Returns per rank
    j: [num_rows[j], *row_shape], rows not covered by the forward zero."""
    world = len(rows)
    counts = [[int(c) for c in sc.tolist()] for sc in send_counts]
    out = []
    for j in range(world):
        res = torch.zeros((num_rows[j], *rows[j].shape[2:]), dtype=rows[j].dtype)
        off = 0
        for i in range(world):
            n = counts[j][i]
            res[off:off + n] = rows[i][j, :n].cpu()
            off += n
        out.append(res)
    return out
