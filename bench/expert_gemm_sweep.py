"""Masked expert GEMM (``moe_comm.serving.experts.masked_bmm_kernel``) at decode shapes, over tile sizes,
pipeline stages and warps: p50 µs (``triton.testing.do_bench``) and GB/s of the active experts' weights
(the bytes the kernel cannot avoid), with the max abs error against torch in float32. GPU only.

    python bench/expert_gemm_sweep.py > gemm_sweep.jsonl

Shapes: DeepSeek-V3 (256 experts, hidden 7168, width 2048) with 8 rows on all 256 experts (batch 256,
top-8) and 1 row on 128 experts; Llama-4-Scout (16 experts, 5120, 8192) with 4 rows on all 16 (batch 64)
and 1 row on one expert (batch 1). cfg = (BM, BN, BK, num_stages, num_warps); the serving default is
(16, 64, 64, 3, 4).
"""

import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_comm.serving.experts import masked_bmm_kernel  # noqa: E402

SHAPES = [("dsv3 b256", 256, 7168, 2048, 8, 256), ("dsv3 b16", 256, 7168, 2048, 1, 128),
          ("scout b64", 16, 5120, 8192, 4, 16), ("scout b1", 16, 5120, 8192, 1, 1)]
CONFIGS = [(16, 64, 64, 3, 4), (16, 64, 64, 4, 4), (16, 128, 64, 3, 4), (16, 128, 64, 4, 4), (16, 64, 128, 3, 4),
           (16, 128, 128, 3, 8), (16, 256, 64, 3, 8), (16, 128, 64, 5, 4), (16, 64, 256, 3, 4), (16, 128, 128, 4, 4)]


def run(E, H, inter, rows_per_expert, active, cfg, gated, dev="cuda"):
    K, N = (H, inter) if gated else (inter, H)
    R = max(rows_per_expert, 1)
    a = torch.randn(E, R, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * 0.02
    b2 = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * 0.02 if gated else b
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    counts[:active] = rows_per_expert
    c = torch.empty(E, R, N, device=dev, dtype=torch.bfloat16)
    BM, BN, BK, stages, warps = cfg

    def launch():
        masked_bmm_kernel[(triton.cdiv(N, BN), active)](
            a, b, b2, c, counts, R, K, N, E, *a.stride(), *b.stride(), *c.stride(), GATED=gated, BM=BM, BN=BN,
            BK=BK, E_P2=triton.next_power_of_2(E), PRECISION="tf32", num_stages=stages, num_warps=warps)
    launch()
    torch.cuda.synchronize()
    ref = torch.bmm(a[:active].float(), b[:active].float())
    if gated:
        ref = torch.nn.functional.silu(ref) * torch.bmm(a[:active].float(), b2[:active].float())
    err = (c[:active, :rows_per_expert].float() - ref[:, :rows_per_expert]).abs().max().item()
    ms = triton.testing.do_bench(launch, warmup=10, rep=50)
    weight_bytes = active * K * N * 2 * (2 if gated else 1)
    return ms * 1e3, weight_bytes / (ms * 1e-3) / 1e9, err


def main():
    for name, E, H, inter, rows, active in SHAPES:
        for gated in (True, False):
            for cfg in CONFIGS:
                try:
                    us, gbps, err = run(E, H, inter, rows, active, cfg, gated)
                    line = dict(shape=name, gated=gated, cfg=cfg, us=round(us, 1), GBps=round(gbps), err=err)
                except Exception as ex:  # a config that does not compile is reported, not fatal
                    line = dict(shape=name, gated=gated, cfg=cfg, error=str(ex)[:200])
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
