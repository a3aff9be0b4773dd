"""Serving: every MoE comm backend's greedy decoding equals the single-process reference model.

Tolerance: float32 on the CPU; logits may differ from the reference only by summation order (batched vs
per-expert matmuls, cached vs full attention), so every step's logits must be within 1e-4 of the reference
relative to the largest |logit| (observed: below 1e-6), and every generated token must be equal.
Bucket padding must change nothing at all (bitwise).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import moe_comm
from moe_comm.serving import (
    DecodeEngine,
    Generation,
    MoEDecoder,
    ReferenceModel,
    Request,
    build_weights,
    bucket_sizes,
    check_generation,
    make_comms,
    model_config,
)
from moe_comm.serving.backends import positions_by_key

import budget

RTOL = 1e-4
HAS_EP = importlib.util.find_spec("moe_comm.ep") is not None
BACKENDS = ["sync", "padded", "dynamic"] + (["fused"] if HAS_EP else [])
MAX_BATCH = 4


def _requests(rank: int, world: int, vocab: int) -> list[Request]:
    """Mixed prompt lengths and lengths to generate (the batch shrinks across buckets while decoding);
    in a multi-rank world the last rank has no requests at all."""
    if world > 1 and rank == world - 1:
        return []
    g = torch.Generator().manual_seed(7 + rank)
    n = (3, 2, 1)[rank % 3]  # 3 live rows pad to bucket 4, then shrink
    return [Request(torch.randint(0, vocab, (1 + (3 * i + rank) % 5,), generator=g).tolist(), 2 + (i + rank) % 3)
            for i in range(n)]


def _serve(groups, config: str, backends: list[str], buckets=None, poison_pad=False, expert_impl=None,
           attention_impl="torch") -> dict:
    """Run every backend on the ranks in ``groups`` -> {backend: per local rank [(tokens, logits)]}."""
    torch.set_num_threads(1)
    cfg = model_config(config, "cpu")
    world = groups[0].world_size
    full = build_weights(cfg)
    out = {}
    for name in backends:
        comms = make_comms(name, groups, cfg, MAX_BATCH)
        models = [MoEDecoder(full.for_rank(g.rank, world), c, MAX_BATCH, phased=len(groups) > 1,
                             expert_impl=expert_impl, attention_impl=attention_impl) for g, c in zip(groups, comms)]
        engine = DecodeEngine(models, buckets=buckets)
        assert not engine.use_graphs  # CPU: never graphs
        if poison_pad:  # junk in what padding rows read: their token and their scratch KV-cache slot
            for m, seq in zip(models, engine.seq_tokens):
                seq[m.pad_slot] = torch.randint(0, cfg.vocab, seq[m.pad_slot].shape)
                m.k_cache[:, m.pad_slot].normal_(0, 100)
                m.v_cache[:, m.pad_slot].normal_(0, 100)
        reqs = [_requests(g.rank, world, cfg.vocab) for g in groups]
        gens = engine.generate(reqs, record_logits=True)
        out[name] = [[(g.tokens, g.logits) for g in per_rank] for per_rank in gens]
        for c in comms:
            c.close()
    return out


def _serve_rank(group, config, backends):
    return _serve([group], config, backends)


def _assert_matches_reference(config: str, world: int, per_backend: dict, ranks: list[int],
                              attention_impl: str = "torch"):
    cfg = model_config(config, "cpu")
    ref = ReferenceModel(build_weights(cfg), attention_impl)
    for name, per_rank in per_backend.items():
        for rank, outs in zip(ranks, per_rank):
            reqs = _requests(rank, world, cfg.vocab)
            assert len(outs) == len(reqs)
            for i, (req, (tokens, logits)) in enumerate(zip(reqs, outs)):
                ref_tokens, _ = ref.generate(req.prompt, req.max_new_tokens)
                assert tokens == ref_tokens, f"{name} rank {rank} request {i}"
                check_generation(ref, req, Generation(tokens, logits), RTOL, f"{name} rank {rank} request {i}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,config", [(1, "llama4-maverick"), (2, "mixtral"), budget.sweep(4, "deepseek-v3")])
def test_process_ranks_match_reference(world, config):
    """One process per rank over the shm heap (gloo for the baselines); the last rank is idle when world > 1."""
    results = moe_comm.launch(_serve_rank, world, config, BACKENDS, backend="shm", timeout_s=120)
    per_backend = {name: [res[name][0] for res in results] for name in BACKENDS}
    _assert_matches_reference(config, world, per_backend, list(range(world)))
    if world > 1:
        assert all(per_backend[name][-1] == [] for name in BACKENDS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,expert_impl,attention_impl", [(2, "dense", "torch"), (2, "masked", "torch"),
                                                               (1, "masked", "torch"), (2, "dense", "triton")])
def test_loopback_ranks_match_reference(world, expert_impl, attention_impl):
    """Every rank in one process, driven phase by phase (how worlds are emulated on one GPU); with the
    torch.bmm experts and with the masked Triton expert GEMMs the GPU runs by default (at world 1 with a
    grid of T * top-k expert slots), and with the Triton attention that reads only visible positions."""
    config = "llama4-scout"
    groups = moe_comm.init(backend="loopback", world_size=world)
    per_backend = _serve(groups, config, BACKENDS, expert_impl=expert_impl, attention_impl=attention_impl)
    _assert_matches_reference(config, world, per_backend, list(range(world)), attention_impl)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bucket_padding_changes_nothing(backend):
    """Padding rows cannot reach real rows: with junk in everything a padding row reads, every logit is
    bitwise the same. Against unpadded batches (every size a bucket) the matmuls have other shapes, so
    only the stated float32 tolerance applies there, and tokens must be equal."""
    world, config = 2, "mixtral"
    assert len(_requests(0, world, 128)) == 3  # 3 live rows pad to bucket 4, later 2 and 1 live rows
    runs = {}
    for label, kw in [("padded", {}), ("poisoned", dict(poison_pad=True)),
                      ("unpadded", dict(buckets=list(range(1, MAX_BATCH + 1))))]:
        groups = moe_comm.init(backend="loopback", world_size=world)
        runs[label] = _serve(groups, config, [backend], **kw)[backend][0]
    for (tok, lg), (tok_x, lg_x), (tok_u, lg_u) in zip(runs["padded"], runs["poisoned"], runs["unpadded"]):
        assert tok == tok_x == tok_u
        assert torch.equal(lg, lg_x)
        assert ((lg - lg_u).abs().max() / lg_u.abs().max()).item() <= RTOL


@pytest.mark.timeout(120)
def test_fused_prefill_runs_on_the_prefill_buffer():
    """The fused backend's prefill chunks go through its PrefillBuffer (one dispatch per chunk and layer,
    every rank, the idle one included), its decode steps through the EPBuffer; the generation equals the
    reference (loopback world 2, phased)."""
    config, world = "mixtral", 2
    cfg = model_config(config, "cpu")
    groups = moe_comm.init(backend="loopback", world_size=world)
    comms = make_comms("fused", groups, cfg, MAX_BATCH)
    full = build_weights(cfg)
    models = [MoEDecoder(full.for_rank(g.rank, world), c, MAX_BATCH, phased=True, expert_impl="dense",
                         attention_impl="torch") for g, c in zip(groups, comms)]
    reqs = [_requests(g.rank, world, cfg.vocab) for g in groups]
    chunks = max(-(-sum(len(r.prompt) for r in rs) // MAX_BATCH) for rs in reqs)
    gens = DecodeEngine(models).generate(reqs, record_logits=True)
    assert [c.prefill.buf._calls for c in comms] == [chunks * cfg.num_layers] * world
    _assert_matches_reference(config, world, {"fused": [[(g.tokens, g.logits) for g in per] for per in gens]},
                              list(range(world)))
    for c in comms:
        c.close()


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("n,keys", [(0, 3), (1, 1), (17, 4)])
def test_positions_by_key(n, keys):
    key = torch.randint(0, keys + 1, (n,), generator=torch.Generator().manual_seed(n))
    pos, counts = positions_by_key(key, keys)
    seen = [0] * (keys + 1)
    for i, k in enumerate(key.tolist()):
        assert pos[i] == (seen[k] if k < keys else -1)
        seen[k] += 1
    assert counts.tolist() == seen[:keys]


def test_bad_input_is_refused():
    cfg = model_config("mixtral", "cpu")
    [group] = moe_comm.init(backend="loopback", world_size=1)
    comm = make_comms("padded", [group], cfg, 2)[0]
    with pytest.raises(ValueError, match="max_tokens"):
        comm.dispatch(torch.zeros(3, cfg.hidden), torch.zeros(3, cfg.topk, dtype=torch.int64))
    engine = DecodeEngine([MoEDecoder(build_weights(cfg), comm, 2)])
    with pytest.raises(ValueError, match="max_batch"):
        engine.generate([[Request([1], 1)] * 3])
    with pytest.raises(ValueError, match="max_seq"):
        engine.generate([[Request([1] * cfg.max_seq, 1)]])


@pytest.mark.timeout(120)
def test_decode_bench_writes_table_json_and_png(tmp_path, capsys):
    """The benchmark end to end, tiny: loopback world 2 in this process, one batch size, two timed steps."""
    import json  # noqa: PLC0415

    from moe_comm.serving.latency_bench import main  # noqa: PLC0415
    assert main(["--config", "mixtral", "--heap", "loopback", "--world", "2", "--batches", "2",
                 "--backends", ",".join(BACKENDS), "--steps", "2", "--warmup", "1", "--check-steps", "2",
                 "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "reference check passed" in printed and "vs sync" in printed
    [jsonl] = tmp_path.glob("*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {(r["backend"], r["batch_per_rank"]) for r in records} == {(b, 2) for b in BACKENDS}
    for r in records:
        assert r["steps"] == 2 and 0 < r["us_p20"] <= r["us_p50"] <= r["us_p80"]
        assert r["emulated"] is True  # a loopback world is labelled as emulated, whatever the backend
        assert r["device"].startswith("cpu") and r["cuda_graphs"] is False and r["commit"]
    [png] = tmp_path.glob("*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_decode_profile_splits_the_step_into_parts(tmp_path, capsys):
    """--profile: every part of the step gets a time, the parts fit inside the step (a range counted twice,
    or one outside the step, would break that), a line per (backend, batch, part), and the model's ranges
    are switched off again afterwards."""
    import json  # noqa: PLC0415

    from moe_comm.serving import model as model_mod  # noqa: PLC0415
    from moe_comm.serving.latency_bench import main  # noqa: PLC0415
    from moe_comm.serving.step_profile import PARTS  # noqa: PLC0415
    assert main(["--profile", "--config", "llama4-scout", "--heap", "loopback", "--batches", "1,3",
                 "--backends", "padded,fused", "--steps", "2", "--warmup", "1", "--out-dir", str(tmp_path)]) == 0
    assert model_mod.PROFILE_SPANS is False
    assert "not a GPU measurement" in capsys.readouterr().out
    [jsonl] = tmp_path.glob("decode_profile_*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(records) == 2 * 2 * (len(PARTS) + 2)
    for backend in ("padded", "fused"):
        for batch in (1, 3):
            got = {r["part"]: r["us_per_step"] for r in records
                   if (r["backend"], r["batch_per_rank"]) == (backend, batch)}
            assert all(got[p] > 0 for p in PARTS), got  # Scout has a shared expert: every part runs
            assert sum(got[p] for p in PARTS) <= got["step"] * 1.001, got
            assert got["other"] == pytest.approx(got["step"] - sum(got[p] for p in PARTS), abs=1e-6)


@budget.SWEEP
@pytest.mark.timeout(300)
def test_decode_bench_under_torchrun(tmp_path):
    """The several-GPU launch path (torchrun, one process per rank, torch.distributed bootstrap), run on
    the CPU: 2 ranks over the shm heap, every backend checked against the reference, records written."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "bench/decode_latency.py",
           "--config", "mixtral", "--batches", "1", "--steps", "2", "--warmup", "1", "--check-steps", "2",
           "--heap", "shm", "--backends", "sync,fused", "--out-dir", str(tmp_path)]
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reference check passed" in out.stdout and "2 processes, shm heap" in out.stdout
    [jsonl] = tmp_path.glob("*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {(r["backend"], r["world"]) for r in records} == {("sync", 2), ("fused", 2)}


def test_profile_device_time_goes_to_the_innermost_range():
    """The GPU profile's attribution, on made-up profiler events (ns): work by its midpoint into the
    innermost range, ranges' device-side copies and launch calls ignored, work in no step "outside"."""
    from moe_comm.serving.step_profile import device_span_times  # noqa: PLC0415

    class Ev:
        def __init__(self, where, name, start, dur):
            self.where, self.n, self.start, self.dur = where, name, start, dur

        def device_type(self):
            return torch.autograd.DeviceType.CUDA if self.where == "gpu" else torch.autograd.DeviceType.CPU

        def name(self):
            return self.n

        def start_ns(self):
            return self.start

        def end_ns(self):
            return self.start + self.dur

        def duration_ns(self):
            return self.dur

    events = [Ev("cpu", "moe::step", 0, 100_000), Ev("cpu", "moe::dispatch", 10_000, 20_000),
              Ev("cpu", "moe::unknown", 40_000, 20_000), Ev("cpu", "other", 0, 100_000),
              Ev("gpu", "moe::step", 5_000, 90_000), Ev("cpu", "cuLaunchKernel", 11_000, 1_000),
              Ev("gpu", "dispatch_kernel", 12_000, 4_000), Ev("gpu", "memset", 26_000, 10_000),
              Ev("gpu", "norm", 45_000, 6_000), Ev("gpu", "copy", 98_000, 2_000),
              Ev("gpu", "late", 99_000, 8_000), Ev("gpu", "before", -9_000, 2_000)]
    got = device_span_times(events, steps=2)
    assert got["dispatch"] == pytest.approx(2.0)  # the kernel (4 µs) over 2 steps; the memset runs past it
    assert got["step"] == pytest.approx((4 + 10 + 6 + 2) / 2)  # "late": midpoint 103 µs, past the step
    assert got["other"] == pytest.approx((10 + 6 + 2) / 2)
    assert got["outside"] == pytest.approx((8 + 2) / 2)
    assert all(got[p] == 0 for p in ("attention", "experts", "combine", "router"))
    assert got["kernels"] == {"dispatch": {"dispatch_kernel": 2.0}, "other": {"memset": 5.0, "norm": 3.0, "copy": 1.0}}
