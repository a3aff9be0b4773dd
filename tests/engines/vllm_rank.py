"""One data-parallel rank of vLLM's engine (``tests/engines/test_vllm_engine.py`` starts two).

Usage: vllm_rank.py MODEL_DIR MODE PROMPTS_JSON OUT_JSON MAX_TOKENS, with VLLM_DP_RANK, VLLM_DP_RANK_LOCAL,
VLLM_DP_SIZE, VLLM_DP_MASTER_IP, VLLM_DP_MASTER_PORT set by the caller. Generates greedily for this
rank's prompts (lists of token ids) through vLLM's offline ``LLM`` with expert parallelism and moe-comm's
plugin in mode MODE, writes ``{"tokens": [[...], ...], "prepare_finalize": ..., "experts": ...}`` to
OUT_JSON, then leaves at once: vLLM's data-parallel engine processes do not exit after ``generate``, so
the caller ends this process's group.
"""

import json
import os
import sys


def main():
    model, mode, prompts, out, max_tokens = sys.argv[1:6]
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
              enable_expert_parallel=True, additional_config={"moe_comm": {"mode": mode}}, seed=0)
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True, detokenize=False)
    with open(prompts) as f:
        prompt_ids = json.load(f)
    results = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"tokens": tokens}, f)
    os.replace(tmp, out)   # the caller sees the whole file or none
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
