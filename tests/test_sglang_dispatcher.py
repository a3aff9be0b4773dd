"""The SGLang dispatcher's logic without SGLang (``EPBufferDispatcher``, ``PrefillBufferDispatcher`` and
``ModeDispatcher``, what ``MoECommDispatcher`` runs): DeepEP low-latency and normal output layouts exact
against moe_comm.reference, split calls, --deepep-mode auto, and what the next dispatch does after a
failed combine.
The run against SGLang's real classes is tests/sglang/ (``make test-sglang``)."""

from types import SimpleNamespace

import pytest
import torch

import moe_comm
from moe_comm import reference
from moe_comm.ep import EPBuffer
from moe_comm.serving.sglang import EPBufferDispatcher

from moe_cases import close, make_inputs, reference_moe, toy_experts

E, TOPK, HIDDEN, MAXT = 4, 2, 256, 4


def _dispatcher(fp8=False):
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    return EPBufferDispatcher(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16, fp8_dispatch=fp8))


def _topk(idx, w):
    return SimpleNamespace(topk_ids=idx, topk_weights=w)


def test_dispatch_combine_equals_reference_and_split_calls_match():
    disp = _dispatcher()
    for seed, split in ((0, False), (1, True)):
        (x,), (idx,), (w,) = make_inputs(1, [MAXT], E, TOPK, HIDDEN, seed)
        if split:
            disp.dispatch_a(x, _topk(idx, w))
            out = disp.dispatch_b()
        else:
            out = disp.dispatch(x, _topk(idx, w))
        counts = torch.bincount(idx[idx >= 0], minlength=E).to(torch.int32)
        assert torch.equal(out.masked_m, counts) and out.hidden_states_scale is None
        assert out.expected_m == (MAXT * TOPK + E) // E
        y_e = toy_experts(0, E, out.hidden_states)
        inp = SimpleNamespace(hidden_states=y_e, topk_weights=None)
        if split:
            disp.combine_a(inp)
            y = disp.combine_b()
        else:
            y = disp.combine(inp)
        assert close(y, reference_moe(x, idx, w))


def test_fp8_scales_come_in_deepep_column_major_order():
    disp = _dispatcher(fp8=True)
    (x,), (idx,), (w,) = make_inputs(1, [3], E, TOPK, HIDDEN, 2)
    out = disp.dispatch(x, _topk(idx, w))
    R, G = MAXT, HIDDEN // 128
    s = out.hidden_states_scale
    assert s.shape == (E, R, G) and s.stride() == (G * R, 1, R)
    exp = reference.dispatch([x], [idx], E, MAXT)[0]["x"]   # bf16 rows; fp8 keeps them within 1/16
    for e, n in enumerate(out.masked_m.tolist()):
        rows = out.hidden_states[e, :n].float() * s[e, :n].repeat_interleave(128, dim=1)
        assert torch.allclose(rows, exp[e, :n].float(), rtol=0.07, atol=1e-3), e


def test_a_combine_that_raises_does_not_block_the_next_dispatch():
    """A combine send refused on its input answers the dispatch anyway: the next dispatch -> combine
    runs (before, every later dispatch was refused as 'still waiting')."""
    disp = _dispatcher()
    (x,), (idx,), (w,) = make_inputs(1, [MAXT], E, TOPK, HIDDEN, 3)
    out = disp.dispatch(x, _topk(idx, w))
    with pytest.raises(TypeError):
        disp.combine(SimpleNamespace(hidden_states=out.hidden_states.float(), topk_weights=None))
    out = disp.dispatch(x, _topk(idx, w))
    y = disp.combine(SimpleNamespace(hidden_states=toy_experts(0, E, out.hidden_states), topk_weights=None))
    assert close(y, reference_moe(x, idx, w))


class _MaskedDispatcher(EPBufferDispatcher):
    """The dispatcher with a framework active-rank mask, as SGLang's elastic EP keeps one."""

    def __init__(self, ep, active):
        super().__init__(ep)
        self.active = active

    def _active_ranks(self):
        return self.active


def test_live_ranks_are_published_into_the_active_rank_mask():
    """A dispatch writes the group's live ranks into the framework's mask (here 4 slots, SGLang's
    --max-ep-size above the world), again only after they change (an exclusion: rank 2 gone)."""
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    ep = EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)
    active = torch.full((4,), 7, dtype=torch.int32)
    disp = _MaskedDispatcher(ep, active)
    (x,), (idx,), (w,) = make_inputs(1, [MAXT], E, TOPK, HIDDEN, 4)
    out = disp.dispatch(x, _topk(idx, w))
    disp.combine(SimpleNamespace(hidden_states=toy_experts(0, E, out.hidden_states), topk_weights=None))
    assert active.tolist() == [1, 0, 0, 0]
    active.fill_(7)   # unchanged live ranks: not written again
    disp._publish_live_ranks(ep.group)
    assert active.tolist() == [7, 7, 7, 7]
    disp._publish_live_ranks(SimpleNamespace(live_ranks=[0, 1, 3]))   # after exclude([2])
    assert active.tolist() == [1, 1, 0, 1]


def test_elastic_active_ranks_reads_sglangs_state(monkeypatch):
    """Without SGLang, or without its elastic-EP state, there is no mask; with it, its active_ranks."""
    import sys
    import types

    from moe_comm.serving.sglang import _ELASTIC_EP, elastic_active_ranks
    monkeypatch.setitem(sys.modules, _ELASTIC_EP, None)   # import -> ImportError
    assert elastic_active_ranks() is None
    state = SimpleNamespace(active_ranks=torch.ones(3, dtype=torch.int32))
    mod = types.ModuleType(_ELASTIC_EP)
    mod.ElasticEPStateManager = SimpleNamespace(instance=lambda: None)
    monkeypatch.setitem(sys.modules, _ELASTIC_EP, mod)
    assert elastic_active_ranks() is None
    mod.ElasticEPStateManager = SimpleNamespace(instance=lambda: state)
    assert elastic_active_ranks() is state.active_ranks


# ---- normal mode (PrefillBuffer) and --deepep-mode auto ------------------------------------------

from moe_comm.prefill import PrefillBuffer  # noqa: E402
from moe_comm.serving.sglang import ModeDispatcher, PrefillBufferDispatcher  # noqa: E402


def normal_experts(rank, local, out):
    """SGLang normal-mode experts' part: each received row's local experts (global g multiplies by
    (g + 1) / 4), weighted and summed in float32 in k order, rounded once: [N, hidden]."""
    acc = torch.zeros(out.hidden_states.shape, dtype=torch.float32)
    for k in range(out.topk_ids.shape[1]):
        g = out.topk_ids[:, k] + rank * local
        scaled = (out.hidden_states.float() * ((g.float() + 1) / 4)[:, None]).to(out.hidden_states.dtype)
        acc += torch.where(out.topk_ids[:, k, None] >= 0, out.topk_weights[:, k, None] * scaled.float(), 0.0)
    return SimpleNamespace(hidden_states=acc.to(out.hidden_states.dtype), topk_ids=out.topk_ids,
                           topk_weights=out.topk_weights)


def _normal_expected(world, xs, idxs, ws, m, align=1, nodes=None):
    disp = reference.prefill_dispatch(xs, idxs, ws, E, m)
    local = E // world
    partials = [normal_experts(r, local, SimpleNamespace(hidden_states=d["x"], topk_ids=d["topk_idx"].long(),
                                                         topk_weights=d["topk_weights"])).hidden_states
                for r, d in enumerate(disp)]
    return disp, reference.prefill_combine(partials, idxs, E, m, ranks_per_node=nodes)


def normal_shm_rank(group, seed=0, align=2):
    """One rank of a launched group (emulated nodes: tests/test_emulated_nodes.py) through the normal-mode
    dispatcher, two steps (uneven and empty ranks): the DeepEP normal-mode outputs and the combine
    bitwise against the reference in the node order; returns the mismatches."""
    from prefill_cases import ranks_per_node
    world, rank = group.world_size, group.rank
    d = PrefillBufferDispatcher(PrefillBuffer(group, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16), align)
    errs = []
    for step in range(2):
        xs, idxs, ws = make_inputs(world, [MAXT, 0, 3, 1][:world], E, TOPK, HIDDEN, seed + step)
        want_disp, want_y = _normal_expected(world, xs, idxs, ws, MAXT, align, ranks_per_node(group))
        d.dispatch_a(xs[rank], _topk(idxs[rank], ws[rank]))
        out, want = d.dispatch_b(), want_disp[rank]
        v = want["valid"]
        if not (torch.equal(out.hidden_states, want["x"][v]) and torch.equal(out.topk_ids, want["topk_idx"][v].long())
                and torch.equal(out.topk_weights, want["topk_weights"][v]) and out.num_recv_tokens_per_expert ==
                [-(-c // align) * align for c in want["expert_counts"].tolist()]):
            errs.append(f"rank {rank} step {step}: dispatch")
        d.combine_a(normal_experts(rank, E // world, out))
        if not torch.equal(d.combine_b(), want_y[rank]):
            errs.append(f"rank {rank} step {step}: combine")
    return errs


def _run_normal(dispatchers, xs, idxs, ws, align=1):
    """Every rank's dispatch_a, then dispatch_b, combine_a, combine_b (loopback phase order); checks the
    DeepEP normal-mode outputs and the combine bitwise. Returns the outputs."""
    world, m = len(dispatchers), dispatchers[0].buf.max_tokens_per_rank
    want_disp, want_y = _normal_expected(world, xs, idxs, ws, m, align)
    for d, x, i, w in zip(dispatchers, xs, idxs, ws):
        d.dispatch_a(x, _topk(i, w))
    outs = [d.dispatch_b() for d in dispatchers]
    for r, (out, want) in enumerate(zip(outs, want_disp)):
        v = want["valid"]
        assert torch.equal(out.hidden_states, want["x"][v]) and out.hidden_states_scale is None, r
        assert out.topk_ids.dtype == torch.int64 and torch.equal(out.topk_ids, want["topk_idx"][v].long()), r
        assert torch.equal(out.topk_weights, want["topk_weights"][v]), r
        assert out.num_recv_tokens_per_expert == [-(-c // align) * align for c in want["expert_counts"].tolist()], r
    for r, (d, out) in enumerate(zip(dispatchers, outs)):
        d.combine_a(normal_experts(r, E // world, out))
    ys = [d.combine_b() for d in dispatchers]
    for r, (y, want) in enumerate(zip(ys, want_y)):
        assert torch.equal(y, want), r
        assert close(y, reference_moe(xs[r], idxs[r], ws[r])), r
    return outs


@pytest.mark.parametrize("world,tokens", [(1, [MAXT]), (1, [0]), (2, [MAXT, 0]), (4, [1, MAXT, 3, 0])])
def test_normal_mode_equals_reference(world, tokens):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    disps = [PrefillBufferDispatcher(PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16), 1 + world % 2)
             for g in groups]
    for seed in (0, 1):
        xs, idxs, ws = make_inputs(world, tokens, E, TOPK, HIDDEN, seed)
        _run_normal(disps, xs, idxs, ws, align=1 + world % 2)
    xs, _, ws = make_inputs(world, tokens, E, TOPK, HIDDEN, 2)   # every token to the last expert, one -1 slot
    _run_normal(disps, xs, [torch.tensor([[E - 1, -1]] * x.shape[0], dtype=torch.int64).view(-1, 2) for x in xs], ws, align=1 + world % 2)


def test_auto_mode_picks_normal_for_prefill_and_low_latency_for_decode():
    """--deepep-mode auto: a batch with an extend dispatches in the normal layout, a decode batch in the
    low-latency one, alternately on the same dispatcher; the pick made at dispatch_a holds until
    combine_b even if the batch state changes in between."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    extend = [True]
    disp = ModeDispatcher(EPBufferDispatcher(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)),
                          PrefillBufferDispatcher(PrefillBuffer(g, E, HIDDEN, 2 * MAXT, TOPK, dtype=torch.bfloat16)),
                          lambda: "normal" if extend[0] else "low_latency")
    assert disp.mode == "auto"
    for step, (is_extend, tokens) in enumerate([(True, 2 * MAXT), (False, MAXT), (True, 3), (False, 1)]):
        extend[0] = is_extend
        (x,), (idx,), (w,) = make_inputs(1, [tokens], E, TOPK, HIDDEN, 10 + step)
        disp.dispatch_a(x, _topk(idx, w))
        extend[0] = not is_extend   # the batch state flips: this dispatch keeps its mode
        out = disp.dispatch_b()
        if is_extend:
            assert hasattr(out, "num_recv_tokens_per_expert"), step
            disp.combine_a(normal_experts(0, E, out))
        else:
            assert hasattr(out, "masked_m"), step
            disp.combine_a(SimpleNamespace(hidden_states=toy_experts(0, E, out.hidden_states), topk_weights=None))
        assert close(disp.combine_b(), reference_moe(x, idx, w)), step


def test_a_mode_that_was_not_built_raises_by_name():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    disp = ModeDispatcher(EPBufferDispatcher(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)), None,
                          lambda: "normal")
    (x,), (idx,), (w,) = make_inputs(1, [2], E, TOPK, HIDDEN, 3)
    with pytest.raises(RuntimeError, match="--deepep-mode normal or auto"):
        disp.dispatch(x, _topk(idx, w))
    with pytest.raises(RuntimeError, match="combine without a matching dispatch"):
        disp.combine(SimpleNamespace(hidden_states=x, topk_weights=None))
    with pytest.raises(ValueError, match="low-latency or a normal"):
        ModeDispatcher(None, None)


# ---- fp8 formats: UE8M0 in the low-latency layout; normal mode quantizing once, or pre-quantized ----

FP8_HIDDEN = 512   # a whole packed UE8M0 word per row


def test_ue8m0_scales_come_packed_in_deepep_column_major_order():
    """dispatch_format='e4m3-ue8m0': hidden_states_scale is DeepEP's use_ue8m0 tensor, int32 [E_local, R,
    hidden / 512] column-major, the packed exponents of reference.quantize_fp8's power-of-two scales."""
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    disp = EPBufferDispatcher(EPBuffer(g, E, FP8_HIDDEN, MAXT, TOPK, dtype=torch.bfloat16, dispatch_format="e4m3-ue8m0"))
    (x,), (idx,), (w,) = make_inputs(1, [3], E, TOPK, FP8_HIDDEN, 2)
    out = disp.dispatch(x, _topk(idx, w))
    s, R = out.hidden_states_scale, MAXT
    assert s.dtype == torch.int32 and s.shape == (E, R, 1) and s.stride() == (R, 1, R)
    want = reference.dispatch([x], [idx], E, MAXT, fp8="e4m3-ue8m0")[0]
    for e, n in enumerate(out.masked_m.tolist()):
        assert torch.equal(s[e, :n], want["scales"][e, :n]), e
        assert torch.equal(out.hidden_states[e, :n].view(torch.uint8), want["x"][e, :n].view(torch.uint8)), e
    disp.combine(SimpleNamespace(hidden_states=toy_experts(0, E, reference.dequantize_fp8(
        out.hidden_states, s.contiguous()).bfloat16()), topk_weights=None))


@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-ue8m0"])
@pytest.mark.parametrize("prequantized", [False, True])
def test_normal_mode_fp8_world2(fmt, prequantized):
    """Normal mode with an fp8 PrefillBuffer: bf16 hidden_states quantized once on the way, or SGLang's
    pre-quantized (codes, scales) (float32 scales column-major, as SGLang's quantizer lays them out)
    delivered as given; codes and scales bit for bit against the reference, the combine exact."""
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    disps = [PrefillBufferDispatcher(PrefillBuffer(g, E, FP8_HIDDEN, MAXT, TOPK, dtype=torch.bfloat16,
                                                   dispatch_format=fmt)) for g in groups]
    xs, idxs, ws = make_inputs(world, [MAXT, 3], E, TOPK, FP8_HIDDEN, 5)
    inputs = xs
    if prequantized:
        inputs = []
        for x in xs:
            q, s = reference.quantize_fp8(x, fmt=fmt)
            inputs.append((q, s.t().contiguous().t() if fmt == "e4m3" else s))
    want = reference.prefill_dispatch(inputs if prequantized else xs, idxs, ws, E, MAXT, fp8=fmt)
    for d, x, i, w in zip(disps, inputs, idxs, ws):
        d.dispatch_a(x, _topk(i, w))
    outs = [d.dispatch_b() for d in disps]
    partials = []
    for r, (out, exp) in enumerate(zip(outs, want)):
        v = exp["valid"]
        assert torch.equal(out.hidden_states.view(torch.uint8), exp["x"][v].view(torch.uint8)), r
        assert out.hidden_states_scale.dtype == exp["scales"].dtype, r
        assert torch.equal(out.hidden_states_scale, exp["scales"][v]), r
        rows = reference.dequantize_fp8(exp["x"], exp["scales"]).bfloat16()
        partials.append(normal_experts(r, E // world, SimpleNamespace(
            hidden_states=rows, topk_ids=exp["topk_idx"].long(), topk_weights=exp["topk_weights"])).hidden_states)
    for r, (d, out) in enumerate(zip(disps, outs)):
        deq = reference.dequantize_fp8(out.hidden_states, out.hidden_states_scale).bfloat16()
        d.combine_a(normal_experts(r, E // world, SimpleNamespace(hidden_states=deq, topk_ids=out.topk_ids,
                                                                   topk_weights=out.topk_weights)))
    ys = [d.combine_b() for d in disps]
    for r, y in enumerate(ys):
        assert torch.equal(y, reference.prefill_combine(partials, idxs, E, MAXT)[r]), r


def test_fp8_option_from_the_environment():
    from moe_comm.serving.sglang import options_from_env
    on = {"MOE_COMM_SGLANG": "1"}
    assert options_from_env(on)["dispatch_format"] is None
    assert options_from_env({**on, "MOE_COMM_SGLANG_FP8": "1"})["dispatch_format"] == "e4m3"
    assert options_from_env({**on, "MOE_COMM_SGLANG_FP8": "e4m3-ue8m0"})["dispatch_format"] == "e4m3-ue8m0"
    with pytest.raises(ValueError, match=r"MOE_COMM_SGLANG_FP8='ue8m0': use 0, 1 or an fp8 format"):
        options_from_env({**on, "MOE_COMM_SGLANG_FP8": "ue8m0"})


# ---- --moe-a2a-backend customized: SGLang's Standard format ------------------------------------------

from moe_comm.serving.sglang_standard import StandardFormatDispatcher, fill_unrouted_slots  # noqa: E402


def test_fill_unrouted_slots():
    ids = torch.tensor([[2, -1, -1, 0], [-1, -1, -1, -1], [3, 1, 0, 2], [-1, 0, -1, 3]], dtype=torch.int32)
    assert fill_unrouted_slots(ids, 4).tolist() == [[2, 1, 3, 0], [0, 1, 2, 3], [3, 1, 0, 2], [1, 0, 2, 3]]
    assert fill_unrouted_slots(ids[:0], 4).shape == (0, 4)
    with pytest.raises(ValueError, match="at least top-k experts per rank"):
        fill_unrouted_slots(ids, 3)


@pytest.mark.parametrize("all_to_rank0", [False, True])
def test_standard_format_equals_reference_with_filled_slots(all_to_rank0):
    """The customized backend's dispatcher on CPU (loopback world 2): SGLang's Standard layout (the
    received rows in (source, token) order, int32 local ids, float32 weights) with every -1 slot filled
    by a distinct unused local id of weight 0, exact against the reference; with every token on rank 0's
    experts, rank 1's empty receive comes as one zero row of weight-0 slots whose expert output (NaN
    here) the combine leaves out. The combine equals the reference bitwise."""
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    disps = [StandardFormatDispatcher(PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)) for g in groups]
    xs, idxs, ws = make_inputs(world, [MAXT, 3], E, TOPK, HIDDEN, 7)
    if all_to_rank0:
        idxs = [torch.tensor([[0, -1]] * x.shape[0], dtype=torch.int64).view(-1, 2) for x in xs]
    want_disp = reference.prefill_dispatch(xs, idxs, ws, E, MAXT)
    for d, x, i, w in zip(disps, xs, idxs, ws):
        d.dispatch_a(x, _topk(i, w))
    outs = [d.dispatch_b() for d in disps]
    partials = []
    for r, (out, want) in enumerate(zip(outs, want_disp)):
        v, topk = want["valid"], out.topk_output
        assert topk.topk_ids.dtype == torch.int32 and out.hidden_states_scale is None
        assert all(len(set(row)) == TOPK and min(row) >= 0 and max(row) < E // world for row in topk.topk_ids.tolist())
        if not bool(v.any()):
            assert torch.equal(out.hidden_states, torch.zeros(1, HIDDEN, dtype=torch.bfloat16)), r
            assert not bool(topk.topk_weights.any()), r
            partials.append(torch.zeros((world * MAXT, HIDDEN), dtype=torch.bfloat16))
            d_out = torch.full((1, HIDDEN), float("nan"), dtype=torch.bfloat16)   # must not reach the combine
        else:
            live = want["topk_idx"][v] >= 0
            assert torch.equal(out.hidden_states, want["x"][v]), r
            assert torch.equal(topk.topk_ids[live], want["topk_idx"][v][live]), r
            assert torch.equal(topk.topk_weights, want["topk_weights"][v]), r
            d_out = normal_experts(r, E // world, SimpleNamespace(hidden_states=out.hidden_states,
                                   topk_ids=topk.topk_ids.long(), topk_weights=topk.topk_weights)).hidden_states
            rows = torch.zeros((world * MAXT, HIDDEN), dtype=torch.bfloat16)
            rows[v] = d_out
            partials.append(rows)
        disps[r].combine_a(SimpleNamespace(hidden_states=d_out))
    ys = [d.combine_b() for d in disps]
    for r, (y, want) in enumerate(zip(ys, reference.prefill_combine(partials, idxs, E, MAXT))):
        assert torch.equal(y, want), r
        assert close(y, reference_moe(xs[r], idxs[r], ws[r])), r


def test_standard_format_refuses_fewer_local_experts_than_topk():
    groups = moe_comm.init(backend="loopback", world_size=4, device="cpu")   # 1 local expert, top-2
    with pytest.raises(ValueError, match="at least top-k experts per rank"):
        StandardFormatDispatcher(PrefillBuffer(groups[0], E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    assert StandardFormatDispatcher(PrefillBuffer(groups[0], E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16),
                                    fill_unrouted=False).fill_unrouted is False
