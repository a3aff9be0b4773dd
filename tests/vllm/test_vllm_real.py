"""The vLLM adapter against vLLM's real classes (``make test-vllm``; skipped where vLLM is not installed).

On a CPU machine vLLM's CUDA extension (vllm._C) is absent and its platform is "unspecified", so four
GPU-only helpers are replaced here, and only here: the fused SiLU-and-mul kernel and the top-k sum
(``ops.moe_sum``) by the same math in torch, the CUDA-graph-capture probe (nothing is ever captured on a CPU) and the platform's is_cpu (so
vLLM's modular kernel allocates its workspaces with torch.empty, its CPU path). Everything else is
vLLM's own code: FusedMoEKernel, NaiveBatchedExperts, FusedMoEConfig / FusedMoEParallelConfig,
ExpertTokensMetadata, TopKWeightAndReduceDelegate, the plugin entry point and the config lookup.
vLLM ships no Standard-format experts that run without its CUDA or CPU extension, so the high-throughput
(Standard format) runs use ``TorchStandardExperts`` below: vLLM's experts base class with the SiLU MoE
in torch, honouring vLLM's expert_map and -1 ids, handing back either unreduced rows (the delegate, so
vLLM's TopKWeightAndReduceContiguous runs in finalize) or reduced rows (TopKWeightAndReduceNoOP).
"""

import importlib.metadata

import pytest
import torch

# Not just "vllm": with tests/ on sys.path, this directory itself imports as a namespace package "vllm".
pytest.importorskip("vllm.model_executor.layers.fused_moe.modular_kernel")
import vllm  # noqa: E402

import moe_comm  # noqa: E402
import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe import config as moe_config_module  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe import topk_weight_and_reduce as wr  # noqa: E402

from moe_comm.serving import vllm as adapter  # noqa: E402
from moe_comm.serving import vllm_plugin  # noqa: E402
from moe_comm.serving.vllm_cpu import unquantized_silu_experts  # noqa: E402

from moe_comm.ep import EPBuffer  # noqa: E402
from moe_comm.prefill import PrefillBuffer  # noqa: E402

E, TOPK, HIDDEN, INTER, MAXT = 4, 2, 64, 32, 4


class CpuNaiveBatchedExperts(fused_batched_moe.NaiveBatchedExperts):
    """vLLM's reference batched experts with SiLU-and-mul in torch (vllm._C is not built for CPUs)."""

    def activation(self, activation, output, input, **kwargs):
        n = input.shape[-1] // 2
        output.copy_(torch.nn.functional.silu(input[..., :n].float()) * input[..., n:].float())


class TorchStandardExperts(unquantized_silu_experts()):
    """Standard-format experts in torch (test only): rows [M, hidden] with global top-k ids [M, topk]."""

    reduced = False   # True: weight and sum here (NoOP reduce); False: [M, topk, hidden] for the delegate

    @staticmethod
    def activation_format():
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device():
        return True

    @staticmethod
    def _supports_parallel_config(moe_parallel_config):
        return True

    def finalize_weight_and_reduce_impl(self):
        return wr.TopKWeightAndReduceNoOP() if self.reduced else wr.TopKWeightAndReduceDelegate()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (M, K), (M, N), ((M, K) if self.reduced else (M, topk, K))

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        local = topk_ids if expert_map is None else torch.where(topk_ids >= 0, expert_map[topk_ids.clamp(min=0)], -1)
        output.zero_()
        inter = w1.shape[1] // 2
        for k in range(topk_ids.shape[1]):
            for e in range(w1.shape[0]):
                rows = (local[:, k] == e).nonzero().flatten()
                if rows.numel() == 0:
                    continue
                h = hidden_states[rows].float() @ w1[e].float().T
                y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].float().T
                if self.reduced:
                    output[rows] += (topk_weights[rows, k, None] * y).to(output.dtype)
                else:
                    output[rows, k] = y.to(output.dtype)


def _cpu_shims():
    mk.current_platform.is_cpu = lambda: True
    # vLLM's top-k sum (TopKWeightAndReduceContiguous) is a vllm._C kernel: the same sum in torch.
    wr.ops.moe_sum = lambda input, output, topk_ids=None, expert_map=None: output.copy_(input.sum(dim=1))
    fused_batched_moe._is_capturing_or_compiling = lambda: False


def _parallel_config(world, rank):
    return moe_config_module.FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0, dp_rank=rank,
        ep_rank=rank, sp_size=1, use_ep=True, all2all_backend="allgather_reducescatter", enable_eplb=False)


def _moe_config(world, rank):
    return moe_config_module.FusedMoEConfig(
        num_experts=E, experts_per_token=TOPK, hidden_dim=HIDDEN, intermediate_size=INTER,
        num_local_experts=E // world, num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
        routing_method=moe_config_module.RoutingMethodType.TopK,
        moe_parallel_config=_parallel_config(world, rank), in_dtype=torch.bfloat16, max_num_tokens=MAXT)


def _weights():
    g = torch.Generator().manual_seed(1234)
    w1 = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=g) / 8).to(torch.bfloat16)
    return w1, w2


def _inputs(world, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in [MAXT, 3, 1, 2][:world]:
        x = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)]).to(torch.int32)
        out.append((x, ids, torch.rand(t, TOPK, generator=g)))
    return out


def _reference(x, ids, weights, w1, w2):
    """SiLU-gated MoE in float32: sum_k w[t,k] * W2[e] (silu(W1[e]_gate x) * W1[e]_up x)."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w1[e].float() @ x[t].float()
            y[t] += weights[t, k] * (w2[e].float() @ (torch.nn.functional.silu(h[:INTER]) * h[INTER:]))
    return y


def _experts_for(pf, world, rank, reduced=False):
    """The experts vLLM would pair with ``pf``'s activation format."""
    cfg, quant = _moe_config(world, rank), moe_config_module.FUSED_MOE_UNQUANTIZED_CONFIG
    if pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        return CpuNaiveBatchedExperts(cfg, quant, max_num_tokens=pf.max_num_tokens_per_rank(),
                                      num_dispatchers=pf.num_dispatchers())
    experts = TorchStandardExperts(cfg, quant)
    experts.reduced = reduced
    return experts


def _expert_map(world, rank):
    """vLLM's expert_map for linear placement: global id -> local id, -1 on other ranks' experts."""
    m = torch.full((E,), -1, dtype=torch.int32)
    L = E // world
    m[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    return m


def _run_kernel(pf, world, rank, steps=2, reduced=False):
    """vLLM's FusedMoEKernel(prepare/finalize, experts) on this rank's inputs; returns max errors."""
    kernel = mk.FusedMoEKernel(pf, _experts_for(pf, world, rank, reduced))
    w1, w2 = _weights()
    local = slice(rank * (E // world), (rank + 1) * (E // world))
    expert_map = _expert_map(world, rank) if world > 1 else None
    errs = []
    for step in range(steps):
        x, ids, weights = _inputs(world, 10 + step)[rank]
        y = kernel.apply(x, w1[local], w2[local], weights, ids, MoEActivation.SILU, E, expert_map, False)
        ref = _reference(x, ids, weights, w1, w2)
        errs.append(float((y.float() - ref).abs().max()) if x.shape[0] else 0.0)
    return errs


def test_vllm_version_and_class_shape():
    assert vllm.__version__.startswith(("0.32", "0.33")), vllm.__version__
    cls = adapter.prepare_finalize_class()
    assert issubclass(cls, getattr(mk, "FusedMoEPrepareAndFinalizeModular", mk.FusedMoEPrepareAndFinalize))
    assert not getattr(cls, "__abstractmethods__", None)
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    pf = cls(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    assert pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts
    assert (pf.max_num_tokens_per_rank(), pf.num_dispatchers(), pf.output_is_reduced()) == (MAXT, 1, True)


def test_modular_kernel_world1_equals_reference():
    _cpu_shims()
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    pf = adapter.prepare_finalize_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    assert max(_run_kernel(pf, 1, 0)) < 0.05


@pytest.mark.parametrize("reduced", [False, True])
def test_standard_format_modular_kernel_world1_equals_reference(reduced):
    """MoECommStandardPrepareAndFinalize (PrefillBuffer) in vLLM's modular kernel with Standard-format
    experts: unreduced rows (vLLM's TopKWeightAndReduceContiguous runs in finalize) and reduced rows."""
    _cpu_shims()
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    cls = adapter.prepare_finalize_class("high_throughput")
    assert cls is adapter.MoECommStandardPrepareAndFinalize
    assert issubclass(cls, getattr(mk, "FusedMoEPrepareAndFinalizeModular", mk.FusedMoEPrepareAndFinalize))
    assert not getattr(cls, "__abstractmethods__", None)
    pf = cls(PrefillBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
    assert pf.activation_format == mk.FusedMoEActivationFormat.Standard
    assert (pf.num_dispatchers(), pf.output_is_reduced(), pf.supports_async()) == (1, True, True)
    assert max(_run_kernel(pf, 1, 0, reduced=reduced)) < 0.05


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "moe_comm.serving.vllm_plugin:register" for ep in eps)


def _plugin_rank(group, mode="low_latency"):
    """One shm rank: vLLM's own maybe_make_prepare_finalize, hooked by the plugin and asked through
    --additional-config, builds our prepare/finalize of ``mode`` (the format the experts oracles read
    follows it); then vLLM's modular kernel runs on it."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import all2all_utils

    _cpu_shims()
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent
    adapter.use_group(group)
    world, rank = group.world_size, group.rank
    moe = _moe_config(world, rank)
    plain = all2all_utils.maybe_make_prepare_finalize.moe_comm_original
    assert all2all_utils.maybe_make_prepare_finalize.moe_comm_original is plain
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"),
                                            additional_config={"moe_comm": {"backend": "shm", "mode": mode}})):
        batched = mode == "low_latency"
        assert moe.moe_parallel_config.use_batched_activation_format == batched
        pf = all2all_utils.maybe_make_prepare_finalize(moe=moe, quant_config=None, allow_new_interface=True)
        assert type(pf).__name__ == ("MoECommPrepareAndFinalize" if batched else "MoECommStandardPrepareAndFinalize")
        errs = _run_kernel(pf, world, rank)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        assert not moe.moe_parallel_config.use_batched_activation_format
    return errs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
def test_plugin_and_modular_kernel_world2_shm(mode):
    errs = moe_comm.launch(_plugin_rank, 2, mode, backend="shm", timeout_s=120)
    assert max(e for r in errs for e in r) < 0.05, errs


def _metrics_rank(group):
    """``_plugin_rank`` (vLLM's own factory, hooked, then its modular kernel: two steps), then the refresher
    thread's next two refreshes (the second began after the steps)."""
    import time

    from moe_comm import metrics

    _plugin_rank(group)
    exp, deadline = metrics.exporter(), time.monotonic() + 60
    done = exp.refreshes + 2
    while exp.refreshes < done and time.monotonic() < deadline:
        time.sleep(0.1)
    return exp.refreshes >= done


def test_metrics_reach_vllms_registry(tmp_path, monkeypatch):
    """moe-comm's metrics are where vLLM's /metrics reads, ``vllm.v1.metrics.prometheus.get_prometheus_registry``:
    in this process (no PROMETHEUS_MULTIPROC_DIR: prometheus_client's REGISTRY) once the adapter made its
    group; across processes (PROMETHEUS_MULTIPROC_DIR set, as vLLM sets it for several API servers) from two
    shm ranks that built the prepare/finalize through vLLM's factory and ran its kernel."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from moe_comm.serving import ep_group

    def scrape(registry, name, **labels):
        """rank -> value of metric ``name`` with ``labels``, from the registry's exposition text."""
        return {s.labels["rank"]: s.value for fam in text_string_to_metric_families(generate_latest(registry).decode())
                for s in fam.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}

    def calls(registry):
        return scrape(registry, "moe_comm_calls_total", op="dispatch")

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    adapter.use_group(g)
    assert ep_group.process_group() is g
    assert "0" in scrape(get_prometheus_registry(), "moe_comm_epoch")

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv("MOE_COMM_METRICS_INTERVAL_S", "0.2")
    assert moe_comm.launch(_metrics_rank, 2, backend="shm", timeout_s=120) == [True, True]
    got = calls(get_prometheus_registry())   # vLLM's multiprocess registry over the directory
    assert got["0"] >= 2 and got["1"] >= 2, got


def test_silent_peer_is_raised_by_name_and_stays():
    """Rank 1 never dispatches: rank 0's prepare raises CommTimeoutError naming it, and so does the next
    step's prepare (the group is failed until reset), so vLLM's worker stops instead of serving on."""
    from moe_comm.errors import CommTimeoutError

    groups = moe_comm.init(backend="loopback", world_size=2, timeout_s=0.5, device="cpu")
    pf0, _ = [adapter.prepare_finalize_class()(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))
              for g in groups]
    x, ids, weights = _inputs(1, 3)[0]
    args = (x, weights, ids, E, None, False, moe_config_module.FUSED_MOE_UNQUANTIZED_CONFIG, False)
    hook, receiver = pf0.prepare_async(*args)
    with pytest.raises(CommTimeoutError, match="waiting for peer rank 1"):
        receiver()
    with pytest.raises(CommTimeoutError, match="peer rank 1"):
        pf0.prepare(*args)


def test_readme_snippet():
    import os
    import subprocess
    import sys

    snippet = os.path.join(os.path.dirname(os.path.abspath(__file__)), "readme_snippet.py")
    run = subprocess.run([sys.executable, snippet], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(snippet))))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == "MoECommPrepareAndFinalize [1, 1, 1, 1, 1, 1, 0, 1]", run.stdout
