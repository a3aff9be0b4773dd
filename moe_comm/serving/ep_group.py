"""The CommGroup and EPBuffers a serving framework's MoE layers share within one process.

Serving frameworks build one dispatcher per MoE layer; moe-comm gives them one CommGroup per process
(over torch.distributed's default group, created on first use) and one EPBuffer (decode) or PrefillBuffer
(prefill) per distinct layer shape (layers with the same shapes share it). Used by the vLLM
adapter (moe_comm.serving.vllm) and the SGLang dispatcher (moe_comm.serving.sglang).
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["check_group", "clean_buffers", "expose_metrics", "process_group", "query_active_mask", "query_fault",
           "recover", "shared_buffer", "use_group"]

logger = logging.getLogger(__name__)

ENV_METRICS = "MOE_COMM_METRICS"            # "0" / "off": the adapters export no metrics
ENV_METRICS_PORT = "MOE_COMM_METRICS_PORT"  # P: each rank also serves moe_comm.metrics on port P + rank

_GROUP = None
_BUFFERS: dict[tuple, object] = {}
_METRICS_EXPOSED = False
_MASK = None       # int32 [world] on the device: the excluded-rank mask query_active_mask fills
_BASELINE = None   # the mask at the last recovery point (clean_buffers), what query_fault compares with


def use_group(group) -> None:
    """Use ``group`` instead of creating this process's own CommGroup (and forget the buffers made on
    the previous one)."""
    global _GROUP, _MASK, _BASELINE
    _GROUP = group
    _BUFFERS.clear()
    _MASK = _BASELINE = None


def process_group(backend: str = "auto", timeout_s: float = 30.0):
    """This process's CommGroup: the one given to ``use_group``, else ``moe_comm.init(backend)`` over
    torch.distributed's default group, created on the first call."""
    global _GROUP
    if _GROUP is None:
        import moe_comm  # noqa: PLC0415
        _GROUP = moe_comm.init(backend, timeout_s=float(timeout_s))
    expose_metrics(_GROUP)
    return _GROUP


def expose_metrics(group) -> None:
    """Once per process: moe-comm's metrics where the serving framework's /metrics reads them
    (``moe_comm.metrics.register``: prometheus_client's registry, or its multiprocess directory, which
    vLLM and SGLang use), and with MOE_COMM_METRICS_PORT=P also on this rank's own port P + rank
    (``moe_comm.metrics.serve``). MOE_COMM_METRICS=0 turns it off; without prometheus_client it logs
    the fix and does nothing. docs/metrics.md."""
    global _METRICS_EXPOSED
    if _METRICS_EXPOSED or os.environ.get(ENV_METRICS, "1").strip().lower() in ("0", "off", "false", "no"):
        return
    _METRICS_EXPOSED = True
    try:
        from moe_comm import metrics  # noqa: PLC0415
        how = metrics.register()
        port = os.environ.get(ENV_METRICS_PORT)
        if port:
            metrics.serve(int(port) + group.rank)
        logger.info("moe-comm: metrics registered (%s)%s", how, f", served on {int(port) + group.rank}" if port else "")
    except ImportError as e:
        logger.warning("moe-comm: no metrics exported: %s", e)


def shared_buffer(group, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                  dtype: torch.dtype, dispatch_format: str | None, prefill: bool = False):
    """The EPBuffer (decode), or with ``prefill=True`` the PrefillBuffer, of ``group`` with these sizes and
    dispatch format (None, or an fp8 format of ``moe_comm.formats``: the adapters pass no nvfp4 global
    scale), built on first request (collective: every rank asks for the same shapes in the same order, as
    every rank builds the same layers)."""
    from moe_comm import formats  # noqa: PLC0415
    from moe_comm.ep import EPBuffer  # noqa: PLC0415
    from moe_comm.prefill import PrefillBuffer  # noqa: PLC0415

    if dispatch_format not in (None, *formats.FP8_FORMATS):
        raise ValueError(f"the serving adapters dispatch the model's dtype or an fp8 format "
                         f"{formats.FP8_FORMATS}, got dispatch_format={dispatch_format!r} (nvfp4 needs a global "
                         f"scale per call: use EPBuffer/PrefillBuffer directly)")
    cls = PrefillBuffer if prefill else EPBuffer
    key = (cls.__name__, id(group), num_experts, hidden, max_tokens_per_rank, topk, dtype, dispatch_format)
    if key not in _BUFFERS:
        _BUFFERS[key] = cls(group, num_experts, hidden, max_tokens_per_rank, topk, dtype=dtype,
                            dispatch_format=dispatch_format)
    return _BUFFERS[key]


def check_group(group) -> None:
    """Raise the error the group's kernels recorded (CommTimeoutError naming the peer, ...), by name.

    Called by the serving adapters at the start of every dispatch, so a fault in step i stops step i+1
    instead of being carried on; a group error stays raised until ``recover()`` (below). Reads pinned host
    memory, no device sync. Skipped while a CUDA graph is being captured (a captured step cannot raise);
    replays are checked at the next eager call.
    """
    if group.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    group.check()


def recover() -> list[int]:
    """After a group-wide error raised by an adapter (``check_group`` or an op): the recovery policy of
    ``moe_comm.recovery`` on this process's group, to be called on every live rank. Returns the ranks
    excluded (a dead peer: its experts' slots are no longer routed, the buffers are kept); afterwards
    the next dispatch runs in a new epoch. The serving framework decides what to do with the requests of
    the step that failed (neither vLLM nor SGLang re-runs a step by itself)."""
    from moe_comm.recovery import recover as policy  # noqa: PLC0415
    if _GROUP is None:
        raise RuntimeError("no moe-comm group in this process yet (nothing to recover)")
    return policy([_GROUP])


# ---- a framework's fault-tolerance queries (vLLM's all2all manager: query_active_mask / query_fault /
# clean_buffers, as its DeepEP low-latency manager answers them from DeepEP's shrink mask), answered by
# moe-comm's exclusion: the mask is the group's excluded ranks (compat.deep_ep's rank mask too).

def query_active_mask():
    """int32 [world] on the device: 1 for each rank excluded from this process's group, 0 for each live one
    (``CommGroup.excluded_mask``; no host read, CUDA-graph capturable)."""
    global _MASK
    g = process_group()
    if _MASK is None:
        _MASK = torch.zeros(g.world_size, dtype=torch.int32, device=g.device)
    return g.excluded_mask(out=_MASK)


def query_fault():
    """bool scalar on the device: True when a rank was excluded since the last ``clean_buffers`` (a fault
    recovered by exclusion elsewhere, e.g. ``compat.deep_ep``'s mask or ``recover()``)."""
    mask = query_active_mask()
    return (mask != (torch.zeros_like(mask) if _BASELINE is None else _BASELINE)).any()


def clean_buffers() -> None:
    """A framework's post-fault clean-up: ``recover()`` (collective over the live ranks: reset the group,
    or exclude a dead rank), then the mask of the recovered group is the new baseline of ``query_fault``.
    moe-comm's buffers need no zeroing (flags carry epochs); an excluded rank stays masked."""
    global _BASELINE
    recover()
    _BASELINE = query_active_mask().clone()
