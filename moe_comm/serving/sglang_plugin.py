"""SGLang plugin (entry point ``sglang.srt.plugins``: ``moe_comm = moe_comm.serving.sglang_plugin:register``).

Installed with moe-comm, SGLang calls ``register()`` in every process at start-up (``load_plugins()``,
before it parses its arguments). SGLang 0.5.23 selects third-party token dispatchers with its
``customized`` all-to-all backend (``MoeA2ABackend.CUSTOMIZED``) and leaves the dispatcher to a plugin:
its factory ``create_moe_dispatcher`` has no branch for it (it raises ``NotImplementedError("Unsupported
a2a backend: MoeA2ABackend.CUSTOMIZED")``). The plugin registers, through SGLang's ``HookRegistry``:

- an AROUND hook on that factory
  (``sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher``): under
  ``--moe-a2a-backend customized`` every MoE layer gets ``MoECommStandardDispatcher``
  (moe_comm.serving.sglang_standard: SGLang's Standard format, which its default expert runners take,
  on a PrefillBuffer); with ``MOE_COMM_SGLANG=1`` under ``--moe-a2a-backend deepep`` it gets
  ``MoECommDispatcher`` (moe_comm.serving.sglang: the DeepEP formats, for DeepEP's expert kernels, per
  ``--deepep-mode``); otherwise SGLang's own dispatcher;
- an AFTER hook on ``ServerArgs.add_cli_args`` that adds ``customized`` to the choices of
  ``--moe-a2a-backend``: SGLang's enum and its ``ServerArgs(moe_a2a_backend="customized")`` (the Python
  API, ``sglang.Engine``) accept it, but 0.5.23's command line lists every backend except it.

Why the DeepEP path stays: under ``customized`` SGLang's models and experts run their non-DeepEP path
(Standard format); DeepEP's layouts (the low-latency expert-major layout, CUDA-graph capturable, and fp8
dispatch) reach SGLang's DeepEP expert kernels only under ``--moe-a2a-backend deepep``, where SGLang's
factory builds its own DeepEP dispatcher: the environment switch replaces it there.

``MOE_COMM_SGLANG=0`` registers nothing (``customized`` is then left to another plugin). Options:
moe_comm.serving.sglang.env_options. Examples::

    sglang serve --model-path MODEL --tp 8 --ep-size 8 --enable-dp-attention --dp 8 \\
        --moe-a2a-backend customized
    MOE_COMM_SGLANG=1 python -m sglang.launch_server --model-path MODEL --tp 8 --ep-size 8 \\
        --moe-a2a-backend deepep --deepep-mode auto
"""

from __future__ import annotations

import logging

from .sglang import env_options, options_from_env, switch_from_env

logger = logging.getLogger(__name__)

_registered = False
TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"
CLI_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
A2A_OPTION = "--moe-a2a-backend"
CUSTOMIZED = "customized"   # SGLang's MoeA2ABackend.CUSTOMIZED.value


def _customized() -> bool:
    """Whether SGLang's resolved all-to-all backend is ``customized``."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend  # noqa: PLC0415
    return get_moe_a2a_backend().is_customized()


def create_moe_dispatcher(original, moe_runner_config, *args, **kwargs):
    """AROUND hook of SGLang's factory: moe-comm's dispatcher under ``customized`` or MOE_COMM_SGLANG=1,
    SGLang's own otherwise."""
    from .sglang import make_dispatcher  # noqa: PLC0415
    if _customized():
        return make_dispatcher(moe_runner_config, env_options(), customized=True)
    options = options_from_env()
    if options is None:
        return original(moe_runner_config, *args, **kwargs)
    return make_dispatcher(moe_runner_config, options)


def accept_customized(result, parser, *args, **kwargs):
    """AFTER hook of ``ServerArgs.add_cli_args(parser)``: ``customized`` among --moe-a2a-backend's choices.
    argparse keeps an option's choices on its action (``parser._option_string_actions``, the one table
    argparse has from an option string to its action)."""
    action = parser._option_string_actions.get(A2A_OPTION)
    if action is not None and action.choices is not None and CUSTOMIZED not in action.choices:
        action.choices = [*action.choices, CUSTOMIZED]
    return result


def register() -> None:
    """Register both hooks (SGLang applies them after loading every plugin), unless MOE_COMM_SGLANG=0."""
    if switch_from_env() is False:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    global _registered
    if _registered:
        return  # idempotent: SGLang applies each registration, so register once per process
    HookRegistry.register(TARGET, create_moe_dispatcher, HookType.AROUND)
    HookRegistry.register(CLI_TARGET, accept_customized, HookType.AFTER)
    _registered = True
    logger.info("moe-comm: SGLang MoE dispatcher hooked (--moe-a2a-backend customized%s)",
                ", and deepep: MOE_COMM_SGLANG=1" if switch_from_env() else "")
