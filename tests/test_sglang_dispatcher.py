"""The SGLang dispatcher's logic without SGLang (``EPBufferDispatcher``, what ``MoECommDispatcher`` runs):
DeepEP low-latency output layout, split calls, and what the next dispatch does after a failed combine.
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
    disp._publish_live_ranks()
    assert active.tolist() == [7, 7, 7, 7]
    disp.ep = SimpleNamespace(group=SimpleNamespace(live_ranks=[0, 1, 3]))   # after exclude([2])
    disp._publish_live_ranks()
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
