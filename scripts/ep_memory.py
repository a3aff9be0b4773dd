"""EPBuffer memory for a decode shape against DeepEP's low-latency buffer, computed without allocating.

    python scripts/ep_memory.py                       # DeepSeek-V3: 256 experts, hidden 7168, top-8, 128 tokens, EP8
    python scripts/ep_memory.py --experts 128 --hidden 4096 --topk 8 --tokens 256 --world 16

Prints each term of the formula (``moe_comm.planner.EPPlan``) for bf16 and fp8 dispatch, the total per
GPU, and the ratio to ``deepep_low_latency_bytes`` (DeepEP's ``get_low_latency_rdma_size_hint``). DeepEP
allocates its dispatch outputs per call on top of that figure; ours are included in ours. Exits 1 if a
total exceeds half of DeepEP's figure.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moe_comm.planner import deepep_low_latency_bytes, numel, plan_ep

GIB = 2 ** 30


def breakdown(p) -> list[tuple[str, int]]:
    L, cap = p.experts_per_rank, p.capacity
    return [
        ("symmetric: dispatch landing 2*W*M*(p + 4K)", 4 * numel(p.dispatch_data_shape)),
        ("symmetric: combine landing  2*M*K*H*b", 4 * numel(p.combine_data_shape)),
        ("symmetric: control words",
         p.symmetric_bytes - 4 * (numel(p.dispatch_data_shape) + numel(p.combine_data_shape))),
        ("local: d.x (+ d.scales)     L*W*M*p", L * cap * 4 * (p.x_words + p.scale_words)),
        ("local: metadata, counters", p.local_bytes - L * cap * 4 * (p.x_words + p.scale_words)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens_per_rank")
    ap.add_argument("--world", type=int, default=8)
    a = ap.parse_args(argv)
    deepep = deepep_low_latency_bytes(a.tokens, a.hidden, a.world, a.experts)
    print(f"shape: {a.experts} experts, hidden {a.hidden}, top-{a.topk}, {a.tokens} tokens per rank, EP{a.world}")
    print(f"DeepEP low-latency buffer: {deepep:>14,d} B = {deepep / GIB:.3f} GiB (dispatch outputs extra)")
    ok = True
    for fp8 in (False, True):
        p = plan_ep(a.world, a.experts, a.hidden, a.tokens, a.topk, torch.bfloat16, fp8, "cuda")
        print(f"\nEPBuffer, {'fp8' if fp8 else 'bf16'} dispatch (bf16 combine):")
        for name, b in breakdown(p):
            print(f"  {name:<44} {b:>14,d} B")
        total = p.buffer_bytes
        ok &= total <= deepep / 2
        print(f"  {'total buffer_bytes':<44} {total:>14,d} B = {total / GIB:.3f} GiB "
              f"= {total / deepep:.1%} of DeepEP (bound: 50%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
