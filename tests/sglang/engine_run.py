"""A live SGLang engine on CPU: ``python engine_run.py MODEL_DIR OUT_JSON A2A TP [PROMPT_JSON]``.

Starts ``sglang.Engine`` (its tokenizer manager, data-parallel controller and one scheduler process per
rank, as a server does) on the model in MODEL_DIR with tp = ep = TP, ``moe_a2a_backend=A2A``, its CPU
engine (SGLANG_USE_CPU_ENGINE=1, set by the caller with SGLANG_CPU_OMP_THREADS_BIND), torch-native
attention, no CUDA graphs, prompts as token ids; generates greedily and writes each prompt's output ids
to OUT_JSON. SGLang loads moe-comm's plugin itself (entry point). The scheduler processes are spawned and
import this file as their main module, so the placeholders of cpu_shims.install_cpu_engine reach them.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_shims  # noqa: E402

cpu_shims.install_cpu_engine()

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]   # token ids, different lengths
NEW_TOKENS = 8
MEM_FRACTION = 0.05   # of host memory for SGLang's KV cache (its CPU engine sizes it from free memory)


def main(model_dir: str, out_json: str, a2a: str, tp: int) -> None:
    import sglang

    extra = dict(ep_size=tp) if tp > 1 else {}
    engine = sglang.Engine(model_path=model_dir, device="cpu", dtype="float32", tp_size=tp,
                           moe_a2a_backend=a2a, attention_backend="torch_native", disable_cuda_graph=True,
                           skip_tokenizer_init=True, mem_fraction_static=MEM_FRACTION, random_seed=0,
                           log_level="info", **extra)
    try:
        out = engine.generate(input_ids=PROMPTS, sampling_params=dict(max_new_tokens=NEW_TOKENS, temperature=0))
    finally:
        engine.shutdown()
    with open(out_json, "w") as f:
        json.dump([o["output_ids"] for o in out], f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
