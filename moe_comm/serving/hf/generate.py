"""``python -m moe_comm generate``: a tiny random transformers MoE model generates through moe-comm on N
ranks, each rank its own prompts, and the tokens are printed beside transformers' own ("eager" experts,
one process, the same prompts). Exit status 1 if any token differs.

    python -m moe_comm generate [--family qwen3_moe|mixtral|deepseek_v3|gpt_oss] [--world 2]
                                [--new-tokens 8] [--dtype float32|bfloat16] [--layers 2]
                                [--layer-path unfused|fused|auto]

Runs on the shm heap in N local processes (on a machine without CUDA, moe-comm's kernels run in Triton's
interpreter). Rank r's prompts differ in length (left-padded into one batch); the last rank has fewer.
"""

from __future__ import annotations

import argparse
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD = 0   # the tiny configs' pad token id (prompts never contain it)
# Small on purpose: the prompts (a few tokens each) go through the PrefillBuffer in two chunks per layer,
# the one-token decode steps through the EPBuffer, so the demo runs both paths.
DEMO_DECODE_TOKENS = 4
DEMO_PREFILL_TOKENS = 6


def prompts_for(rank: int, world: int, seed: int = 0, vocab: int | None = None) -> list[list[int]]:
    """Rank ``rank``'s prompts: two of different lengths (the last rank of a multi-rank world: one),
    lengths and tokens different on every rank."""
    from .tiny import VOCAB  # noqa: PLC0415
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = 1 if world > 1 and rank == world - 1 else 2
    return [torch.randint(1, vocab or VOCAB, (3 + 2 * i + rank,), generator=g).tolist() for i in range(n)]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, longest]: prompts padded on the left with PAD, as generate wants."""
    S = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (S - len(p)) + p for p in prompts])
    return ids, (ids != PAD).long()


def generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation of ``new_tokens`` per prompt -> (tokens int64 [B, new_tokens], logits float32
    [new_tokens, B, vocab]: row s chose tokens[:, s]), both on the model's device."""
    ids, mask = (t.to(model.device) for t in left_padded(prompts))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack([lg.float() for lg in out.logits])


def rank_generate(group, family: str, dtype: str, new_tokens: int, layers: int, prompts: list[list[int]],
                  options: dict | None = None, seed: int = 0) -> dict:
    """One rank: the tiny model with experts_implementation="moe_comm", sharded on ``group``, generates for
    ``prompts`` (none: the rank only takes part), then ``finish``. Returns tokens, logits, the ShardReport
    and the seconds generation took."""
    from . import finish, shard_experts  # noqa: PLC0415
    from .tiny import tiny_model  # noqa: PLC0415
    torch.set_num_threads(1)
    model = tiny_model(family, DTYPES[dtype], seed, experts_implementation="moe_comm", layers=layers)
    report = shard_experts(model, group, **(options or {}))
    door = model._moe_comm_door
    t0 = time.perf_counter()
    tokens = logits = None
    if prompts:
        tokens, logits = generate(model, prompts, new_tokens)
    finish(model)
    return dict(tokens=tokens, logits=logits, report=report, seconds=time.perf_counter() - t0, taken=dict(door.taken))


def eager_generate(family: str, dtype: str, new_tokens: int, layers: int, prompts: list[list[int]], seed: int = 0):
    """transformers' own run of the same prompts in this process ("eager" experts, every expert here)."""
    from .tiny import tiny_model  # noqa: PLC0415
    if not prompts:
        return None, None
    return generate(tiny_model(family, DTYPES[dtype], seed, layers=layers), prompts, new_tokens)


def main(argv=None) -> int:
    from .tiny import FAMILIES  # noqa: PLC0415
    ap = argparse.ArgumentParser(prog="moe-comm generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_moe", choices=FAMILIES)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=DEMO_DECODE_TOKENS,
                    help="steps with at most this many tokens per rank go through the EPBuffer (shard_experts)")
    ap.add_argument("--prefill-tokens", type=int, default=DEMO_PREFILL_TOKENS,
                    help="the PrefillBuffer's tokens per rank per chunk (larger steps: several chunks)")
    ap.add_argument("--layer-path", default="unfused", choices=("unfused", "fused", "auto"),
                    help="decode steps through the EPBuffer (unfused) or the fused MoELayer (shard_experts)")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    import moe_comm  # noqa: PLC0415
    prompts = [prompts_for(r, a.world) for r in range(a.world)]
    print(f"transformers {a.family} (tiny, random weights, {a.layers} layers, 8 experts, top-2, {a.dtype}) on "
          f"{a.world} ranks through moe-comm (experts_implementation='moe_comm'), {a.new_tokens} greedy tokens per "
          f"prompt; beside it transformers' own run (experts_implementation='eager', one process)")
    t0 = time.perf_counter()
    ranks = moe_comm.launch(_launched, a.world, a, prompts, timeout_s=a.timeout_s)
    took = time.perf_counter() - t0
    rep = ranks[0]["report"]
    print(f"each rank holds experts {rep.experts[1] - rep.experts[0]} of 8 per layer: {rep.expert_bytes_after:,} of "
          f"{rep.expert_bytes_before:,} bytes of expert weights ({took:.0f} s, Triton interpreter on CPU)"
          if not torch.cuda.is_available() else f"({took:.0f} s)")
    t = ranks[0]["taken"]
    if rep.fused_layers or a.layer_path != "unfused":
        print(f"layer_path={a.layer_path!r}: {rep.fused_layers} of {rep.layers} MoE layers' decode steps through "
              f"the fused MoELayer" + (f" (the others unfused: {rep.unfused_why})" if rep.unfused_why else ""))
    print(f"steps: {t['prefill']} prefill-size (more than {a.decode_tokens} tokens on a rank: PrefillBuffer, "
          f"{t['chunks']} chunk(s) of at most {a.prefill_tokens} tokens per layer), {t['decode']} decode-size "
          f"({'fused MoELayer' if rep.fused_layers == rep.layers else 'EPBuffer'})")
    ok = True
    for r, res in enumerate(ranks):
        want, _ = eager_generate(a.family, a.dtype, a.new_tokens, a.layers, prompts[r])
        for i, p in enumerate(prompts[r]):
            got_i, want_i = res["tokens"][i].tolist(), want[i].tolist()
            same = got_i == want_i
            ok &= same
            print(f"rank {r} prompt {i} ({len(p)} tokens)\n  moe-comm     {got_i}\n  transformers {want_i}  "
                  f"{'identical' if same else 'DIFFERENT'}")
    print("tokens identical to transformers' on every rank" if ok else "TOKENS DIFFER")
    return 0 if ok else 1


def _launched(group, a, prompts):
    return rank_generate(group, a.family, a.dtype, a.new_tokens, a.layers, prompts[group.rank],
                         dict(decode_tokens=a.decode_tokens, prefill_tokens=a.prefill_tokens, layer_path=a.layer_path))


if __name__ == "__main__":
    raise SystemExit(main())
