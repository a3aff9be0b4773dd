"""Bytes on the network per dispatch and combine, measured by the emulated nodes' wire, next to the floor.

    python bench/wire_bytes.py [--nodes 2] [--ranks-per-node 2] [--tokens 16] [--hidden 1024]
                               [--experts 32] [--topk 8] [--fp8 | --dispatch-format e4m3|nvfp4]
                               [--combine-format e4m3] [--unrouted 0.0]

Runs one dispatch and one combine on emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``; every cross-node
byte travels as a wire message, ``moe_comm/heap/wire.py``) with uniform random top-k routing, and prints,
per rank and op, the payload the wire carried between nodes against the floor, then the messages and
their 21-byte headers (which the floor does not count). Floor, per rank:

- dispatch: each token row (payload, scales, K routing words and the token index, padded to 16 bytes:
  ``dispatch_row_bytes``, from the format's definition, not from the plan) once per destination rank on
  another node that holds one of the token's experts, plus that rank's control words (rows, per-expert
  counts, run base) and the flag;
- combine (sent by the rank holding the experts): one expert-output row (``combine_row_bytes``) per routed
  slot (t, k) of a token on another node, plus the flag.

Payload per row by format (docs/formats.md): bf16 2H bytes; e4m3 H bytes + H/128 float32 scales; nvfp4
H/2 bytes + H/16 e4m3 scales (the global scale is the caller's, not sent). The weights are applied on the token's rank, in a fixed k order
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


def _inputs(args, world):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    idx = [torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(args.tokens)])
           .reshape(args.tokens, args.topk) for _ in range(world)]
    for i in idx:   # a share of the slots not routed (-1)
        i[torch.rand(i.shape, generator=g) < args.unrouted] = -1
    ws = [torch.rand(args.tokens, args.topk, generator=g) for _ in range(world)]
    return xs, idx, ws


def payload_bytes(fmt: str | None, hidden: int) -> int:
    """Bytes of one row's payload in format ``fmt`` (None: bf16): values and scales."""
    return {None: 2 * hidden, "e4m3": hidden + 4 * (hidden // 128), "nvfp4": hidden // 2 + hidden // 16}[fmt]


def dispatch_row_bytes(fmt: str | None, hidden: int, topk: int) -> int:
    """A dispatch row on the wire: payload, K int32 routing words and the token index, padded to 16 bytes."""
    return -(-(payload_bytes(fmt, hidden) + 4 * topk + 4) // 16) * 16


def combine_row_bytes(fmt: str | None, hidden: int) -> int:
    """A combine row on the wire: the payload, padded to 16 bytes."""
    return -(-payload_bytes(fmt, hidden) // 16) * 16


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
    ep = moe_comm.EPBuffer(group, args.experts, args.hidden, args.tokens, args.topk,
                           dispatch_format=args.dispatch_format, combine_format=args.combine_format)
    p = ep.plan
    gs = moe_comm.reference.nvfp4_global_scale(torch.cat(xs)) if args.dispatch_format == "nvfp4" else None
    wire = group.heap.wire
    before = dict(wire.stats)
    d = ep.dispatch(xs[me], idx[me], global_scale=gs)
    mid = dict(wire.stats)
    rows = torch.ones((p.experts_per_rank, p.capacity, args.hidden), dtype=torch.bfloat16)
    ep.combine(rows if args.dispatch_format else d.x.clone(), ws[me], d.handle)
    after = dict(wire.stats)
    row_bytes = dispatch_row_bytes(args.dispatch_format, args.hidden, args.topk)
    out_row_bytes = combine_row_bytes(args.combine_format, args.hidden)
    fd, fc = floor_bytes(idx, me, world, args.ranks_per_node, args.experts, row_bytes, out_row_bytes,
                         p.dispatch_ctrl_words * 8)
    ep.close()
    diff = lambda a, b, key: b.get(key, 0) - a.get(key, 0)  # noqa: E731
    return dict(rank=me, dispatch_wire=diff(before, mid, "payload"), dispatch_floor=fd,
                dispatch_messages=diff(before, mid, "messages"), combine_wire=diff(mid, after, "payload"),
                combine_floor=fc, combine_messages=diff(mid, after, "messages"),
                headers=diff(before, after, "bytes") - diff(before, after, "payload"),
                row_bytes=row_bytes, out_row_bytes=out_row_bytes, plan_row_bytes=p.row_words * 4,
                plan_out_row_bytes=p.combine_words * 4)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--fp8", action="store_true", help="the same as --dispatch-format e4m3")
    ap.add_argument("--dispatch-format", choices=("e4m3", "nvfp4"), default=None)
    ap.add_argument("--combine-format", choices=("e4m3",), default=None)
    ap.add_argument("--unrouted", type=float, default=0.0, help="share of slots set to -1 (not routed)")
    a = ap.parse_args(argv)
    if a.fp8:
        if a.dispatch_format not in (None, "e4m3"):
            ap.error("--fp8 is --dispatch-format e4m3: pass one of them")
        a.dispatch_format = "e4m3"
    return a


def measure(args: argparse.Namespace) -> list[dict]:
    """One dispatch and one combine on ``args.nodes`` emulated nodes: per rank, the payload the wire
    carried and the floor, per op (see the module docstring), messages, header bytes."""
    os.environ[RANKS_PER_NODE_ENV] = str(args.ranks_per_node)
    return moe_comm.launch(_rank, args.nodes * args.ranks_per_node, args, backend="shm", timeout_s=120)


def main(argv=None) -> int:
    args = parse(argv)
    rows = measure(args)
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, T={args.tokens}, hidden={args.hidden}, "
          f"E={args.experts}, top-{args.topk}, {args.dispatch_format or 'bf16'} dispatch, "
          f"{args.combine_format or 'bf16'} combine; "
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
