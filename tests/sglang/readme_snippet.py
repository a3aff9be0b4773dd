# The SGLang snippet of docs/integrations.md (run by test_readme_snippet): what the plugin does inside an
# SGLang server, on one CPU rank. In a server, SGLang itself calls load_plugins() and create_moe_dispatcher().
import os

import torch

import moe_comm
from moe_comm.serving.ep_group import use_group

os.environ["MOE_COMM_SGLANG"] = "1"             # switch moe-comm on (unset: SGLang's own dispatcher)
os.environ["MOE_COMM_SGLANG_MAX_TOKENS"] = "4"  # tokens per rank per dispatch

from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher import DeepEPLLCombineInput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

(group,) = moe_comm.init(backend="loopback", world_size=1)  # a server uses torch.distributed's world
use_group(group)
load_plugins()  # finds moe-comm's sglang.srt.plugins entry point and hooks the dispatcher factory

config = MoeRunnerConfig(num_experts=8, num_local_experts=8, hidden_size=128, top_k=2,
                         num_fused_shared_experts=0, params_dtype=torch.bfloat16)
dispatcher = create_moe_dispatcher(config, quant_method=None)  # -> MoECommDispatcher
x = torch.randn(4, 128).to(torch.bfloat16)
ids = torch.tensor([[0, 3], [1, 2], [7, -1], [5, 4]])  # -1: slot not routed
weights = torch.rand(4, 2)
out = dispatcher.dispatch(x, StandardTopKOutput(weights, ids, None))  # DeepEPLLDispatchOutput
# out.hidden_states [8 local experts, 4 rows, 128], rows [:out.masked_m[e]] valid; experts: identity
y = dispatcher.combine(DeepEPLLCombineInput(out.hidden_states, ids, weights))
expected = sum(weights[:, k, None] * (ids[:, k, None] >= 0) * x.float() for k in range(2))
assert torch.allclose(y.float(), expected, atol=2e-2), (y, expected)
print(type(dispatcher).__name__, out.masked_m.tolist())
