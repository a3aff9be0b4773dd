"""The transformers door: a transformers MoE model runs its experts across the ranks of a moe-comm group.

Importing this module registers the experts implementation ``"moe_comm"`` in transformers'
``ExpertsInterface``. On every rank (one process per rank, each with its own sequences: data-parallel
attention, expert-parallel MoE)::

    import moe_comm, moe_comm.serving.hf as hf
    group = moe_comm.init()                                 # torchrun env (or moe_comm.launch's group)
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_comm")
    report = hf.shard_experts(model, group)                 # collective: keeps this rank's experts only
    out = model.generate(**my_inputs, max_new_tokens=16)    # every MoE layer: dispatch -> experts -> combine
    hf.finish(model)                                        # collective: steps with T = 0 until all are done

Every MoE layer is a collective, so **the ranks step together**: each model forward is one step, its
first MoE layer a bounded meeting of the ranks (``steps.py``). A rank with no sequences takes part in a
step with ``idle_step(model)`` (T = 0 through every MoE layer, no attention); a rank whose generation
ended calls ``finish(model)``, which takes part in the others' steps until every rank has called it. A
rank that does not come is named by ``StepTimeoutError`` within the group's timeout, never waited for
forever.

A step whose largest T over the ranks is at most ``decode_tokens`` goes through the EPBuffer (decode:
expert-major rows, the masked expert kernel); a larger one through the PrefillBuffer in
ceil(max T / ``prefill_tokens``) chunks. The router is the model's (grouped top-k, biases, scaling
included): the door takes its ``top_k_index`` / ``top_k_weights``. With ``layer_path="fused"`` (or
"auto") a decode-size step's MoE layer is one ``moe_comm.MoELayer`` call instead (dispatch, gate/up, down
and combine fused; ``fused.py``) wherever the fused kernels can compute the experts; fp8 checkpoints'
experts (transformers' FP8Experts, 128 x 128 block scales) run there only, their weights kept in fp8
(``layer_path="fused"`` or "auto"). Shared experts
(DeepSeek-V3's, Qwen2-MoE's) are outside the experts module and stay local. Inference only (no autograd through the
collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .door import IMPLEMENTATION, LAYER_ATTR, Door, NotBoundError, StepOrderError, experts_forward
from .experts import UnsupportedExpertsError, expert_weight_bytes, is_experts_module, layout_of, rows_dtype, shard
from .fused import LAYER_PATHS, fp8_refusal_message, unfusable
from .steps import KIND_BIND, KIND_FINISH, KIND_STEP, StepMismatchError, StepPlan, StepTimeoutError, fingerprint

__all__ = ["DECODE_TOKENS", "IMPLEMENTATION", "LAYER_PATHS", "PREFILL_TOKENS", "NotBoundError", "ShardReport",
           "StepMismatchError", "StepOrderError", "StepPlan", "StepTimeoutError", "UnsupportedExpertsError",
           "bound_door", "finish", "idle_step", "register", "shard_experts"]

DECODE_TOKENS = 64     # default threshold: steps with at most this many tokens on every rank use the EPBuffer
PREFILL_TOKENS = 512   # default PrefillBuffer capacity: tokens per rank per chunk of a larger step
EXPERT_KERNELS = ("auto", "masked", "torch")


@dataclass(frozen=True)
class ShardReport:
    """What ``shard_experts`` kept on this rank."""

    experts: tuple               # (lo, hi): this rank's experts, the same in every MoE layer
    layers: int                  # MoE layers bound
    expert_bytes_before: int     # bytes of every experts module's weights before sharding (all E experts)
    expert_bytes_after: int      # the same after: this rank's experts only (before * (hi - lo) / E)
    buffer_bytes: int            # the EPBuffer, PrefillBuffer and MoELayer this binding uses (allocated at first call)
    fused_layers: int = 0        # MoE layers whose decode-size steps run through moe_comm.MoELayer (layer_path)
    unfused_why: str | None = None   # why the other layers do not (None when every layer is fused)
    fused_copy_bytes: int = 0    # bytes of weight copies made for the fused layer (transposed layouts, ue8m0 scales
    #                              widened to float32; 0 when it reads the modules' own), on top of expert_bytes_after


def register() -> None:
    """Register ``"moe_comm"`` in transformers' ExpertsInterface (done when this module is imported)."""
    try:
        from transformers.integrations.moe import ExpertsInterface  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"moe_comm.serving.hf needs transformers >= 5.24 ({e}): pip install "
                          f"'moe-comm[transformers]'") from e
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    try:   # fp8 checkpoints' FP8Experts look their implementation up in a registry of their own
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface  # noqa: PLC0415
    except ImportError:
        return
    FP8ExpertsInterface.register(IMPLEMENTATION, experts_forward)


register()


def shard_experts(model: nn.Module, group, *, decode_tokens: int = DECODE_TOKENS,
                  prefill_tokens: int = PREFILL_TOKENS, dispatch_format: str | None = None,
                  expert_kernel: str = "auto", topk: int | None = None, layer_path: str = "unfused") -> ShardReport:
    """Bind ``model`` to ``group``: every experts module keeps only this rank's experts and runs through
    moe-comm; sets the model's experts implementation to ``"moe_comm"``. Collective: every rank calls it
    with the same model and arguments (the ranks meet and check that they do).

    group           a CommGroup of one process per rank (``moe_comm.init()`` under torchrun, or the group
                    ``moe_comm.launch`` passes; world 1 works too); rank r keeps experts [r*E/W, (r+1)*E/W)
    decode_tokens   the threshold and the EPBuffer's capacity: a step whose largest T is at most this
                    goes through the EPBuffer
    prefill_tokens  the PrefillBuffer's capacity per chunk: larger steps run in ceil(max T / this) chunks
    dispatch_format None (rows move in the model's dtype) or an fp8 format ("e4m3", "e4m3-pow2",
                    "e4m3-ue8m0": hidden % 128 == 0, bf16/fp16 models): the experts then compute on
                    the dequantized rows (lossy)
    expert_kernel   how decode-size steps compute the local experts: "masked" (the Triton masked kernel of
                    ``serving.experts``, experts without rows skipped, for SiLU-gated experts without
                    biases; others use "torch"), "torch" (the module's own gate with torch.bmm over every
                    row), or "auto" (masked on CUDA, torch on the CPU, where the kernel is interpreted)
    topk            experts per token, if the config has no ``num_experts_per_tok``
    layer_path      how decode-size steps run a MoE layer: "unfused" (the default: EPBuffer dispatch, the
                    experts by ``expert_kernel``, EPBuffer combine), "fused" (one ``moe_comm.MoELayer`` call:
                    dispatch -> gate/up -> down + combine fused, for SiLU-gated experts with concatenated
                    [gate; up] weights and no biases, rows in the model's dtype; raises
                    UnsupportedExpertsError for a model it cannot compute, e.g. gpt-oss, or with an fp8
                    dispatch_format) or "auto" (fused where it can and decode_tokens <=
                    moe_layer.FUSED_MAX_TOKENS, else unfused; ``ShardReport.unfused_why`` says why).
                    fp8 experts (transformers' FP8Experts, 128 x 128 block scales) run fused only: "auto"
                    fuses them at any decode_tokens, "unfused" raises UnsupportedExpertsError.
                    Prefill-size steps take the PrefillBuffer either way. docs/integrations.md
    Returns a ``ShardReport`` (bytes of expert weights before and after, the layers fused). Raises
    UnsupportedExpertsError for an experts module the door does not know (or, with layer_path="fused", one
    the fused layer cannot compute), ValueError for a world size that does not divide the experts.
    """
    if getattr(model, "_moe_comm_door", None) is not None:
        raise ValueError("this model is already bound by shard_experts (its experts are sharded): load it again "
                         "to bind it to another group")
    if layer_path not in LAYER_PATHS:
        raise ValueError(f"layer_path must be one of {LAYER_PATHS}, got {layer_path!r}")
    if expert_kernel not in EXPERT_KERNELS:
        raise ValueError(f"expert_kernel must be one of {EXPERT_KERNELS}, got {expert_kernel!r}")
    if expert_kernel == "auto":
        expert_kernel = "masked" if group.device.type == "cuda" else "torch"
    for name, v in (("decode_tokens", decode_tokens), ("prefill_tokens", prefill_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    modules = [m for m in model.modules() if is_experts_module(m)]
    if not modules:
        raise UnsupportedExpertsError(f"{type(model).__name__} has no MoE experts module (nothing decorated by "
                                      f"transformers' @use_experts_implementation): it is not an MoE model the door "
                                      f"can shard; run it without moe-comm")
    dtype = rows_dtype(model)
    layouts = [layout_of(m, dtype) for m in modules]
    config = getattr(model, "config", None)
    k = topk if topk is not None else getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"top-k not found in {type(config).__name__} (no num_experts_per_tok): pass topk=")
    W = group.world_size
    for m, lay in zip(modules, layouts):
        if lay.num_experts % W:
            divisors = [d for d in range(1, lay.num_experts + 1) if lay.num_experts % d == 0]
            raise ValueError(f"{type(m).__name__} has {lay.num_experts} experts, which {W} ranks cannot share "
                             f"equally (rank r holds experts [r*E/W, (r+1)*E/W)): run on a world size that divides "
                             f"{lay.num_experts} ({', '.join(map(str, divisors))})")
    for m, lay in zip(modules, layouts):
        why = unfusable(lay, dispatch_format, decode_tokens, layer_path) if layer_path == "fused" or lay.fp8 else None
        if why and lay.fp8:
            raise UnsupportedExpertsError(fp8_refusal_message(m, why, layer_path))
        if why:
            raise UnsupportedExpertsError(
                f"layer_path='fused': the fused MoE layer cannot run {type(m).__name__}: {why}. Fix: "
                f"layer_path='auto' (such layers run unfused) or 'unfused'")
    shapes = [(lay.num_experts, lay.hidden, lay.intermediate, lay.dtype, lay.fp8) for lay in layouts]
    digest = fingerprint(shapes, k, decode_tokens, prefill_tokens, dispatch_format, layer_path)
    door = Door(group, k, decode_tokens, prefill_tokens, dispatch_format, digest, expert_kernel == "masked",
                layer_path)
    door.meetings.meet(KIND_BIND, 0, -1)   # every rank binds the same model with the same settings
    before = sum(expert_weight_bytes(m) for m in modules)
    lo, hi = None, None
    for m, lay in zip(modules, layouts):
        L = lay.num_experts // W
        lo, hi = group.rank * L, (group.rank + 1) * L
        shard(m, lo, hi)
        setattr(m, LAYER_ATTR, door.add_layer(m, lay))
        _guard(m)
    model._moe_comm_door = door
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    bufs = {id(b): b for layer in door.layers for b in (layer.decode_buf, layer.prefill_buf) if b is not None}
    bufs.update((id(f), f) for f in door.fused_layers.values())
    fused = [layer.fused for layer in door.layers if layer.fused is not None]
    why = next((layer.unfused_why for layer in door.layers if layer.unfused_why), None)
    return ShardReport((lo, hi), len(modules), before, sum(expert_weight_bytes(m) for m in modules),
                       sum(b.buffer_bytes for b in bufs.values()), len(fused), why,
                       sum(f.copied_bytes for f in fused))


def _guard(module: nn.Module) -> None:
    """A sharded experts module refuses to run under another experts implementation (it would index
    global expert ids into this rank's experts)."""
    forward = type(module).forward

    def guarded(*args, **kwargs):
        impl = module.config._experts_implementation
        if impl != IMPLEMENTATION:
            raise NotBoundError(f"this {type(module).__name__} holds only this rank's experts (sharded by "
                                f"moe_comm.serving.hf.shard_experts) and cannot run with experts_implementation="
                                f"{impl!r}: set it back with model.set_experts_implementation('{IMPLEMENTATION}'), "
                                f"or load the model again for a local run")
        return forward(module, *args, **kwargs)

    module.forward = guarded


def bound_door(model: nn.Module) -> Door:
    """The ``Door`` of a model bound by ``shard_experts``."""
    door = getattr(model, "_moe_comm_door", None)
    if door is None:
        raise NotBoundError("this model is not bound to a moe-comm group: call moe_comm.serving.hf.shard_experts("
                            "model, group) on every rank first")
    return door


def idle_step(model: nn.Module) -> StepPlan:
    """Take part in one step with no sequences (T = 0 through every MoE layer; no attention runs).
    Collective: the other ranks run one model forward (or idle_step) at the same time. Returns the plan."""
    door = bound_door(model)
    with torch.no_grad():
        plan = door.begin_step(KIND_STEP, 0)
        door.run_empty_step()
    return plan


def finish(model: nn.Module) -> int:
    """Take part with T = 0 in the steps of the ranks still generating, until every rank has called
    ``finish``; returns the number of steps taken here. Collective: call it on every rank at the end of
    its generation (ranks whose generations end at different steps, e.g. at an EOS token, stay in step)."""
    door = bound_door(model)
    taken = 0
    with torch.no_grad():
        while True:
            plan = door.begin_step(KIND_FINISH, 0)
            if door.all_finished(plan):
                return taken
            door.run_empty_step()
            taken += 1
