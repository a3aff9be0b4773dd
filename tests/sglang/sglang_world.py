"""One SGLang process of a CPU world as SGLang's scheduler sets it up, for building SGLang's own model code.

``start(group, a2a)`` in a rank of ``moe_comm.launch`` (whose group bootstrapped torch.distributed over
gloo): SGLang's plugins (moe-comm's entry point among them) loaded as its server loads them, SGLang's
ServerArgs published for this rank (device cpu, tp = ep = world, ``--moe-a2a-backend a2a``), its
distributed environment and model-parallel groups built over that torch.distributed world, and its MoE
flags seeded from the published configuration (``initialize_moe_config``), as its scheduler does before
it builds a model. What it does not set up: tokenizer, KV cache, attention backend, scheduler.
"""

import os

import cpu_shims

cpu_shims.install()


def start(group, a2a: str, max_tokens: int | None = None) -> None:
    """Set this process up as SGLang rank ``group.rank`` of ``group.world_size`` (module doc)."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from moe_comm.serving import ep_group

    if max_tokens is not None:
        os.environ["MOE_COMM_SGLANG_PREFILL_MAX_TOKENS"] = str(max_tokens)
    ep_group.use_group(group)   # moe-comm's group over this world (a server makes it over torch.distributed)
    load_plugins()
    world, rank = group.world_size, group.rank
    args = ServerArgs(model_path="dummy", device="cpu", tp_size=world, ep_size=world, moe_a2a_backend=a2a)
    publish(args, role="test", ranks=SpawnRanks(world_rank=rank))
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    initialize_model_parallel(backend="gloo")
    initialize_moe_config()
