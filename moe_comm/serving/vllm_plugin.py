"""vLLM plugin (entry point ``vllm.general_plugins``: ``moe_comm = moe_comm.serving.vllm_plugin:register``).

Installed with moe-comm, vLLM calls ``register()`` in every process at start-up. It changes nothing
unless the engine was started with a ``moe_comm`` section in its additional config, e.g.::

    vllm serve MODEL --enable-expert-parallel --data-parallel-size 8 \
        --additional-config '{"moe_comm": {"backend": "auto"}}'

Then every MoE layer that runs expert parallel with an all-to-all (EP with DP > 1) gets moe-comm's
prepare/finalize (moe_comm.serving.vllm) instead of vLLM's own all2all backend, of the option ``mode``:
"low_latency" (the default: ``MoECommPrepareAndFinalize`` on an EPBuffer, and vLLM picks experts of the
BatchedExperts activation format), "high_throughput" (``MoECommStandardPrepareAndFinalize`` on a
PrefillBuffer, Standard-format experts) or "auto" (from ``--all2all-backend``, as vLLM picks its own:
``moe_comm.serving.vllm.resolve_mode``). A disaggregated deployment gives its prefill engines
``{"moe_comm": {"mode": "high_throughput"}}`` and its decode engines ``{"moe_comm": {}}``. Other
options: see ``moe_comm.serving.vllm.make_prepare_finalize``.

vLLM 0.32 and 0.33 have no registry for prepare/finalize implementations, so the hook wraps
``all2all_utils.maybe_make_prepare_finalize`` (where vLLM builds them, and every module that imported it)
and ``FusedMoEParallelConfig.use_batched_activation_format`` (what the kernel oracles read to choose the
experts' format). Both fall through to vLLM's own code when moe-comm is not requested. On vLLM's CPU build
it also offers the unquantized experts oracle ``moe_comm.serving.vllm_cpu``'s BatchedExperts experts
(``oracle.unquantized.backend_to_kernel_cls`` for the CPU backend), which low-latency mode needs there;
they decline unless moe-comm is requested and the format is BatchedExperts.

A fault (a dead or stuck peer, a bad expert id) recorded by moe-comm's kernels in one step is raised by
name (CommTimeoutError, ...) at the next MoE layer's prepare, so vLLM's worker stops on it; the group
stays failed until ``moe_comm.serving.ep_group.recover()`` on every live rank (reset, or exclude a dead rank).
vLLM's own fault tolerance (0.32: ``--enable-fault-tolerance`` with ``--all2all-backend deepep_low_latency``,
whose all2all manager vLLM still builds, so DeepEP must be importable) asks that manager ``query_fault()``
after every step, ``query_active_mask()`` and, on retry, ``clean_buffers()``: with moe-comm requested the
hook answers them from moe-comm's exclusion (``ep_group.query_fault`` / ``query_active_mask`` /
``clean_buffers``: the mask is the group's excluded ranks, and the retry recovers, excluding a dead rank).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

logger = logging.getLogger(__name__)

_A2A_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
_ALL2ALL = "vllm.distributed.device_communicators.all2all"
# vLLM's fault-tolerant all2all managers (its --all2all-backend deepep_low_latency with
# --enable-fault-tolerance) and the fault queries its model runner and sentinel call on them
FT_MANAGERS = ("DeepEPLLAll2AllManager",)
FT_METHODS = ("query_active_mask", "query_fault", "clean_buffers")
_MOE_CONFIG = "vllm.model_executor.layers.fused_moe.config"
_UNQUANTIZED_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
CONFIG_KEY = "moe_comm"


def requested_options() -> dict | None:
    """The ``moe_comm`` section of the current vLLM config's additional_config (``{}`` for ``true``),
    or None when moe-comm was not requested (or no vLLM config is current)."""
    config_module = importlib.import_module("vllm.config")
    get = getattr(config_module, "get_current_vllm_config_or_none", None)
    try:
        config = get() if get is not None else config_module.get_current_vllm_config()
    except AssertionError:
        config = None
    extra = getattr(config, "additional_config", None)
    if not isinstance(extra, dict) or not extra.get(CONFIG_KEY):
        return None
    section = extra[CONFIG_KEY]
    return dict(section) if isinstance(section, dict) else {}


def _wrap_maybe_make_prepare_finalize(original):
    @functools.wraps(original)
    def maybe_make_prepare_finalize(*args, **kwargs):
        moe = kwargs["moe"] if "moe" in kwargs else args[0]
        quant_config = kwargs["quant_config"] if "quant_config" in kwargs else args[1]
        options = requested_options()
        if (options is not None and moe.moe_parallel_config.use_all2all_kernels
                and not kwargs.get("use_monolithic", False)):
            from .vllm import make_prepare_finalize  # noqa: PLC0415
            return make_prepare_finalize(moe, quant_config, options)
        return original(*args, **kwargs)

    maybe_make_prepare_finalize.moe_comm_original = original
    return maybe_make_prepare_finalize


def _wrap_batched_format(original: property) -> property:
    def use_batched_activation_format(self) -> bool:
        options = requested_options()
        if options is None or not self.use_all2all_kernels:
            return original.fget(self)
        from .vllm import resolve_mode  # noqa: PLC0415
        return resolve_mode(options, getattr(self, "all2all_backend", None)) == "low_latency"

    use_batched_activation_format.moe_comm_original = original
    return property(use_batched_activation_format)


def _wrap_fault_query(name: str, original):
    """vLLM's all2all-manager method ``name`` answered by moe-comm's exclusion (``ep_group.<name>``) when
    moe-comm is requested; vLLM's own otherwise."""
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if requested_options() is None:
            return original(self, *args, **kwargs)
        from . import ep_group  # noqa: PLC0415
        return getattr(ep_group, name)(*args, **kwargs)

    method.moe_comm_original = original
    return method


def _hook_fault_queries() -> None:
    """Answer vLLM's fault-tolerance queries from moe-comm (where this vLLM has them: 0.32 has)."""
    try:
        all2all = importlib.import_module(_ALL2ALL)
    except ImportError:
        return
    for cls in (getattr(all2all, n, None) for n in FT_MANAGERS):
        for name in FT_METHODS:
            original = getattr(cls, name, None) if cls is not None else None
            if original is not None and not hasattr(original, "moe_comm_original"):
                setattr(cls, name, _wrap_fault_query(name, original))


def _wrap_backend_to_kernel_cls(original, cpu_backend):
    """The oracle's candidates for vLLM's CPU backend, with moe-comm's BatchedExperts experts first
    (``moe_comm.serving.vllm_cpu``): vLLM-CPU has none of that format; ours declines every other format
    and any engine that did not request moe-comm, so vLLM's own CPU experts serve those as before."""
    @functools.wraps(original)
    def backend_to_kernel_cls(backend):
        classes = original(backend)
        if backend != cpu_backend:
            return classes
        from .vllm_cpu import batched_experts_class  # noqa: PLC0415
        return [batched_experts_class(), *classes]

    backend_to_kernel_cls.moe_comm_original = original
    return backend_to_kernel_cls


def register() -> None:
    """Install the hook (idempotent: vLLM may load plugins more than once per process)."""
    try:
        a2a_utils = importlib.import_module(_A2A_UTILS)
        moe_config = importlib.import_module(_MOE_CONFIG)
    except ImportError as e:  # a vLLM without the modular MoE kernel
        logger.warning("moe-comm: vLLM plugin not installed (%s)", e)
        return
    original = a2a_utils.maybe_make_prepare_finalize
    if not hasattr(original, "moe_comm_original"):
        wrapped = _wrap_maybe_make_prepare_finalize(original)
        for module in list(sys.modules.values()):  # modules that did `from all2all_utils import ...`
            if getattr(module, "__name__", "").startswith("vllm") and \
                    getattr(module, "maybe_make_prepare_finalize", None) is original:
                module.maybe_make_prepare_finalize = wrapped
    try:   # vLLM's unquantized experts oracle (0.32, 0.33): where CPU experts are picked
        oracle = importlib.import_module(_UNQUANTIZED_ORACLE)
    except ImportError as e:
        logger.debug("moe-comm: no unquantized MoE oracle to extend (%s)", e)
        oracle = None
    cpu = getattr(getattr(oracle, "UnquantizedMoeBackend", None), "CPU", None)
    pick = getattr(oracle, "backend_to_kernel_cls", None)
    if cpu is not None and pick is not None and not hasattr(pick, "moe_comm_original"):
        oracle.backend_to_kernel_cls = _wrap_backend_to_kernel_cls(pick, cpu)
    cls = moe_config.FusedMoEParallelConfig
    prop = cls.__dict__.get("use_batched_activation_format")
    if isinstance(prop, property) and not hasattr(prop.fget, "moe_comm_original"):
        cls.use_batched_activation_format = _wrap_batched_format(prop)
    _hook_fault_queries()
