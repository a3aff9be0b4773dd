"""The vLLM adapter's logic without vLLM: prepare -> experts -> finalize equals the reference MoE.

``EPBufferPrepareFinalize`` is what ``MoECommPrepareAndFinalize`` runs, minus vLLM's base class; the
run against vLLM's real classes is tests/vllm/test_vllm_real.py (``make test-vllm``).
"""

from types import SimpleNamespace

import pytest
import torch

import moe_comm
from moe_comm.serving import vllm_plugin
from moe_comm.serving.vllm import EPBufferPrepareFinalize

from moe_cases import close, make_inputs, reference_moe, toy_experts

from moe_comm.ep import EPBuffer

E, TOPK, HIDDEN, MAXT = 4, 2, 64, 4
UNQUANTIZED = SimpleNamespace(quant_dtype=None, block_shape=None)


def _layer(pf, rank, x, idx, w):
    """One MoE layer as vLLM's modular kernel runs it; returns the finalized output [T, hidden]."""
    out = torch.empty_like(x)
    a, scales, meta, ids, weights = pf.prepare(x, w, idx, E, None, False, UNQUANTIZED)
    assert scales is None and ids is None and weights is None
    fused = toy_experts(rank, E // pf.num_dispatchers(), a)
    pf.finalize(out, fused, w, idx, False, None)
    return out, meta


def test_queries_vllm_makes():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    pf = EPBufferPrepareFinalize(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    assert pf.max_num_tokens_per_rank() == MAXT
    assert pf.num_dispatchers() == 1
    assert pf.output_is_reduced() is True
    assert pf.topk_indices_dtype() is None
    assert pf.supports_async() is True


@pytest.mark.parametrize("tokens", [MAXT, 1, 0])
def test_round_trip_equals_reference_world1(tokens):
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    pf = EPBufferPrepareFinalize(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    for seed in (0, 1):
        (x,), (idx,), (w,) = make_inputs(1, [tokens], E, TOPK, HIDDEN, seed)
        out, meta = _layer(pf, 0, x, idx, w)
        assert close(out, reference_moe(x, idx, w))
        counts = torch.bincount(idx[idx >= 0], minlength=E).to(torch.int32)
        assert meta.expert_num_tokens_cpu is None
        assert meta.expert_num_tokens.dtype == torch.int32 and torch.equal(meta.expert_num_tokens, counts)


def test_router_weight_on_input_topk1():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    pf = EPBufferPrepareFinalize(EPBuffer(g, E, HIDDEN, MAXT, 1, dtype=torch.bfloat16))
    (x,), (idx,), (w,) = make_inputs(1, [3], E, 1, HIDDEN, 7)
    out = torch.empty_like(x)
    a, _, _, _, _ = pf.prepare(x, w, idx, E, None, True, UNQUANTIZED)
    pf.finalize(out, toy_experts(0, E, a), w, idx, True, None)
    assert close(out, reference_moe(x, idx, w))


def test_async_phases_world2_loopback():
    """prepare_async / finalize_async are the send and receive phases: drive two ranks in one process."""
    groups = moe_comm.init(backend="loopback", world_size=2)
    pfs = [EPBufferPrepareFinalize(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)) for g in groups]
    for seed in (0, 1):
        xs, idxs, ws = make_inputs(2, [MAXT, 2], E, TOPK, HIDDEN, seed)
        pending = [pf.prepare_async(x, w, i, E, None, False, UNQUANTIZED) for pf, x, i, w in zip(pfs, xs, idxs, ws)]
        for hook, _ in pending:
            hook()
        results = [receiver() for _, receiver in pending]
        outs = [torch.empty_like(x) for x in xs]
        finals = [pf.finalize_async(out, toy_experts(r, E // 2, res[0]), w, i, False, None)
                  for r, (pf, out, res, w, i) in enumerate(zip(pfs, outs, results, ws, idxs))]
        for _, receiver in finals:
            receiver()
        for r in range(2):
            assert close(outs[r], reference_moe(xs[r], idxs[r], ws[r])), f"rank {r}"


def test_bad_configurations_raise():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    pf = EPBufferPrepareFinalize(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    (x,), (idx,), (w,) = make_inputs(1, [2], E, TOPK, HIDDEN, 3)
    with pytest.raises(ValueError, match="experts"):
        pf.prepare(x, w, idx, E + 4, None, False, UNQUANTIZED)
    with pytest.raises(ValueError, match="topk == 1"):
        pf.prepare(x, w, idx, E, None, True, UNQUANTIZED)
    with pytest.raises(RuntimeError, match="without a matching prepare"):
        pf.finalize(torch.empty_like(x), torch.zeros(E, MAXT, HIDDEN, dtype=x.dtype), w, idx, False, None)
    per_tensor_fp8 = SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=None)
    with pytest.raises(NotImplementedError):
        pf.prepare(x, w, idx, E, None, False, per_tensor_fp8)


def _shm_rank(group, seed):
    world, rank = group.world_size, group.rank
    pf = EPBufferPrepareFinalize(EPBuffer(group, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    errs = []
    for step in range(2):
        xs, idxs, ws = make_inputs(world, [MAXT, 1, 3][:world], E, TOPK, HIDDEN, seed + step)
        out, _ = _layer(pf, rank, xs[rank], idxs[rank], ws[rank])
        if not close(out, reference_moe(xs[rank], idxs[rank], ws[rank])):
            errs.append(f"rank {rank} step {step}")
    return errs


@pytest.mark.timeout(300)
def test_round_trip_equals_reference_shm_world2():
    errs = moe_comm.launch(_shm_rank, 2, 0, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


# ---- the plugin's routing, with vLLM's config replaced by stand-ins --------------------------------

def _moe(use_all2all: bool):
    return SimpleNamespace(moe_parallel_config=SimpleNamespace(use_all2all_kernels=use_all2all))


def test_plugin_routes_only_when_requested(monkeypatch):
    import moe_comm.serving.vllm as adapter

    calls = []
    original = lambda *a, **k: calls.append("vllm") or "vllm-pf"  # noqa: E731
    monkeypatch.setattr(adapter, "make_prepare_finalize",
                        lambda moe, qc, options: calls.append(("moe_comm", options)) or "moe-comm-pf")
    wrapped = vllm_plugin._wrap_maybe_make_prepare_finalize(original)
    assert wrapped.moe_comm_original is original

    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: None)
    assert wrapped(moe=_moe(True), quant_config=None) == "vllm-pf"
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: {"backend": "shm"})
    assert wrapped(moe=_moe(False), quant_config=None) == "vllm-pf"          # no all2all: not ours
    assert wrapped(moe=_moe(True), quant_config=None, use_monolithic=True) == "vllm-pf"
    assert wrapped(_moe(True), None, allow_new_interface=True) == "moe-comm-pf"
    assert calls == ["vllm", "vllm", "vllm", ("moe_comm", {"backend": "shm"})]


def test_plugin_batched_format_flag(monkeypatch):
    class ParallelConfig:
        def __init__(self, all2all, deepep_ll=False):
            self.use_all2all_kernels, self.deepep_ll = all2all, deepep_ll

        @property
        def use_batched_activation_format(self):
            return self.deepep_ll

    ParallelConfig.use_batched_activation_format = vllm_plugin._wrap_batched_format(
        ParallelConfig.__dict__["use_batched_activation_format"])
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: None)
    assert not ParallelConfig(True).use_batched_activation_format
    assert ParallelConfig(True, deepep_ll=True).use_batched_activation_format
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: {})
    assert ParallelConfig(True).use_batched_activation_format
    assert not ParallelConfig(False).use_batched_activation_format


# ---- Standard activation format (PrefillBuffer, prefill) ------------------------------------------

from moe_comm import reference  # noqa: E402
from moe_comm.prefill import PrefillBuffer  # noqa: E402
from moe_comm.serving.vllm import PrefillBufferPrepareFinalize, resolve_mode  # noqa: E402
from moe_comm.serving.vllm_cpu import CPU_EXPERTS_MODULE  # noqa: E402


def standard_experts(x, ids, weights, unreduced=False):
    """Standard-format toy experts over every received row: global expert g multiplies by (g + 1) / 4.
    x [R, hidden], ids [R, topk] global (-1 = skip) -> partial rows [R, hidden] (weighted, summed in float32
    in k order, rounded once), or with unreduced [R, topk, hidden] unweighted rows (zeros where -1)."""
    scaled = [torch.where(ids[:, k, None] >= 0, (x.float() * ((ids[:, k, None].float() + 1) / 4)).to(x.dtype), 0)
              for k in range(ids.shape[1])]
    if unreduced:
        return torch.stack(scaled, dim=1)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k, rows in enumerate(scaled):
        acc += torch.where(ids[:, k, None] >= 0, weights[:, k, None] * rows.float(), 0.0)
    return acc.to(x.dtype)


def _prefill_expected(world, xs, idxs, ws, nodes=None):
    """What each rank's prepare must return (global ids) and its finalize output, from moe_comm.reference
    (``nodes``: ranks per node of a group spanning nodes, the combine's order)."""
    disp = reference.prefill_dispatch(xs, idxs, ws, E, MAXT)
    L = E // world
    ids = [torch.where(d["topk_idx"] >= 0, d["topk_idx"].long() + r * L, -1) for r, d in enumerate(disp)]
    partials = [standard_experts(d["x"], i, d["topk_weights"]) for d, i in zip(disp, ids)]
    return disp, ids, reference.prefill_combine(partials, idxs, E, MAXT, ranks_per_node=nodes)


def _check_prepared(res, want_disp, want_ids, rank):
    a, scales, meta, ids, weights = res
    valid = want_disp["valid"]
    assert scales is None and meta.expert_num_tokens_cpu is None, rank
    assert torch.equal(meta.expert_num_tokens, want_disp["expert_counts"]), rank
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids), rank   # -1 on every row no source wrote
    assert torch.equal(weights, want_disp["topk_weights"]), rank
    assert torch.equal(a[valid], want_disp["x"][valid]), rank


@pytest.mark.parametrize("world,tokens", [(1, [MAXT]), (1, [0]), (2, [MAXT, 0]), (4, [1, MAXT, 3, 0])])
def test_standard_format_equals_reference_loopback(world, tokens):
    """prepare -> Standard-format experts -> finalize against reference.prefill_dispatch / prefill_combine,
    bitwise; two steps, the second with fewer tokens, so stale rows of the first are in the zone."""
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    pfs = [PrefillBufferPrepareFinalize(PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
           for g in groups]
    for seed, scale in ((0, 1), (1, 0.5)):
        steps = [int(t * scale) for t in tokens]
        xs, idxs, ws = make_inputs(world, steps, E, TOPK, HIDDEN, seed)
        want_disp, want_ids, want_y = _prefill_expected(world, xs, idxs, ws)
        pending = [pf.prepare_async(x, w, i, E, None, False, UNQUANTIZED) for pf, x, i, w in zip(pfs, xs, idxs, ws)]
        for hook, _ in pending:
            hook()
        results = [receiver() for _, receiver in pending]
        for r, res in enumerate(results):
            _check_prepared(res, want_disp[r], want_ids[r], r)
        outs = [torch.full_like(x, float("nan")) for x in xs]
        finals = [pf.finalize_async(out, standard_experts(res[0], res[3], res[4]), w, i, False, None)
                  for pf, out, res, w, i in zip(pfs, outs, results, ws, idxs)]
        for _, receiver in finals:
            receiver()
        for r in range(world):
            assert torch.equal(outs[r], want_y[r]), f"rank {r}"
            assert close(outs[r], reference_moe(xs[r], idxs[r], ws[r])), f"rank {r}"


def test_standard_format_all_tokens_to_one_expert_and_unreduced_outputs():
    """Every token to expert 3 (rank 1's), one -1 slot each: rank 0 receives nothing routed; the experts
    hand back [R, topk, hidden] unweighted rows (the delegate's contract), reduced in finalize."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    pfs = [PrefillBufferPrepareFinalize(PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
           for g in groups]
    xs, _, ws = make_inputs(2, [MAXT, 3], E, TOPK, HIDDEN, 5)
    idxs = [torch.tensor([[3, -1]] * x.shape[0]) for x in xs]
    results = []
    for pf, x, i, w in zip(pfs, xs, idxs, ws):
        results.append(pf.prepare_async(x, w, i, E, None, False, UNQUANTIZED))
    results = [(hook(), receiver())[1] for hook, receiver in results]
    assert results[0][2].expert_num_tokens.tolist() == [0, 0]
    assert results[1][2].expert_num_tokens.tolist() == [0, MAXT + 3]
    assert (results[0][3] == -1).all()
    outs = [torch.empty_like(x) for x in xs]
    finals = [pf.finalize_async(out, standard_experts(res[0], res[3], res[4], unreduced=True), res[4], res[3],
                                False, None) for pf, out, res in zip(pfs, outs, results)]
    for _, receiver in finals:
        receiver()
    for r in range(2):
        assert close(outs[r], reference_moe(xs[r], idxs[r], ws[r])), f"rank {r}"


class CpuModuleExperts:
    """Stands in for an experts instance of vLLM's CPU experts module (only its class's module is read:
    ``vllm_cpu.takes_local_ids``); vLLM's own CPU experts consume these ids in tests/engines (make test-engines)."""


CpuModuleExperts.__module__ = CPU_EXPERTS_MODULE


def test_standard_format_local_int32_ids_for_experts_that_ignore_expert_map():
    """After post_init_setup with vLLM's CPU experts, prepare returns int32 *local* ids, local expert 0 with
    weight 0 where the global ids have -1 (other ranks' experts, rows no source wrote): experts that
    compute every slot then add exact zeros, and the finalized output is bitwise the reference's. Any other
    experts keep the global int64 ids with -1."""
    world, L = 2, E // 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    pfs = [PrefillBufferPrepareFinalize(PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
           for g in groups]
    other = PrefillBufferPrepareFinalize(PrefillBuffer(groups[0], E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    other.post_init_setup(SimpleNamespace())
    assert not other.local_ids
    for pf in pfs:
        pf.post_init_setup(CpuModuleExperts())
        assert pf.local_ids
    xs, idxs, ws = make_inputs(world, [MAXT, 3], E, TOPK, HIDDEN, 11)
    want_disp, want_ids, want_y = _prefill_expected(world, xs, idxs, ws)
    pending = [pf.prepare_async(x, w, i, E, None, False, UNQUANTIZED) for pf, x, i, w in zip(pfs, xs, idxs, ws)]
    results = [(hook(), receiver())[1] for hook, receiver in pending]
    outs = [torch.full_like(x, float("nan")) for x in xs]
    finals = []
    for r, (pf, (a, _, meta, ids, weights)) in enumerate(zip(pfs, results)):
        assert ids.dtype == torch.int32 and ids.min() >= 0 and ids.max() < L, r
        assert torch.equal(ids.long(), torch.where(want_ids[r] >= 0, want_ids[r] - r * L, 0)), r
        assert torch.equal(weights, torch.where(want_ids[r] >= 0, want_disp[r]["topk_weights"], 0.0)), r
        assert torch.equal(meta.expert_num_tokens, want_disp[r]["expert_counts"]), r
        # every slot computed, as vLLM's CPU experts do: global expert = local + r * L, weight 0 off-rank
        finals.append(pf.finalize_async(outs[r], standard_experts(a, ids.long() + r * L, weights), ws[r], idxs[r],
                                        False, None))
    for _, receiver in finals:
        receiver()
    for r in range(world):
        assert torch.equal(outs[r], want_y[r]), f"rank {r}"


def standard_shm_rank(group, seed):
    """Two prepare -> experts -> finalize steps of one rank of a launched group (emulated nodes too:
    tests/test_emulated_nodes.py); returns the mismatches."""
    from prefill_cases import ranks_per_node
    world, rank = group.world_size, group.rank
    pf = PrefillBufferPrepareFinalize(PrefillBuffer(group, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    errs = []
    for step in range(2):
        xs, idxs, ws = make_inputs(world, [MAXT, 0, 3, 1][:world], E, TOPK, HIDDEN, seed + step)
        want_disp, want_ids, want_y = _prefill_expected(world, xs, idxs, ws, ranks_per_node(group))
        res = pf.prepare(xs[rank], ws[rank], idxs[rank], E, None, False, UNQUANTIZED)
        _check_prepared(res, want_disp[rank], want_ids[rank], rank)
        out = torch.full_like(xs[rank], float("nan"))
        pf.finalize(out, standard_experts(res[0], res[3], res[4]), res[4], res[3], False, None)
        if not torch.equal(out, want_y[rank]):
            errs.append(f"rank {rank} step {step}")
    return errs


@pytest.mark.timeout(300)
def test_standard_format_equals_reference_shm_world2():
    errs = moe_comm.launch(standard_shm_rank, 2, 0, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


def test_standard_format_fp8_dispatch_and_bad_configurations():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    pf = PrefillBufferPrepareFinalize(PrefillBuffer(g, E, 128, MAXT, TOPK, dtype=torch.bfloat16, fp8_dispatch=True))
    (x,), (idx,), (w,) = make_inputs(1, [3], E, TOPK, 128, 6)
    block_fp8 = SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    a, scales, _, _, _ = pf.prepare(x, w, idx, E, None, False, block_fp8)
    want = reference.prefill_dispatch([x], [idx], [w], E, MAXT, fp8=True)[0]
    valid = want["valid"]
    assert a.dtype == torch.float8_e4m3fn and torch.equal(scales[valid], want["scales"][valid])
    assert reference.fp8_codes_match(a[valid], want["x"][valid])
    pf.finalize(torch.empty_like(x), torch.zeros(MAXT, 128, dtype=x.dtype), w, idx, False, None)
    with pytest.raises(ValueError, match="fp8_dispatch=False"):
        pf.prepare(x, w, idx, E, None, False, UNQUANTIZED)
    with pytest.raises(RuntimeError, match="without a matching prepare"):
        pf.finalize(torch.empty_like(x), torch.zeros(MAXT, 128, dtype=x.dtype), w, idx, False, None)


def test_mode_follows_the_option_or_vllms_all2all_backend():
    assert resolve_mode(None, "deepep_high_throughput") == "low_latency"        # default: as before
    assert resolve_mode({"mode": "high_throughput"}, None) == "high_throughput"
    assert resolve_mode({"mode": "auto"}, "deepep_high_throughput") == "high_throughput"
    assert resolve_mode({"mode": "auto"}, "deepep_low_latency") == "low_latency"
    assert resolve_mode({"mode": "auto"}, "allgather_reducescatter") == "low_latency"
    with pytest.raises(ValueError, match="'low_latency'.*'high_throughput'"):
        resolve_mode({"mode": "prefill"}, None)


def test_plugin_batched_format_follows_the_mode(monkeypatch):
    class ParallelConfig:
        use_all2all_kernels, all2all_backend = True, "deepep_high_throughput"

        @property
        def use_batched_activation_format(self):
            return False

    ParallelConfig.use_batched_activation_format = vllm_plugin._wrap_batched_format(
        ParallelConfig.__dict__["use_batched_activation_format"])
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: {"mode": "auto"})
    assert not ParallelConfig().use_batched_activation_format      # Standard-format experts for prefill
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: {"mode": "low_latency"})
    assert ParallelConfig().use_batched_activation_format


def test_batched_format_packed_ue8m0_scales_and_the_auto_upgrade():
    """dispatch_format "e4m3-ue8m0": prepare returns DeepEP's use_ue8m0 scales (int32 [E_local, R, hidden/512],
    column-major), the codes and packed exponents of reference.quantize_fp8. With fp8_dispatch "auto", vLLM's
    post_init_setup moves an "e4m3" buffer to its UE8M0 twin when the experts take packed UE8M0 scales
    (vLLM's DeepEP low-latency rule), and leaves it otherwise."""
    from moe_comm.serving.ep_group import shared_buffer
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    hidden, block_fp8 = 512, SimpleNamespace(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    pf = EPBufferPrepareFinalize(shared_buffer(g, E, hidden, MAXT, TOPK, torch.bfloat16, "e4m3"))
    pf.fp8_auto = True
    pf.post_init_setup(SimpleNamespace(supports_packed_ue8m0_act_scales=lambda: False))
    assert pf.buf.dispatch_format == "e4m3"
    pf.post_init_setup(SimpleNamespace(supports_packed_ue8m0_act_scales=lambda: True))
    assert pf.buf.dispatch_format == "e4m3-ue8m0" and pf.ep is pf.buf
    (x,), (idx,), (w,) = make_inputs(1, [3], E, TOPK, hidden, 8)
    a, scales, meta, _, _ = pf.prepare(x, w, idx, E, None, False, block_fp8)
    want = moe_comm.reference.dispatch([x], [idx], E, MAXT, fp8="e4m3-ue8m0")[0]
    assert scales.dtype == torch.int32 and scales.shape == (E, MAXT, 1) and scales.stride() == (MAXT, 1, MAXT)
    for e, n in enumerate(meta.expert_num_tokens.tolist()):
        assert torch.equal(a[e, :n].view(torch.uint8), want["x"][e, :n].view(torch.uint8))
        assert torch.equal(scales[e, :n], want["scales"][e, :n])
    pf.finalize(torch.empty_like(x), torch.zeros(E, MAXT, hidden, dtype=x.dtype), w, idx, False, None)
