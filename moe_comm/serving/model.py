"""The tiny MoE decoder, one rank's part: data-parallel attention with a KV cache, expert-parallel MoE.

Each rank holds a full copy of the attention / router / shared-expert weights and runs only its own
requests through them; it holds experts [rank*E_local, (rank+1)*E_local) and computes, for every rank's
tokens routed there, those experts. Tokens move through a pluggable ``MoEComm`` backend (backends.py).

All shapes are static given the token count T, so one decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .attention import attend_triton
from .experts import EXPERT_IMPLS
from .weights import LayerWeights, ModelWeights

# Named ranges for torch.profiler around the parts of a step (``step_profile.py``); off, no range is made.
PROFILE_SPANS = False


def span(name: str):
    return _profiled_span(name) if PROFILE_SPANS else contextlib.nullcontext()


@contextlib.contextmanager
def _profiled_span(name: str):
    # The device is drained at both ends so every kernel launched inside the range also runs inside it:
    # step_profile attributes kernels by time, because the profiler does not link Triton's launches
    # (cuLaunchKernelEx) to the range they came from.
    sync = torch.cuda.is_initialized()
    if sync:
        torch.cuda.synchronize()
    with torch.profiler.record_function(f"moe::{name}"):
        yield
        if sync:
            torch.cuda.synchronize()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [T, H] dtype, w [H] -> [T, H] dtype (statistics in float32)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP: x [T, H], gate/up [H, I], down [I, H] -> [T, H]."""
    return (F.silu(x @ gate) * (x @ up)) @ down


def batched_experts(x_e: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, impl: str = "dense", expected_rows: int | None = None,
                    max_active: int | None = None) -> torch.Tensor:
    """Every local expert on its received rows, batched: x_e [E_local, R, H] -> [E_local, R, H].

    counts [E_local] int32 on the device says rows x_e[e, :counts[e]] are valid; it is never read on the
    host. gate/up [E_local, H, I], down [E_local, I, H]. Output rows past a count are unspecified (combine
    never reads them). impl (``experts.py``): "masked" = Triton grouped GEMM that skips experts and row
    tiles without rows (reads only the active experts' weights); "dense" = torch.bmm over every row.
    expected_rows / max_active: hints for the masked kernel's tiles and grid (``experts.masked_bmm``).
    """
    return EXPERT_IMPLS[impl](x_e, counts, gate, up, down, expected_rows=expected_rows, max_active=max_active)


def standard_experts(d, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Every local expert on the rows a PrefillBuffer dispatch received (vLLM's "standard" format):
    d a PrefillDispatchResult -> partial rows [R, H] dtype, row q = sum over slots k of row q routed to a
    local expert e, in k order, of recv_topk_weights[q, k] * gated_mlp(recv_x[q], e), accumulated in
    float32; rows without a local expert (and rows no source wrote) are zeros. gate/up [E_local, H, I],
    down [E_local, I, H]. Eager: each expert's rows are gathered by index (a host read per expert)."""
    ids, weights = d.masked_topk()
    x = d.recv_x
    slots = torch.zeros((*ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)   # [R, K, H]
    for e in range(gate.shape[0]):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():   # each (row, slot) once: plain stores, no accumulation order to fix
            slots[rows, slot] = weights[rows, slot, None] * gated_mlp(x[rows], gate[e], up[e], down[e]).float()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(ids.shape[1]):
        acc += slots[:, k]
    return acc.to(x.dtype)


def route(h: torch.Tensor, router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router with renormalised top-k: h [T, H] -> (topk_idx [T, K] int64, topk_weights [T, K] float32)."""
    probs = torch.softmax((h @ router).float(), dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx, weights / weights.sum(-1, keepdim=True)


def cached_attention(lw: LayerWeights, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, num_heads: int, head_dim: int,
                     impl: str | None = None) -> torch.Tensor:
    """Causal multi-head attention of T new tokens against a KV cache.

    h [T, H]; k_cache/v_cache [num_slots, max_seq, heads, head_dim] (this layer's); slots/positions [T] int64:
    token t is at position positions[t] of the sequence in cache slot slots[t]. All T keys/values are written
    before any is read, so several tokens of one sequence (prefill) see each other causally. impl: "torch"
    (``attend_gather``) or "triton" (``attention.attend_triton``: reads only the visible positions); None =
    ``default_attention_impl`` (as in ``MoEDecoder``).
    """
    t = h.shape[0]
    q, k, v = ((h @ w).view(t, num_heads, head_dim) for w in (lw.wq, lw.wk, lw.wv))
    k_cache[slots, positions] = k
    v_cache[slots, positions] = v
    attend = ATTENTION_IMPLS[impl or default_attention_impl(h.device)]
    return attend(q, k_cache, v_cache, slots, positions).reshape(t, num_heads * head_dim) @ lw.wo


def attend_gather(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]: every token's whole cache row gathered, positions
    past its own masked (bytes grow with max_seq, not with the sequence)."""
    keys, values = k_cache[slots], v_cache[slots]  # [T, max_seq, heads, head_dim]
    scores = torch.einsum("thd,tshd->ths", q, keys).float() * q.shape[2] ** -0.5
    visible = torch.arange(k_cache.shape[1], device=q.device)[None, :] <= positions[:, None]  # [T, max_seq]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.einsum("ths,tshd->thd", probs, values)


ATTENTION_IMPLS = {"torch": attend_gather, "triton": attend_triton}
# Whether each attention keeps its scores and softmax probabilities in float32 (the Triton kernel) or
# rounds both to the activations' dtype (attend_gather's bf16 einsums). The reference model rounds where
# the served attention does; otherwise those roundings can flip a near-tie top-k routing choice
# (DeepSeek-V3's 8 of 256) and the bf16 check would compare different expert sets.
ATTENTION_IN_FLOAT32 = {"torch": False, "triton": True}


def default_attention_impl(device: torch.device) -> str:
    """triton on CUDA; torch on the CPU, where the Triton kernel would run in the interpreter."""
    return "triton" if device.type == "cuda" else "torch"


class MoEDecoder:
    """One rank's decoder: its requests' attention + KV cache, its experts, and a MoE comm backend.

    weights: this rank's share (``ModelWeights.for_rank``). comm: a ``MoEComm`` for this rank.
    max_batch: most sequences this rank holds at once (cache slots 0..max_batch-1); slot ``pad_slot`` is
    scratch that padding rows write to and read from, so they never touch a real sequence.
    phased=True (loopback worlds): ``forward`` yields after every send phase so a driver can run all ranks'
    send phases before their receive phases; otherwise it never yields (run it with ``run_to_end``).
    Prefill steps (``forward(..., prefill=True)``) use ``comm.prefill`` (a PrefillEP) where the comm has
    one, with ``standard_experts``; decode steps use ``comm`` with ``batched_experts``.
    expert_impl: "masked" or "dense" (``batched_experts``); None = masked on CUDA, dense on the CPU (where
    the masked kernel runs in Triton's interpreter, one program per expert tile).
    attention_impl: "torch" or "triton" (``cached_attention``); None = ``default_attention_impl``.
    """

    def __init__(self, weights: ModelWeights, comm, max_batch: int, phased: bool = False,
                 expert_impl: str | None = None, attention_impl: str | None = None):
        cfg = weights.cfg
        self.cfg, self.w, self.comm, self.max_batch, self.phased = cfg, weights, comm, max_batch, phased
        if expert_impl is None:
            expert_impl = "masked" if weights.embed.device.type == "cuda" else "dense"
        if expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"expert_impl must be one of {tuple(EXPERT_IMPLS)}, got {expert_impl!r}")
        self.expert_impl = expert_impl
        if attention_impl is None:
            attention_impl = default_attention_impl(weights.embed.device)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {tuple(ATTENTION_IMPLS)}, got {attention_impl!r}")
        self.attention_impl = attention_impl
        self.device = weights.embed.device
        self.pad_slot = max_batch
        shape = (cfg.num_layers, max_batch + 1, cfg.max_seq, cfg.num_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=cfg.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=cfg.dtype, device=self.device)

    def forward(self, tokens, slots, positions, valid, prefill: bool = False):
        """Generator; returns logits [T, vocab] float32 for tokens [T] int64 at (slots, positions) [T] int64.

        valid [T] bool: False marks padding rows, whose outputs are garbage and which route nowhere
        (topk_idx = -1), so they cannot change any real row. T may be 0 (an idle rank's dummy step).
        prefill: a prefill step (eager): the MoE goes through the comm's high-throughput op
        (``comm.prefill``, a PrefillEP, with ``standard_experts``) where it has one; every rank of a
        step passes the same value (the ops are collective).
        """
        cfg = self.cfg
        x = self.w.embed[tokens]
        for layer, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.attn_norm)
            with span("attention"):
                h = cached_attention(lw, h, self.k_cache[layer], self.v_cache[layer], slots, positions,
                                     cfg.num_heads, cfg.head_dim, self.attention_impl)
            x = x + h
            x = x + (yield from self._moe(lw, rms_norm(x, lw.moe_norm), valid, prefill))
        h = rms_norm(x, self.w.final_norm)
        with span("lm_head"):
            return (h @ self.w.lm_head).float()

    def _moe(self, lw: LayerWeights, h, valid, prefill=False):
        with span("router"):
            topk_idx, topk_weights = route(h, lw.router, self.cfg.topk)
            topk_idx = torch.where(valid[:, None], topk_idx, -1)
        high_throughput = getattr(self.comm, "prefill", None) if prefill else None
        if high_throughput is not None:
            routed = yield from self._moe_prefill(high_throughput, lw, h, topk_idx, topk_weights)
        else:
            routed = yield from self._moe_decode(lw, h, topk_idx, topk_weights)
        if lw.shared_gate is None:
            return routed
        with span("shared_expert"):
            shared = gated_mlp(h, lw.shared_gate, lw.shared_up, lw.shared_down)
        return shared + routed

    def _moe_prefill(self, comm, lw: LayerWeights, h, topk_idx, topk_weights):
        """The routed experts through a PrefillEP: rank-major dispatch, standard_experts, combine.

        Phased (one process holding every rank): one more yield after the combine's receive, so that every
        rank has received its combine before any rank sends the next layer's dispatch. The PrefillBuffer
        has one landing zone: the next dispatch's send waits (on the device) until every rank's combine
        has read it, which a rank driven later in the same round would never get to do."""
        with span("dispatch"):
            d = yield from self._phases(comm.dispatch, h, topk_idx, topk_weights)
        with span("experts"):
            partial = standard_experts(d, lw.expert_gate, lw.expert_up, lw.expert_down)
        with span("combine"):
            y = yield from self._phases(comm.combine, partial, d.handle)
        if self.phased:
            yield
        return y

    def _moe_decode(self, lw: LayerWeights, h, topk_idx, topk_weights):
        """The routed experts through the MoEComm: expert-major dispatch, batched_experts, weighted combine
        (or, for a backend that fuses the experts, its layer: ``backends.FusedLayerEP``)."""
        if getattr(self.comm, "fuses_experts", False):
            with span("moe_layer"):
                return (yield from self._layer_phases(self.comm.layer(lw), h, topk_idx, topk_weights))
        with span("dispatch"):
            x_e, counts, ctx = yield from self._phases(self.comm.dispatch, h, topk_idx)
        # Rows an expert is expected to get, for the masked kernel's row tile: T*K/E over the ranks.
        expected = -(-h.shape[0] * self.comm.world * self.cfg.topk // self.cfg.num_experts)
        # At world 1 at most T*K experts have rows: the masked kernel's grid needs no more expert slots.
        max_active = h.shape[0] * self.cfg.topk if self.comm.world == 1 else None
        with span("experts"):
            y_e = batched_experts(x_e, counts, lw.expert_gate, lw.expert_up, lw.expert_down, self.expert_impl,
                                  expected, max_active)
        with span("combine"):
            return (yield from self._phases(self.comm.combine, y_e, topk_weights, ctx))

    def _layer_phases(self, layer, *args):
        """A fused layer's call: its three phases, a yield after each of the first two when phased (every
        rank's send, then every rank's experts, before any rank's receive)."""
        if not self.phased:
            return layer(*args, phase="both")
        layer(*args, phase="send")
        yield
        layer(phase="experts")
        yield
        return layer(phase="recv")

    def _phases(self, op, *args):
        if not self.phased:
            return op(*args, phase="both")
        op(*args, phase="send")
        yield
        return op(*args, phase="recv")


def run_to_end(gen):
    """Run a generator that must not yield (an unphased forward) and return its value."""
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("forward yielded: a phased model must be driven by drive_lockstep")


def drive_lockstep(gens: list, between=None):
    """Advance one generator per rank round-robin, in rank order, until all finish; their return values.

    Each yield ends a send phase, so every rank's send runs before any rank's matching receive.
    ``between()``, if given, runs after each round in which some rank yielded (every rank has finished
    that send phase), before the receives.
    """
    results, live = [None] * len(gens), list(enumerate(gens))
    while live:
        still = []
        for r, g in live:
            try:
                next(g)
                still.append((r, g))
            except StopIteration as stop:
                results[r] = stop.value
        live = still
        if live and between is not None:
            between()
    return results
