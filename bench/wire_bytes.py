"""Bytes on the network per dispatch and combine, measured by the emulated nodes' wire, next to the floor.

    python bench/wire_bytes.py [--nodes 2] [--ranks-per-node 2] [--tokens 16] [--hidden 1024]
                               [--experts 32] [--topk 8] [--fp8 [FORMAT]] [--unrouted 0.0]

Runs one dispatch and one combine on emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``; every cross-node
byte travels as a wire message, ``moe_comm/heap/wire.py``) with uniform random top-k routing, and prints,
per rank and op, the payload the wire carried between nodes against the floor, then the messages and
their 21-byte headers (which the floor does not count). Floor, per rank:

- dispatch: each token row (``row_bytes``: payload, scales, K routing words and the token index, padded
  to 16 bytes; the payload H * 2 bytes in bf16, H fp8 bytes with --fp8, whose scales take 4 bytes per
  128 columns in float32 formats and 1 byte per 128 columns as packed UE8M0, ``moe_comm.fp8``) once per
  destination rank on another node that holds one of the token's experts, plus that rank's control
  words (rows, per-expert counts, run base) and the flag;
- combine (sent by the rank holding the experts): one expert-output row per routed slot (t, k) of a
  token on another node, plus the flag. The weights are applied on the token's rank, in a fixed k order
  (``EPBuffer.combine``: bitwise reproducible), so each slot's row must travel; summing a token's slots
  on the expert's rank first would need the weights there and change the order of the sum.
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
from moe_comm.heap.wire import HEADER, SIGNAL_BYTES  # noqa: E402

GROUP = 128             # columns per fp8 scale
VECTOR = 16             # rows are padded to whole 16-byte vectors
SCALE_BYTES = {"e4m3": 4, "e4m3-pow2": 4, "e4m3-ue8m0": 1}   # bytes of one 128-column group's scale


def _inputs(args, world):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    idx = [torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(args.tokens)])
           .reshape(args.tokens, args.topk) for _ in range(world)]
    for i in idx:   # a share of the slots not routed (-1)
        i[torch.rand(i.shape, generator=g) < args.unrouted] = -1
    ws = [torch.rand(args.tokens, args.topk, generator=g) for _ in range(world)]
    return xs, idx, ws


def row_bytes(fmt, hidden: int, topk: int) -> int:
    """Bytes of one dispatched token row at the floor, from the format alone (the module docstring): payload
    (bf16 or fp8 codes), scales, K routing words and the token index word, padded to 16 bytes."""
    payload = hidden * 2 if not fmt else hidden + hidden // GROUP * SCALE_BYTES[fmt]
    return -(-(payload + 4 * topk + 4) // VECTOR) * VECTOR


def floor_bytes(idx, rank, world, per_node, experts, row_bytes, out_row_bytes, ctrl_bytes):
    """Floor of rank ``rank``'s cross-node payload bytes: (dispatch, combine), as the module docstring
    defines it; ``ctrl_bytes`` = the control words and the flag of one (source, destination) pair."""
    per_rank = experts // world
    node = [j // per_node for j in range(world)]
    dispatch = combine = 0
    for d in range(world):
        if node[d] == node[rank]:
            continue
        owners = idx[rank] // per_rank
        dispatch += int((owners == d).any(dim=1).sum()) * row_bytes + ctrl_bytes
        combine += int((idx[d] // per_rank == rank).sum()) * out_row_bytes + SIGNAL_BYTES
    return dispatch, combine


def _rank(group, args):
    world, me = group.world_size, group.rank
    xs, idx, ws = _inputs(args, world)
    ep = moe_comm.EPBuffer(group, args.experts, args.hidden, args.tokens, args.topk, fp8_dispatch=args.fp8)
    p = ep.plan
    wire = group.heap.wire
    before = dict(wire.stats)
    d = ep.dispatch(xs[me], idx[me])
    mid = dict(wire.stats)
    ep.combine(d.x.float().to(torch.bfloat16) if not args.fp8 else torch.ones(d.x.shape, dtype=torch.bfloat16),
               ws[me], d.handle)
    after = dict(wire.stats)
    fd, fc = floor_bytes(idx, me, world, args.ranks_per_node, args.experts,
                         row_bytes(args.fp8, args.hidden, args.topk), p.out_words * 4, p.dispatch_ctrl_words * 8)
    ep.close()
    diff = lambda a, b, key: b.get(key, 0) - a.get(key, 0)  # noqa: E731
    return dict(rank=me, dispatch_wire=diff(before, mid, "payload"), dispatch_floor=fd,
                dispatch_messages=diff(before, mid, "messages"), combine_wire=diff(mid, after, "payload"),
                combine_floor=fc, combine_messages=diff(mid, after, "messages"),
                headers=diff(before, after, "bytes") - diff(before, after, "payload"),
                row_bytes=p.row_words * 4, out_row_bytes=p.out_words * 4)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--fp8", nargs="?", const="e4m3", default=False, choices=sorted(SCALE_BYTES),
                    help="dispatch fp8 in this format (moe_comm.fp8; default e4m3)")
    ap.add_argument("--unrouted", type=float, default=0.0, help="share of slots set to -1 (not routed)")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> list[dict]:
    """One dispatch and one combine on ``args.nodes`` emulated nodes: per rank, the payload the wire
    carried and the floor, per op (see the module docstring), messages, header bytes."""
    os.environ[RANKS_PER_NODE_ENV] = str(args.ranks_per_node)
    return moe_comm.launch(_rank, args.nodes * args.ranks_per_node, args, backend="shm", timeout_s=120)


def main(argv=None) -> int:
    args = parse(argv)
    rows = measure(args)
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, T={args.tokens}, hidden={args.hidden}, "
          f"E={args.experts}, top-{args.topk}, {args.fp8 or 'bf16'} dispatch; "
          f"payload bytes (wire headers: {HEADER.size} B per message, counted apart)")
    print(f"{'rank':>4} {'dispatch floor':>15} {'wire':>10} {'x':>5} {'msgs':>5} "
          f"{'combine floor':>14} {'wire':>10} {'x':>5} {'msgs':>5} {'headers B':>10}")
    for r in rows:
        print(f"{r['rank']:>4} {r['dispatch_floor']:>15,} {r['dispatch_wire']:>10,} "
              f"{r['dispatch_wire'] / max(1, r['dispatch_floor']):>5.2f} {r['dispatch_messages']:>5} "
              f"{r['combine_floor']:>14,} {r['combine_wire']:>10,} "
              f"{r['combine_wire'] / max(1, r['combine_floor']):>5.2f} {r['combine_messages']:>5} {r['headers']:>10,}")
    print(json.dumps(dict(op="wire_bytes", args=vars(args), rows=rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
