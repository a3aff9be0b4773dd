"""The SGLang dispatcher against SGLang's real classes (``make test-sglang``; skipped where SGLang is absent).

What is SGLang's own code here: the plugin loader (``sglang.srt.plugins.load_plugins``, which finds our
``sglang.srt.plugins`` entry point), its HookRegistry, the MoE dispatcher factory
(``create_moe_dispatcher``) that the hook wraps, MoeRunnerConfig, BaseDispatcher, StandardTopKOutput,
DeepEPLLDispatchOutput / DeepEPLLCombineInput, DeepEPNormalDispatchOutput / DeepEPNormalCombineInput,
DeepEPMode and the extend-in-batch flag that --deepep-mode auto reads, the expert-distribution recorder.
The experts are torch (tests/moe_cases.toy_experts and a normal-mode equivalent): SGLang's kernels for
the DeepEP layouts (DeepGEMM grouped GEMMs, CuteDSL) are GPU-only.
torchvision is replaced by an import placeholder (cpu_shims), as PyPI's build does not load on CPU torch.
"""

import importlib.metadata
import os

import pytest
import torch

import cpu_shims

cpu_shims.install()
pytest.importorskip("sglang.srt.plugins")
import sglang  # noqa: E402
from sglang.srt import plugins as sgl_plugins  # noqa: E402
from sglang.srt.layers.moe import token_dispatcher as sgl_dispatcher  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import layer as sgl_layer  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402

import moe_comm  # noqa: E402
from moe_comm.ep import EPBuffer  # noqa: E402
from moe_comm.prefill import PrefillBuffer  # noqa: E402
from moe_comm.serving import ep_group  # noqa: E402
from moe_comm.serving import sglang as adapter  # noqa: E402
from moe_comm.serving import sglang_plugin  # noqa: E402

from moe_cases import close, make_inputs, reference_moe, toy_experts  # noqa: E402
from moe_comm import reference  # noqa: E402

E, TOPK, HIDDEN, MAXT = 8, 2, 128, 4
TOKENS = [MAXT, 3, 0, 1]  # rank r dispatches TOKENS[r] tokens (0: a rank with nothing to send)


def _runner_config(world):
    return MoeRunnerConfig(num_experts=E, num_local_experts=E // world, hidden_size=HIDDEN, top_k=TOPK,
                           num_fused_shared_experts=0, params_dtype=torch.bfloat16)


def _experts(rank, world, out):
    """SGLang's experts' part: the unweighted expert output in the same layout; rows past masked_m are
    set to NaN, so a combine that read one would show it."""
    y = toy_experts(rank, E // world, out.hidden_states)
    rows = torch.arange(y.shape[1]).view(1, -1)
    y[rows >= out.masked_m.view(-1, 1).long()] = float("nan")
    return sgl_dispatcher.DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights)


def _layer(dispatcher, rank, world, seed, split=False):
    """One MoE layer as SGLang runs it: dispatch -> experts -> combine; returns (output, reference, out)."""
    xs, idxs, ws = make_inputs(world, TOKENS[:world], E, TOPK, HIDDEN, seed)
    x, idx, w = xs[rank], idxs[rank].to(torch.int32), ws[rank]
    topk = StandardTopKOutput(topk_weights=w, topk_ids=idx, router_logits=torch.zeros(x.shape[0], E))
    if split:
        dispatcher.dispatch_a(x, topk)
        out = dispatcher.dispatch_b()
        dispatcher.combine_a(_experts(rank, world, out))
        y = dispatcher.combine_b()
    else:
        out = dispatcher.dispatch(hidden_states=x, topk_output=topk)
        y = dispatcher.combine(combine_input=_experts(rank, world, out))
    return y, reference_moe(x, idx, w), out, idxs


def _check_dispatch_output(out, rank, world, idxs):
    assert isinstance(out, sgl_dispatcher.DeepEPLLDispatchOutput)
    assert out.format.is_deepep_ll()
    assert out.hidden_states.shape == (E // world, world * MAXT, HIDDEN)
    assert out.hidden_states_scale is None
    local = torch.cat(idxs) - rank * (E // world)
    want = torch.bincount(local[(local >= 0) & (local < E // world)], minlength=E // world)
    assert out.masked_m.dtype == torch.int32 and torch.equal(out.masked_m.long(), want)
    assert out.expected_m == (TOKENS[rank] * world * TOPK + E) // E


def test_sglang_version_and_class_shape():
    assert sglang.__version__.startswith("0.5.23"), sglang.__version__
    cls = adapter.dispatcher_class()
    assert issubclass(cls, sgl_dispatcher.BaseDispatcher)
    assert not getattr(cls, "__abstractmethods__", None)


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group=sgl_plugins.GENERAL_PLUGINS_GROUP)
    assert any(ep.value == "moe_comm.serving.sglang_plugin:register" for ep in eps)


def test_options_from_env():
    assert adapter.options_from_env({}) is None
    assert adapter.options_from_env({"MOE_COMM_SGLANG": "0"}) is None
    assert [adapter.switch_from_env(e) for e in ({}, {"MOE_COMM_SGLANG": "0"}, {"MOE_COMM_SGLANG": "1"})] == \
        [None, False, True]
    opts = adapter.options_from_env({"MOE_COMM_SGLANG": "1", "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "64"})
    assert opts == dict(backend="auto", timeout_s=30.0, dispatch_format=None, max_tokens_per_rank=64,
                        prefill_max_tokens_per_rank=adapter.DEFAULT_PREFILL_MAX_TOKENS_PER_RANK)
    assert adapter.env_options({}) == dict(opts, max_tokens_per_rank=adapter.DEFAULT_MAX_TOKENS_PER_RANK)
    opts = adapter.options_from_env({"MOE_COMM_SGLANG": "1", "MOE_COMM_SGLANG_FP8": "1",
                                     "MOE_COMM_SGLANG_MAX_TOKENS": "8", "MOE_COMM_SGLANG_BACKEND": "shm",
                                     "MOE_COMM_SGLANG_PREFILL_MAX_TOKENS": "32"})
    assert opts["dispatch_format"] == "e4m3" and opts["max_tokens_per_rank"] == 8 and opts["backend"] == "shm"
    assert opts["prefill_max_tokens_per_rank"] == 32


@pytest.mark.parametrize("split", [False, True])
def test_dispatcher_world1_equals_reference(split):
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    d = adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    for seed in (0, 1):
        y, ref, out, idxs = _layer(d, 0, 1, seed, split)
        _check_dispatch_output(out, 0, 1, idxs)
        assert torch.equal(y, ref)


def test_sglang_hooks_wrap_dispatcher():
    """BaseDispatcher's own pre/post hooks (used by SGLang's EPLB and overlap code) run around ours."""
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    d = adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    seen = []
    d.register_post_dispatch_hook(lambda disp, out: seen.append(int(out.masked_m.sum())))
    d.register_post_combine_hook(lambda disp, y: y * 2)
    y, ref, out, _ = _layer(d, 0, 1, 3)
    assert seen == [int(out.masked_m.sum())] and torch.equal(y, ref * 2)


def test_fp8_dispatch_layout():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    d = adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16, fp8_dispatch=True))
    (x,), (idx,), (w,) = make_inputs(1, [MAXT], E, TOPK, HIDDEN, 5)
    out = d.dispatch(x, StandardTopKOutput(w, idx, torch.zeros(MAXT, E)))
    xq, s = out.hidden_states, out.hidden_states_scale
    assert xq.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (E, MAXT, HIDDEN // 128) and s.stride(1) == 1  # DeepEP's column-major scales
    for e in range(E):
        rows = (idx == e).any(1).nonzero().flatten()  # tokens routed to e, in token order
        assert int(out.masked_m[e]) == len(rows)
        deq = xq[e, :len(rows)].float() * s[e, :len(rows)].repeat_interleave(128, dim=1)
        assert torch.allclose(deq, x[rows].float(), rtol=0.07, atol=1e-2)
    d.combine(sgl_dispatcher.DeepEPLLCombineInput(torch.zeros(E, MAXT, HIDDEN, dtype=torch.bfloat16), idx, w))


def test_combine_rejects_other_formats():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    d = adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    (x,), (idx,), (w,) = make_inputs(1, [2], E, TOPK, HIDDEN, 6)
    d.dispatch(x, StandardTopKOutput(w, idx, torch.zeros(2, E)))
    with pytest.raises(ValueError, match="low_latency"):
        d.combine(sgl_dispatcher.StandardCombineInput(hidden_states=x))
    fresh = adapter.dispatcher_class()(d.ep)
    with pytest.raises(RuntimeError, match="combine without"):
        fresh.combine(sgl_dispatcher.DeepEPLLCombineInput(x, idx, w))


def _plugin_rank(group, requested, split):
    """One shm rank: SGLang loads our entry point; its own create_moe_dispatcher, wrapped by the hook,
    builds the dispatcher (or SGLang's own when not requested); two MoE layers of two steps each."""
    os.environ["MOE_COMM_SGLANG"] = "1" if requested else "0"
    os.environ["MOE_COMM_SGLANG_MAX_TOKENS"] = str(MAXT)
    ep_group.use_group(group)
    sgl_plugins.load_plugins()
    sglang_plugin.register()  # idempotent
    world, rank = group.world_size, group.rank
    if not requested:  # SGLang's own dispatcher reads its parallel state (set up by its server)
        from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415
        with get_parallel().override(moe_ep_size=world, moe_ep_rank=rank):
            d = sgl_layer.create_moe_dispatcher(_runner_config(world), quant_method=None)
        return type(d).__name__, None
    d = sgl_layer.create_moe_dispatcher(_runner_config(world), quant_method=None)
    d2 = sgl_layer.create_moe_dispatcher(_runner_config(world), quant_method=None)
    assert d2.ep is d.ep  # layers of one shape share one EPBuffer
    for step in range(2):
        for layer in (d, d2):
            y, ref, out, idxs = _layer(layer, rank, world, 10 + step, split)
            _check_dispatch_output(out, rank, world, idxs)
            assert torch.equal(y, ref), (rank, step)
    return type(d).__name__, d.ep.max_tokens_per_rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,split", [(1, False), (2, False), (2, True)])
def test_plugin_world_shm(world, split):
    names = moe_comm.launch(_plugin_rank, world, True, split, backend="shm", timeout_s=120)
    assert names == [("MoECommDispatcher", MAXT)] * world


@pytest.mark.timeout(300)
def test_plugin_off_keeps_sglang_dispatcher():
    names = moe_comm.launch(_plugin_rank, 1, False, False, backend="shm", timeout_s=60)
    assert names == [("StandardDispatcher", None)]


def _metrics_rank(group):
    """``_plugin_rank`` (SGLang's plugin loader and hooked factory, two layers of two steps), then the
    refresher thread's next two refreshes (the second began after the steps)."""
    import time  # noqa: PLC0415

    from moe_comm import metrics  # noqa: PLC0415

    _plugin_rank(group, True, False)
    exp, deadline = metrics.exporter(), time.monotonic() + 60
    done = exp.refreshes + 2
    while exp.refreshes < done and time.monotonic() < deadline:
        time.sleep(0.1)
    return exp.refreshes >= done


def _asgi_get(app, path: str) -> str:
    """GET ``path`` from an ASGI app, in this process (what uvicorn would do for a request)."""
    import asyncio  # noqa: PLC0415

    body = []

    async def run():
        scope = dict(type="http", method="GET", path=path, raw_path=path.encode(), root_path="", query_string=b"",
                     headers=[], http_version="1.1", scheme="http", server=("test", 80), client=("test", 1))

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            if message["type"] == "http.response.body":
                body.append(message.get("body", b""))

        await app(scope, receive, send)

    asyncio.run(run())
    return b"".join(body).decode()


@pytest.mark.timeout(600)
def test_metrics_reach_sglangs_metrics_endpoint(monkeypatch):
    """SGLang with --enable-metrics: its own set_prometheus_multiproc_dir() (before the ranks start, as its
    server does), two shm ranks through the plugin, then the /metrics route its own
    add_prometheus_middleware() mounts on an app, requested over ASGI: moe-comm's calls and expert load of
    both ranks are there."""
    from fastapi import FastAPI  # noqa: PLC0415
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    from sglang.srt.utils import add_prometheus_middleware, set_prometheus_multiproc_dir  # noqa: PLC0415

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)   # restored (unset) after the test
    set_prometheus_multiproc_dir()
    monkeypatch.setenv("MOE_COMM_METRICS_INTERVAL_S", "0.2")
    assert moe_comm.launch(_metrics_rank, 2, backend="shm", timeout_s=120) == [True, True]
    app = FastAPI()
    add_prometheus_middleware(app)
    text = _asgi_get(app, "/metrics")
    got = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    for r in ("0", "1"):
        assert [s.value for s in got if s.name == "moe_comm_calls_total" and s.labels == dict(rank=r, op="dispatch")
                and s.value >= 4], text[:3000]
        assert sum(s.value for s in got if s.name == "moe_comm_expert_rows_total" and s.labels["rank"] == r) > 0


def test_silent_peer_is_raised_by_name_and_stays():
    """Rank 1 never dispatches: rank 0's dispatch raises CommTimeoutError naming it, and so does every
    later dispatch (the group is failed until reset), instead of serving on with missing tokens."""
    from moe_comm.errors import CommTimeoutError  # noqa: PLC0415

    groups = moe_comm.init(backend="loopback", world_size=2, timeout_s=0.5, device="cpu")
    d0, _ = [adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK)) for g in groups]
    (x,), (idx,), (w,) = make_inputs(1, [2], E, TOPK, HIDDEN, 8)
    topk = StandardTopKOutput(w, idx, torch.zeros(2, E))
    d0.dispatch_a(x, topk)
    with pytest.raises(CommTimeoutError, match="waiting for peer rank 1"):
        d0.dispatch_b()
    with pytest.raises(CommTimeoutError, match="peer rank 1"):
        adapter.dispatcher_class()(d0.ep).dispatch(x, topk)


def test_readme_snippet():
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import cpu_shims; cpu_shims.install(); " \
           f"exec(open({os.path.join(here, 'readme_snippet.py')!r}).read())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_COMM_SGLANG")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == "MoECommDispatcher [1, 1, 1, 1, 1, 1, 0, 1]", run.stdout


def test_counts_reach_sglang_expert_distribution_recorder(monkeypatch):
    from sglang.srt.eplb import expert_distribution  # noqa: PLC0415

    seen = []

    class Recorder:
        def on_deepep_dispatch_low_latency(self, counts):
            seen.append(counts.tolist())

    monkeypatch.setattr(expert_distribution, "get_global_expert_distribution_recorder", lambda: Recorder())
    adapter.dispatcher_class.cache_clear()
    try:
        (g,) = moe_comm.init(backend="loopback", world_size=1)
        d = adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
        _, _, out, _ = _layer(d, 0, 1, 4)
        assert seen == [out.masked_m.tolist()]
    finally:
        adapter.dispatcher_class.cache_clear()


def test_unsupported_configurations_raise():
    from sglang.srt.layers.moe.utils import get_flags  # noqa: PLC0415

    opts = dict(backend="loopback", max_tokens_per_rank=MAXT)
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    ep_group.use_group(g)
    with pytest.raises(NotImplementedError, match="shared-experts-fusion"):
        adapter.make_dispatcher(MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=HIDDEN, top_k=TOPK,
                                                num_fused_shared_experts=1, params_dtype=torch.bfloat16), opts)
    with pytest.raises(NotImplementedError, match="whole world"):
        adapter.make_dispatcher(_runner_config(2), opts)
    with get_flags().moe.override(tbo_enabled=True):
        with pytest.raises(NotImplementedError, match="two-batch-overlap"):
            adapter.make_dispatcher(_runner_config(1), opts)
    assert type(adapter.make_dispatcher(_runner_config(1), opts)).__name__ == "MoECommDispatcher"


# ---- normal mode and --deepep-mode auto ----------------------------------------------------------

def _normal_experts(rank, world, out):
    """SGLang's normal-mode experts' part: one row per received token, its local experts (global g
    multiplies by (g + 1) / 4) weighted and summed in float32, rounded once."""
    acc = torch.zeros(out.hidden_states.shape, dtype=torch.float32)
    for k in range(out.topk_ids.shape[1]):
        g = out.topk_ids[:, k] + rank * (E // world)
        scaled = (out.hidden_states.float() * ((g.float() + 1) / 4)[:, None]).to(out.hidden_states.dtype)
        acc += torch.where(out.topk_ids[:, k, None] >= 0, out.topk_weights[:, k, None] * scaled.float(), 0.0)
    return sgl_dispatcher.DeepEPNormalCombineInput(acc.to(out.hidden_states.dtype), out.topk_ids, out.topk_weights)


def _normal_layer(dispatcher, rank, world, seed, tokens):
    xs, idxs, ws = make_inputs(world, tokens, E, TOPK, HIDDEN, seed)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    out = dispatcher.dispatch(hidden_states=x, topk_output=StandardTopKOutput(w, idx, torch.zeros(x.shape[0], E)))
    assert isinstance(out, sgl_dispatcher.DeepEPNormalDispatchOutput) and out.format.is_deepep_normal()
    want = reference.prefill_dispatch(xs, idxs, ws, E, dispatcher.buf.max_tokens_per_rank)[rank]
    assert torch.equal(out.hidden_states, want["x"][want["valid"]])
    assert torch.equal(out.topk_ids, want["topk_idx"][want["valid"]].long())
    assert out.num_recv_tokens_per_expert == want["expert_counts"].tolist()
    y = dispatcher.combine(combine_input=_normal_experts(rank, world, out))
    return y, reference_moe(x, idx, w)


def test_normal_dispatcher_world1_equals_reference(monkeypatch):
    from sglang.srt.eplb import expert_distribution  # noqa: PLC0415

    seen = []

    class Recorder:
        def on_deepep_dispatch_normal(self, counts, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                      num_tokens_per_expert):
            seen.append((counts, num_tokens_per_rank.tolist(), num_tokens_per_expert.sum().item()))

    monkeypatch.setattr(expert_distribution, "get_global_expert_distribution_recorder", lambda: Recorder())
    adapter.dispatcher_class.cache_clear()
    try:
        (g,) = moe_comm.init(backend="loopback", world_size=1)
        d = adapter.dispatcher_class()(prefill=PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
        assert d.mode == "normal"
        for seed in (0, 1):
            y, ref = _normal_layer(d, 0, 1, seed, [MAXT])
            assert close(y, ref), seed
        (x,), (idx,), _ = make_inputs(1, [MAXT], E, TOPK, HIDDEN, 1)
        assert len(seen) == 2 and seen[1] == (torch.bincount(idx[idx >= 0], minlength=E).tolist(),
                                              [int((idx >= 0).any(1).sum())], int((idx >= 0).sum()))
        d.dispatch(*_normal_args(0))
        with pytest.raises(ValueError, match="normal-mode layout"):
            d.combine(sgl_dispatcher.DeepEPLLCombineInput(torch.zeros(1), None, None))
    finally:
        adapter.dispatcher_class.cache_clear()


def _normal_args(seed):
    (x,), (idx,), (w,) = make_inputs(1, [2], E, TOPK, HIDDEN, seed)
    return x, StandardTopKOutput(w, idx, torch.zeros(2, E))


def test_auto_mode_follows_sglangs_extend_in_batch():
    """--deepep-mode auto as SGLang's DeepEPDispatcher resolves it: an extend batch (prefill) gets the
    normal layout, a decode batch the low-latency one; SGLang's own flag decides."""
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch  # noqa: PLC0415

    (g,) = moe_comm.init(backend="loopback", world_size=1)
    d = adapter.dispatcher_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16),
                                   PrefillBuffer(g, E, HIDDEN, 2 * MAXT, TOPK, dtype=torch.bfloat16))
    assert d.mode == "auto"
    try:
        for step in range(2):
            set_is_extend_in_batch(True)
            y, ref = _normal_layer(d, 0, 1, 20 + step, [2 * MAXT])
            assert close(y, ref), step
            set_is_extend_in_batch(False)
            y, ref, out, _ = _layer(d, 0, 1, 30 + step)
            assert isinstance(out, sgl_dispatcher.DeepEPLLDispatchOutput) and torch.equal(y, ref), step
    finally:
        set_is_extend_in_batch(False)


def _plugin_auto_rank(group):
    """One shm rank: SGLang's factory, hooked, under --deepep-mode auto (SGLang's flag): a prefill step
    (normal layout) then a decode step (low latency) on the same dispatcher."""
    from sglang.srt.layers.dp_attention import set_is_extend_in_batch  # noqa: PLC0415
    from sglang.srt.layers.moe.utils import DeepEPMode, get_flags  # noqa: PLC0415

    os.environ.update(MOE_COMM_SGLANG="1", MOE_COMM_SGLANG_MAX_TOKENS=str(MAXT),
                      MOE_COMM_SGLANG_PREFILL_MAX_TOKENS=str(2 * MAXT))
    ep_group.use_group(group)
    sgl_plugins.load_plugins()
    world, rank = group.world_size, group.rank
    with get_flags().moe.override(deepep_mode=DeepEPMode.AUTO):
        d = sgl_layer.create_moe_dispatcher(_runner_config(world), quant_method=None)
    errs = []
    for step in range(2):
        set_is_extend_in_batch(True)
        y, ref = _normal_layer(d, rank, world, 40 + step, [2 * MAXT, 0, 5, 1][:world])
        errs += [] if close(y, ref) else [f"rank {rank} prefill {step}"]
        set_is_extend_in_batch(False)
        y, ref, _, _ = _layer(d, rank, world, 50 + step)
        errs += [] if torch.equal(y, ref) else [f"rank {rank} decode {step}"]
    return type(d).__name__, d.mode, errs


@pytest.mark.timeout(600)
def test_plugin_auto_mode_world2_shm():
    got = moe_comm.launch(_plugin_auto_rank, 2, backend="shm", timeout_s=120)
    assert got == [("MoECommDispatcher", "auto", [])] * 2
