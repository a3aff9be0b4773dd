"""SGLang plugin (entry point ``sglang.srt.plugins``: ``moe_comm = moe_comm.serving.sglang_plugin:register``).

Installed with moe-comm, SGLang calls ``register()`` in every process at start-up. It changes nothing
unless ``MOE_COMM_SGLANG=1`` is set in the environment of the server, e.g.::

    MOE_COMM_SGLANG=1 python -m sglang.launch_server --model-path MODEL --tp 8 --ep-size 8 \
        --moe-a2a-backend deepep --deepep-mode auto

Then SGLang's MoE dispatcher factory
(``sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher``) is wrapped through SGLang's
``HookRegistry`` so that every MoE layer gets ``MoECommDispatcher`` (moe_comm.serving.sglang), which
produces the DeepEP formats that the deepep backend's expert kernels take, per ``--deepep-mode``:
low_latency (EPBuffer), normal (PrefillBuffer) or auto (normal for batches with prefill tokens, low
latency for decode, as SGLang's DeepEP dispatcher switches); more options in
``moe_comm.serving.sglang.options_from_env``. SGLang 0.5.23 lists ``customized`` among its a2a backends
but its command line does not accept it, hence the environment switch.
"""

from __future__ import annotations

import logging

from .sglang import options_from_env

logger = logging.getLogger(__name__)

_registered = False
TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"


def create_moe_dispatcher(original, moe_runner_config, *args, **kwargs):
    """AROUND hook of SGLang's factory: moe-comm's dispatcher when requested, SGLang's own otherwise."""
    options = options_from_env()
    if options is None:
        return original(moe_runner_config, *args, **kwargs)
    from .sglang import make_dispatcher  # noqa: PLC0415
    return make_dispatcher(moe_runner_config, options)


def register() -> None:
    """Register the hook when MOE_COMM_SGLANG=1 (SGLang applies it after loading every plugin)."""
    if options_from_env() is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    global _registered
    if _registered:
        return  # idempotent: SGLang applies each registration, so register once per process
    HookRegistry.register(TARGET, create_moe_dispatcher, HookType.AROUND)
    _registered = True
    logger.info("moe-comm: SGLang MoE dispatcher hooked (MOE_COMM_SGLANG=1)")
