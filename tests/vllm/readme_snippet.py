# The vLLM snippet of docs/integrations.md (run by test_readme_snippet): the prepare/finalize that the plugin
# gives vLLM's modular MoE kernel, on one CPU rank. In a server, vLLM builds it from its MoE config.
import torch

import moe_comm
from moe_comm.ep import EPBuffer
from moe_comm.serving.vllm import prepare_finalize_class
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

(group,) = moe_comm.init(backend="loopback", world_size=1)  # a server uses torch.distributed's world
pf = prepare_finalize_class()(EPBuffer(group, num_experts=8, hidden=128, max_tokens_per_rank=4, topk=2))
x = torch.randn(4, 128).to(torch.bfloat16)
ids = torch.tensor([[0, 3], [1, 2], [7, -1], [5, 4]])  # -1: slot not routed
weights = torch.rand(4, 2)
a, scales, meta, _, _ = pf.prepare(x, weights, ids, 8, None, False, FUSED_MOE_UNQUANTIZED_CONFIG, False)
# a [8 local experts, 4 rows, 128], rows [:meta.expert_num_tokens[e]] valid; experts: identity
out = torch.empty_like(x)
pf.finalize(out, a, weights, ids, False, TopKWeightAndReduceDelegate())  # writes out, returns None
expected = sum(weights[:, k, None] * (ids[:, k, None] >= 0) * x.float() for k in range(2))
assert torch.allclose(out.float(), expected, atol=2e-2), (out, expected)
print(type(pf).__name__, meta.expert_num_tokens.tolist())
