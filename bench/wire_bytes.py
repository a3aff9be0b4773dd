"""Bytes on the network per dispatch and combine, measured by the emulated nodes' wire, next to the floor.

    python bench/wire_bytes.py [--nodes 2] [--ranks-per-node 2] [--tokens 16] [--hidden 1024]
                               [--experts 32] [--topk 8] [--fp8]

Runs one dispatch and one combine on emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``; every cross-node
byte travels as a wire message, ``moe_comm/heap/wire.py``) with uniform random top-k routing, and prints,
per op, the bytes the wire carried between nodes against the floor: every routed token row once per
destination rank on another node, plus the control words and the flag. The wire counts payload and its
21-byte message headers; the floor counts neither headers nor anything a rank need not send.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

import moe_comm  # noqa: E402
from moe_comm.heap.shm import RANKS_PER_NODE_ENV  # noqa: E402
from moe_comm.heap.wire import HEADER  # noqa: E402


def _inputs(args, world):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    idx = [torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(args.tokens)])
           for _ in range(world)]
    ws = [torch.rand(args.tokens, args.topk, generator=g) for _ in range(world)]
    return xs, idx, ws


def floor_bytes(idx, rank, world, per_node, experts, row_bytes, out_row_bytes, ctrl_bytes):
    """Floor of rank ``rank``'s cross-node bytes: (dispatch, combine). Dispatch: each token row once per
    destination rank on another node, plus that destination's control words (counts and flag). Combine
    (sent by ``rank`` as a destination): one partial row per token it holds experts of, per source rank on
    another node, plus the flag."""
    per_rank = experts // world
    node = [j // per_node for j in range(world)]
    dispatch = combine = 0
    for d in range(world):
        if node[d] == node[rank]:
            continue
        owners = idx[rank] // per_rank
        dispatch += int((owners == d).any(dim=1).sum()) * row_bytes + ctrl_bytes
        owners_d = idx[d] // per_rank
        combine += int((owners_d == rank).any(dim=1).sum()) * out_row_bytes + 8
    return dispatch, combine


def _rank(group, args):
    world, me = group.world_size, group.rank
    xs, idx, ws = _inputs(args, world)
    ep = moe_comm.EPBuffer(group, args.experts, args.hidden, args.tokens, args.topk, fp8_dispatch=args.fp8)
    p = ep.plan
    wire = group.heap.wire
    b0 = wire.stats["bytes"]
    d = ep.dispatch(xs[me], idx[me])
    b1 = wire.stats["bytes"]
    ep.combine(d.x.float().to(torch.bfloat16) if not args.fp8 else torch.ones(d.x.shape, dtype=torch.bfloat16),
               ws[me], d.handle)
    b2 = wire.stats["bytes"]
    fd, fc = floor_bytes(idx, me, world, args.ranks_per_node, args.experts, p.row_words * 4, p.out_words * 4,
                         (p.dispatch_ctrl_words - 1) * 8 + 8)
    msgs = wire.stats["messages"]
    ep.close()
    return dict(rank=me, dispatch_wire=b1 - b0, combine_wire=b2 - b1, dispatch_floor=fd, combine_floor=fc,
                messages=msgs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args(argv)
    world = args.nodes * args.ranks_per_node
    os.environ[RANKS_PER_NODE_ENV] = str(args.ranks_per_node)
    rows = moe_comm.launch(_rank, world, args, backend="shm", timeout_s=120)
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, T={args.tokens}, hidden={args.hidden}, "
          f"E={args.experts}, top-{args.topk}, {'fp8' if args.fp8 else 'bf16'} dispatch; "
          f"wire headers {HEADER.size} B per message")
    print(f"{'rank':>4} {'dispatch wire':>14} {'floor':>10} {'x':>6} {'combine wire':>14} {'floor':>10} {'x':>6}")
    for r in rows:
        print(f"{r['rank']:>4} {r['dispatch_wire']:>14,} {r['dispatch_floor']:>10,} "
              f"{r['dispatch_wire'] / max(1, r['dispatch_floor']):>6.2f} {r['combine_wire']:>14,} "
              f"{r['combine_floor']:>10,} {r['combine_wire'] / max(1, r['combine_floor']):>6.2f}")
    print(json.dumps(dict(op="wire_bytes", args=vars(args), rows=rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
