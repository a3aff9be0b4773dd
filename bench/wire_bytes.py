"""Bytes on the network per dispatch and combine, measured by the emulated nodes' wire, next to the floor.

    python bench/wire_bytes.py [--nodes 2] [--ranks-per-node 2] [--tokens 16] [--hidden 1024]
                               [--experts 32] [--topk 8] [--fp8 | --dispatch-format FORMAT]
                               [--combine-format e4m3] [--unrouted 0.0] [--prefill [--node-limit N]]

``--prefill`` measures PrefillBuffer instead of EPBuffer (docs/prefill.md "Across nodes"; floor below),
and ``--node-limit N`` routes each token's top-k experts among the experts of at most N nodes (DeepSeek-V3's
node-limited routing), to show what the per-node path saves against one copy per destination rank.

Runs one dispatch and one combine on emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``; every cross-node
byte travels as a wire message, ``moe_comm/heap/wire.py``) with uniform random top-k routing, and prints,
per rank and op, the payload the wire carried between nodes against the floor, the puts it carried against
the fewest the put path issues, then the messages and their 21-byte headers (which the floor does not
count). Floor, per rank:

- dispatch: each token row (payload, scales, K routing words and the token index, padded to 16 bytes:
  ``dispatch_row_bytes``, from the format's definition, not from the plan) once per destination rank on
  another node that holds one of the token's experts, plus that rank's control words (rows, per-expert
  counts, run base) and the flag;
- combine (sent by the rank holding the experts): one expert-output row (``combine_row_bytes``) per routed
  slot (t, k) of a token on another node, plus the flag.

  The weights are applied on the token's rank, in a fixed k order (``EPBuffer.combine``: bitwise
  reproducible), so each slot's row must travel; summing a token's slots on the expert's rank first would
  need the weights there and change the order of the sum.

Puts (a ``putmem_signal`` is a put and a signal), per rank: dispatch, per destination rank on another node,
one of the packed rows (if any) and one of the control words; combine, one per destination with a
non-empty run (else the bare flag).

Payload per row by format (``payload_bytes``, docs/formats.md): bf16 2H bytes; e4m3 and e4m3-pow2 H bytes +
H/128 float32 scales; e4m3-ue8m0 H bytes + H/128 UE8M0 bytes (packed four per int32); nvfp4 H/2 bytes +
H/16 e4m3 scales (the global scale is the caller's, not sent).

PrefillBuffer (``--prefill``), per rank, only what crosses nodes (``prefill_floor_bytes``):

- dispatch (sent by the token's rank): per other node holding a live owner of one of its experts, each
  token once to the rank's rail there: its payload row (``x_words`` words, fp8 scales included) and its
  routing row (``PrefillPlan.route_words``: K global ids, K weights, an int64 stamp); per such node with a
  live rail, the rail's control words (the tokens and the node's per-expert counts: ``count_span + 1``
  int64 words) and their 8-byte flag,
  and an 8-byte bare flag to every other live rank of that node. Puts: per (token, node) 2, or 3 with fp8
  scales (the payload row, its scales row, its routing row: three planes of the zone), and per node one of
  the control words;
- combine (sent by a rail): per source of another node it is the rail of, one output row per token that
  came to its node (the node's partial rows already summed) plus the 8-byte ``ready``; an 8-byte bare
  ``ready`` to every other live rank of another node; and the 8-byte ``released`` to every live rank of
  another node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

import moe_comm  # noqa: E402
from moe_comm import formats  # noqa: E402
from moe_comm.heap.shm import RANKS_PER_NODE_ENV  # noqa: E402
from moe_comm.heap.wire import HEADER, SIGNAL_BYTES  # noqa: E402

VECTOR = 16             # rows are padded to whole 16-byte vectors


def node_limited(g: torch.Generator, tokens: int, experts: int, topk: int, nodes: int, limit: int) -> torch.Tensor:
    """int64 [tokens, topk] distinct expert ids of each token among the experts of ``limit`` nodes chosen at
    random (uniform; the experts spread evenly over ``nodes`` nodes): DeepSeek-V3's node-limited routing."""
    per = experts // nodes
    rows = []
    for _ in range(tokens):
        chosen = torch.randperm(nodes, generator=g)[:limit]
        pool = torch.cat([torch.arange(int(n) * per, (int(n) + 1) * per) for n in chosen])
        rows.append(pool[torch.randperm(pool.numel(), generator=g)[:topk]])
    return torch.stack(rows).reshape(tokens, topk)


def _inputs(args, world):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    if getattr(args, "node_limit", 0):
        idx = [node_limited(g, args.tokens, args.experts, args.topk, args.nodes, args.node_limit)
               for _ in range(world)]
    else:
        idx = [torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(args.tokens)])
               .reshape(args.tokens, args.topk) for _ in range(world)]
    for i in idx:   # a share of the slots not routed (-1)
        i[torch.rand(i.shape, generator=g) < args.unrouted] = -1
    ws = [torch.rand(args.tokens, args.topk, generator=g) for _ in range(world)]
    return xs, idx, ws


def payload_bytes(fmt: str | None, hidden: int) -> int:
    """Bytes of one row's payload in format ``fmt`` (None: bf16): values and scales."""
    fp8 = hidden + 4 * (hidden // 128)   # e4m3 codes, a float32 scale per 128 columns
    return {None: 2 * hidden, "e4m3": fp8, "e4m3-pow2": fp8, "e4m3-ue8m0": hidden + hidden // 128,
            "nvfp4": hidden // 2 + hidden // 16}[fmt]


def dispatch_row_bytes(fmt: str | None, hidden: int, topk: int) -> int:
    """A dispatch row on the wire: payload, K int32 routing words and the token index, padded to 16 bytes."""
    return -(-(payload_bytes(fmt, hidden) + 4 * topk + 4) // VECTOR) * VECTOR


def combine_row_bytes(fmt: str | None, hidden: int) -> int:
    """A combine row on the wire: the payload, padded to 16 bytes."""
    return -(-payload_bytes(fmt, hidden) // VECTOR) * VECTOR


def floor_bytes(idx, rank, world, per_node, experts, row_bytes, out_row_bytes, ctrl_bytes):
    """Floor of rank ``rank``'s cross-node payload bytes and its puts: (dispatch, combine, dispatch puts,
    combine puts), as the module docstring defines them; ``ctrl_bytes`` = the control words and the flag of
    one (source, destination) pair."""
    per_rank = experts // world
    node = [j // per_node for j in range(world)]
    dispatch = combine = dispatch_puts = combine_puts = 0
    for d in range(world):
        if node[d] == node[rank]:
            continue
        owners = idx[rank] // per_rank
        rows, slots = int((owners == d).any(dim=1).sum()), int((idx[d] // per_rank == rank).sum())
        dispatch += rows * row_bytes + ctrl_bytes
        combine += slots * out_row_bytes + SIGNAL_BYTES
        dispatch_puts += (rows > 0) + 1
        combine_puts += slots > 0
    return dispatch, combine, dispatch_puts, combine_puts


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
    fd, fc, pd, pc = floor_bytes(idx, me, world, args.ranks_per_node, args.experts, row_bytes, out_row_bytes,
                                 p.dispatch_ctrl_words * 8)
    ep.close()
    diff = lambda a, b, key: b.get(key, 0) - a.get(key, 0)  # noqa: E731
    return dict(rank=me, dispatch_wire=diff(before, mid, "payload"), dispatch_floor=fd,
                dispatch_messages=diff(before, mid, "messages"), combine_wire=diff(mid, after, "payload"),
                combine_floor=fc, combine_messages=diff(mid, after, "messages"),
                dispatch_puts=diff(before, mid, "puts"), dispatch_puts_floor=pd, combine_puts=diff(mid, after, "puts"),
                combine_puts_floor=pc, headers=diff(before, after, "bytes") - diff(before, after, "payload"),
                row_bytes=row_bytes, out_row_bytes=out_row_bytes, plan_row_bytes=p.row_words * 4,
                plan_out_row_bytes=p.combine_words * 4)


def _reach(idx: torch.Tensor, per_rank: int, ranks) -> int:
    """Tokens of ``idx`` [T, K] with a valid expert on one of ``ranks``."""
    owner = torch.where(idx >= 0, idx // per_rank, -1)
    return int(torch.isin(owner, torch.tensor(list(ranks))).any(dim=1).sum())


def prefill_floor_bytes(idx, rank, layout, experts, row_bytes, route_bytes, out_row_bytes, ctrl_bytes, parts):
    """Floor of rank ``rank``'s cross-node payload bytes in one PrefillBuffer call, every rank live (module
    docstring): (dispatch, combine, rows_per_node, rows_per_rank, dispatch puts, combine puts), rows_per_*
    the routed (token, destination) pairs across nodes counted per node and per rank; ``parts``: the puts
    of one (token, node) of the dispatch (2, or 3 with fp8 scales)."""
    world = layout.world
    per_rank, live = experts // world, [True] * world
    me = layout.node(rank)
    dispatch = combine = rows_node = rows_rank = dispatch_puts = combine_puts = 0
    for n in range(layout.nodes):
        if n == me:
            continue
        rail = layout.rail(rank, n, live)
        rows = _reach(idx[rank], per_rank, layout.ranks(n))
        rows_node += rows
        rows_rank += sum(_reach(idx[rank], per_rank, [d]) for d in layout.ranks(n))
        dispatch += rows * (row_bytes + route_bytes) + ctrl_bytes + SIGNAL_BYTES
        dispatch += SIGNAL_BYTES * sum(1 for p in layout.ranks(n) if live[p] and p != rail)
        dispatch_puts += rows * parts + 1
    for s in range(world):
        if layout.node(s) == me or not live[s]:
            continue
        if layout.rail(s, me, live) == rank:
            rows = _reach(idx[s], per_rank, layout.ranks(me))
            combine += rows * out_row_bytes
            combine_puts += rows
        combine += SIGNAL_BYTES + SIGNAL_BYTES   # ready (after the rows, or bare), released
    return dispatch, combine, rows_node, rows_rank, dispatch_puts, combine_puts


def _dequantized(x, scales, gs) -> torch.Tensor:
    """bf16 rows of a dispatch output in any format (the stand-in experts' input)."""
    if gs is not None:
        return moe_comm.reference.dequantize_nvfp4(x, scales, gs).to(torch.bfloat16)
    return (x.float() if scales is None else moe_comm.reference.dequantize_fp8(x, scales)).to(torch.bfloat16)


def _prefill_rank(group, args):
    """One PrefillBuffer dispatch and combine: the wire's payload per op against ``prefill_floor_bytes``,
    and whether the results equal the reference (node order, ``reference.prefill_combine``)."""
    from moe_comm import reference  # noqa: PLC0415
    from moe_comm.topology import node_layout  # noqa: PLC0415
    world, me = group.world_size, group.rank
    xs, idx, ws = _inputs(args, world)
    fmt = args.dispatch_format
    buf = moe_comm.PrefillBuffer(group, args.experts, args.hidden, args.tokens, args.topk, dispatch_format=fmt,
                                 combine_format=args.combine_format)
    gs = reference.nvfp4_global_scale(torch.cat(xs)) if fmt == "nvfp4" else None
    p, wire = buf.plan, group.heap.wire
    before = dict(wire.stats)
    d = buf.dispatch(xs[me], idx[me], ws[me], global_scale=gs)
    mid = dict(wire.stats)
    exp = reference.prefill_dispatch(xs, idx, ws, args.experts, args.tokens, fp8=fmt if p.ep.fp8 else False,
                                     nvfp4_scale=gs)
    v = exp[me]["valid"]
    rows = torch.cat([torch.arange(s * args.tokens, s * args.tokens + int(n))
                      for s, n in enumerate(exp[me]["src_tokens"].tolist())])
    got = [t.clone() for t in (d.src_tokens, d.expert_counts, d.recv_topk_idx[rows], d.recv_topk_weights[rows],
                               d.recv_x[v].view(torch.uint8))] + ([d.recv_scales[v].clone()] if fmt else [])
    part = _dequantized(d.recv_x, d.recv_scales, gs)
    y = buf.combine(part, d.handle)
    after = dict(wire.stats)
    layout = node_layout(group.transports, me)
    parts = [_dequantized(e["x"], e["scales"], gs) for e in exp]
    want = reference.prefill_combine(parts, idx, args.experts, args.tokens, ranks_per_node=layout.ranks_per_node)[me]
    fd, fc, rows_node, rows_rank, pd, pc = prefill_floor_bytes(
        idx, me, layout, args.experts, 4 * (p.ep.x_words + p.ep.scale_words), 4 * p.route_words, 4 * p.ep.out_words,
        8 * (p.count_span + 1), 3 if p.ep.scale_words else 2)
    buf.close()
    e, v = exp[me], exp[me]["valid"]
    ref = [e["src_tokens"], e["expert_counts"], e["topk_idx"][rows], e["topk_weights"][rows],
           e["x"][v].view(torch.uint8)]
    if fmt:
        ref.append(e["scales"][v])
    wrong = [name for name, a, b in zip(("src_tokens", "expert_counts", "topk_idx", "topk_weights", "x", "scales"),
                                        got, ref) if not torch.equal(a.cpu(), b)]
    diff = lambda a, b, key: b.get(key, 0) - a.get(key, 0)  # noqa: E731
    return dict(rank=me, dispatch_wrong=wrong, dispatch_wire=diff(before, mid, "payload"), dispatch_floor=fd,
                dispatch_messages=diff(before, mid, "messages"), combine_wire=diff(mid, after, "payload"),
                combine_floor=fc, combine_messages=diff(mid, after, "messages"),
                dispatch_puts=diff(before, mid, "puts"), dispatch_puts_floor=pd, combine_puts=diff(mid, after, "puts"),
                combine_puts_floor=pc, headers=diff(before, after, "bytes") - diff(before, after, "payload"),
                row_bytes=4 * (p.ep.x_words + p.ep.scale_words), route_bytes=4 * p.route_words,
                out_row_bytes=4 * p.ep.out_words, rows_per_node=rows_node, rows_per_rank=rows_rank,
                exact=not wrong and bool(torch.equal(y, want)))


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--fp8", action="store_true", help="the same as --dispatch-format e4m3")
    ap.add_argument("--dispatch-format", choices=[f for f in formats.DISPATCH_FORMATS if f], default=None)
    ap.add_argument("--combine-format", choices=[f for f in formats.COMBINE_FORMATS if f], default=None)
    ap.add_argument("--unrouted", type=float, default=0.0, help="share of slots set to -1 (not routed)")
    ap.add_argument("--prefill", action="store_true", help="PrefillBuffer (one copy per node) instead of EPBuffer")
    ap.add_argument("--node-limit", type=int, default=0, help="route each token within at most N nodes (0: any)")
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
    return moe_comm.launch(_prefill_rank if args.prefill else _rank, args.nodes * args.ranks_per_node, args,
                           backend="shm", timeout_s=120)


def main(argv=None) -> int:
    args = parse(argv)
    rows = measure(args)
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, T={args.tokens}, hidden={args.hidden}, "
          f"E={args.experts}, top-{args.topk}, {args.dispatch_format or 'bf16'} dispatch, "
          f"{args.combine_format or 'bf16'} combine; "
          f"payload bytes (wire headers: {HEADER.size} B per message, counted apart)")
    print(f"{'rank':>4} {'dispatch floor':>15} {'wire':>10} {'x':>5} {'puts':>9} {'msgs':>5} "
          f"{'combine floor':>14} {'wire':>10} {'x':>5} {'puts':>9} {'msgs':>5} {'headers B':>10}")
    for r in rows:
        print(f"{r['rank']:>4} {r['dispatch_floor']:>15,} {r['dispatch_wire']:>10,} "
              f"{r['dispatch_wire'] / max(1, r['dispatch_floor']):>5.2f} "
              f"{r['dispatch_puts']:>4}/{r['dispatch_puts_floor']:<4} {r['dispatch_messages']:>5} "
              f"{r['combine_floor']:>14,} {r['combine_wire']:>10,} "
              f"{r['combine_wire'] / max(1, r['combine_floor']):>5.2f} "
              f"{r['combine_puts']:>4}/{r['combine_puts_floor']:<4} {r['combine_messages']:>5} {r['headers']:>10,}")
    if args.prefill:
        node, rank = sum(r["rows_per_node"] for r in rows), sum(r["rows_per_rank"] for r in rows)
        print(f"PrefillBuffer rows across nodes: {node} (one per token and node) against {rank} with one copy per "
              f"destination rank: {rank / max(1, node):.2f}x; results exact on every rank: "
              f"{all(r['exact'] for r in rows)}")
    print(json.dumps(dict(op="prefill_wire_bytes" if args.prefill else "wire_bytes", args=vars(args), rows=rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
