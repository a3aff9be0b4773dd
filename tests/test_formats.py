"""The payload formats (``moe_comm.formats``), end to end, against ``moe_comm.reference``.

The fp8 dispatch formats (float32 amax / 448 scales, power-of-two float32, packed UE8M0) and pre-quantized
prefill input: tests/ep_cases.py and tests/prefill_cases.py hold a config of each fp8 format, so the
EPBuffer and PrefillBuffer matrices (test_ep, test_prefill: shm and loopback worlds 1-4, EP shm world 3
under ``make test-long``), the emulated nodes (test_emulated_nodes: EPBuffer, PrefillBuffer and the DeepEP
door across nodes, every cross-node byte on the emulated wire) and the put transport (test_put_transport)
check them bit for bit. Here: the EPBuffer fp8 formats on shm world 3; pre-quantized PrefillBuffer input
(codes and scales no quantizer produces, so a dequantize/requantize on the way would show) on loopback
worlds 1-3 and shm world 3, row-major and column-major scales.

The low-precision formats (tests/format_cases.py): EPBuffer and PrefillBuffer with dispatch_format='nvfp4'
and combine_format='e4m3', bit for bit at worlds 1-3 on shm ranks (processes) and loopback (one process),
EPBuffer across emulated nodes (every cross-node byte a put on the emulated wire, including the combine's
staged runs); PrefillBuffer refuses both across nodes.

Every bad combination raises before anything is sent, naming the fix, and the next call is exact on every
rank. What the CPU cannot show: compiled code's bits (the quantizers avoid every conversion instruction
whose rounding could differ, see triton_kernels/quant.py; tests/test_compile_sm90.py checks their PTX), or
timing.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import EPBuffer, PrefillBuffer, formats, reference
from moe_comm.heap.shm import RANKS_PER_NODE_ENV

import format_cases
from budget import SWEEP, size, sweep
from ep_cases import FORMAT_CONFIGS, Config, make_inputs, run_shm_cases
from prefill_cases import check_dispatch, make_buffer, partial_rows, poison, round_trip
from shm_files import own_shm_files

H = 512   # one UE8M0 word per row: the smallest hidden every fp8 format takes

# Share of the (config, routing) cases each world runs (format_cases.cases: every config at every world at
# any share up to 4); make test-long runs them all.
LOOPBACK_EVERY = size(4, 1)
SHM_EVERY = size(4, 1)
# Emulated nodes: one node per rank (every peer by puts) in make test-sweeps; also two ranks per node (stores
# and puts in one group) in make test-long.
NODE_LAYOUTS = size([sweep(3, 1)], [(3, 1), (4, 2)])



@pytest.mark.timeout(300)
def test_ep_formats_shm_world3():
    errs = moe_comm.launch(run_shm_cases, 3, FORMAT_CONFIGS, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


# ---- pre-quantized PrefillBuffer input ------------------------------------------------------------

def prequantized(xs, fmt: str, seed: int, column_major: bool = False):
    """Per rank (codes, scales) of format ``fmt`` that no quantizer makes from any x: random finite codes
    (NaN bytes replaced) and random scales (float32 of 1e-6..1e6; UE8M0 bytes for 2**-27..2**27), so only a
    byte copy delivers them. ``column_major``: scales with stride 1 along the tokens (SGLang's layout)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for x in xs:
        T = x.shape[0]
        codes = torch.randint(0, 256, (T, H), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x11                     # e4m3fn NaN codes are not data
        cols = formats.scale_columns(fmt, H)
        if fmt == formats.E4M3_UE8M0:
            scales = reference.pack_ue8m0(torch.randint(100, 155, (T, 4 * cols), generator=g))   # 2**-27..2**27
        else:
            scales = torch.randn(T, cols, generator=g) * 10.0 ** torch.randint(-6, 6, (T, cols), generator=g)
        if column_major:
            scales = scales.t().contiguous().t()
        out.append((codes.view(torch.float8_e4m3fn), scales))
    return out


def _prequant_round(bufs, cfg, seed, column_major=False):
    """One checked dispatch -> combine of pre-quantized tokens on a loopback world, phase by phase."""
    xs, idxs, ws = make_inputs(cfg, len(bufs), "random", seed)
    return round_trip(bufs, cfg, prequantized(xs, cfg.fp8, seed, column_major), idxs, ws, f"seed{seed}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", [formats.E4M3, formats.E4M3_UE8M0])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_prequantized_prefill_loopback(world, fmt):
    """recv_x and recv_scales hold the given codes and scales bit for bit, row-major or column-major
    scales given; the combine of their dequantized rows is exact; T = 0 ranks included."""
    cfg = Config(3, H, 3, 2, fp8=fmt)
    bufs = [make_buffer(g, cfg) for g in moe_comm.init(backend="loopback", world_size=world, device="cpu")]
    assert _prequant_round(bufs, cfg, 11 * world) == []
    assert _prequant_round(bufs, cfg, 11 * world + 1, column_major=True) == []


def _prequant_shm(group):
    errs = []
    for fmt in (formats.E4M3_POW2, formats.E4M3_UE8M0):
        cfg = Config(2, H, 3, 3, fp8=fmt)
        buf = make_buffer(group, cfg)
        world, rank = group.world_size, group.rank
        for seed in (5, 6):
            xs, idxs, ws = make_inputs(cfg, world, "random", seed)
            pre = prequantized(xs, fmt, seed, column_major=seed % 2 == 0)
            exp_d = reference.prefill_dispatch(pre, idxs, ws, cfg.experts_per_rank * world, cfg.max_tokens)
            group.barrier()   # every rank's previous combine has read this zone: it may be poisoned
            poison(buf)
            group.barrier()   # peers write this zone as soon as the dispatch starts: poisoned first
            d = buf.dispatch(pre[rank], idxs[rank], ws[rank])
            errs += check_dispatch(d, exp_d[rank], cfg, f"shm rank{rank} {fmt} seed{seed}")
            parts = [partial_rows(e["x"], e["scales"], r, cfg.dtype) for r, e in enumerate(exp_d)]
            want = reference.prefill_combine(parts, idxs, cfg.experts_per_rank * world, cfg.max_tokens)[rank]
            eo = partial_rows(d.recv_x, d.recv_scales, rank, cfg.dtype)
            if not torch.equal(buf.combine(eo, d.handle), want):
                errs.append(f"shm rank{rank} {fmt} seed{seed}: combine differs")
        buf.close()
    return errs


@pytest.mark.timeout(300)
def test_prequantized_prefill_shm_world3():
    errs = moe_comm.launch(_prequant_shm, 3, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []


# ---- bad combinations: refused before anything is sent, the fix named; then exact ------------------

@pytest.mark.parametrize("cls", [EPBuffer, PrefillBuffer])
def test_bad_formats_are_refused_at_construction(cls):
    (g,) = moe_comm.init(backend="loopback", device="cpu")
    with pytest.raises(ValueError, match=r"hidden % 512 == 0.*got hidden=256: pad hidden to 512, or use "
                                         r"dispatch_format='e4m3' or 'e4m3-pow2'"):
        cls(g, 4, 256, 2, 2, dispatch_format="e4m3-ue8m0")
    with pytest.raises(ValueError, match=r"hidden % 128 == 0.*dispatch the buffer's dtype \(dispatch_format=None\)"):
        cls(g, 4, 192, 2, 2, dispatch_format="e4m3-pow2")
    with pytest.raises(ValueError, match=r"dispatch_format must be one of \(None, 'e4m3', 'e4m3-pow2', 'e4m3-ue8m0', "
                                         r"'nvfp4'\), got 'ue8m0'"):
        cls(g, 4, 512, 2, 2, dispatch_format="ue8m0")
    # fp8_dispatch is True or False (the earlier releases' API): a format name there says where it goes
    with pytest.raises(ValueError, match=r"fp8_dispatch is True or False .* got 'e4m3-pow2': name a format with "
                                         r"dispatch_format='e4m3-pow2'"):
        cls(g, 4, 512, 2, 2, fp8_dispatch="e4m3-pow2")
    with pytest.raises(ValueError, match=r"fp8_dispatch=True and dispatch_format='e4m3-ue8m0' name two formats: "
                                         r"pass dispatch_format='e4m3-ue8m0' alone"):
        cls(g, 4, 512, 2, 2, fp8_dispatch=True, dispatch_format="e4m3-ue8m0")
    b = cls(g, 4, 512, 2, 2, fp8_dispatch=True)
    assert (b.fp8_dispatch, b.dispatch_format) == (True, "e4m3")
    b = cls(g, 4, 512, 2, 2, fp8_dispatch=True, dispatch_format="e4m3")   # the same format twice: no conflict
    assert (b.fp8_dispatch, b.dispatch_format) == (True, "e4m3")
    b = cls(g, 4, 512, 2, 2, dispatch_format="e4m3-ue8m0")
    assert (b.fp8_dispatch, b.dispatch_format) == (True, "e4m3-ue8m0")
    b = cls(g, 4, 512, 2, 2)
    assert (b.fp8_dispatch, b.dispatch_format, b.combine_format) == (False, None, None)


def test_bad_prequantized_input_raises_on_every_rank_before_any_send_then_exact():
    """Every rank passes the same bad pre-quantized x (scales of another format, codes not fp8, a 3-tuple,
    a buffer without fp8, an EPBuffer): each raises before sending (naming the fix), nobody waits, and the
    next call is exact on every rank."""
    world, cfg = 2, Config(3, H, 3, 2, fp8=formats.E4M3_UE8M0)
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0)
    bufs = [make_buffer(g, cfg) for g in groups]
    xs, idxs, ws = make_inputs(cfg, world, "random", 3)
    good = prequantized(xs, formats.E4M3_UE8M0, 3)
    bf16 = [make_buffer(g, Config(3, H, 3, 2)) for g in groups]
    bad = [  # (buffers, every rank's x, error, what it says)
        (bufs, prequantized(xs, formats.E4M3, 3), ValueError,
         r"x\[1\] \(the scales\) is torch.float32 .* takes torch.int32 .*dispatch_format='e4m3' for these scales"),
        (bufs, [(q.float(), s) for q, s in good], TypeError, r"x\[0\] \(the fp8 codes\) has dtype torch.float32"),
        (bufs, [(q, s, s) for q, s in good], ValueError, "a tuple of 3"),
        (bf16, good, TypeError, r"dispatch_format=None\): build it with dispatch_format='e4m3'")]
    for targets, inputs, kind, match in bad:
        for b, p, i, w in zip(targets, inputs, idxs, ws):
            with pytest.raises(kind, match=match):
                b.dispatch(p, i, w, phase="send")
    eps = [EPBuffer(g, 3 * world, H, 3, 2, dispatch_format=formats.E4M3_UE8M0) for g in groups]
    for ep, p, i in zip(eps, good, idxs):
        with pytest.raises(TypeError, match="pre-quantized tokens with moe_comm.PrefillBuffer"):
            ep.dispatch(p, i, phase="send")
    for g in groups:
        g.check()
    assert _prequant_round(bufs, cfg, 4) == []


# ---- the low-precision formats (format_cases) ----------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, sweep(3)])
def test_ep_formats_shm(world):
    errs = moe_comm.launch(format_cases.run_ep_shm, world, SHM_EVERY, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, sweep(3)])
def test_ep_formats_loopback(world):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    assert format_cases.run_ep_loopback(groups, LOOPBACK_EVERY) == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, sweep(3)])
def test_prefill_formats_shm(world):
    errs = moe_comm.launch(format_cases.run_prefill_shm, world, SHM_EVERY, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, sweep(3)])
def test_prefill_formats_loopback(world):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    assert format_cases.run_prefill_loopback(groups, LOOPBACK_EVERY) == []


def _across_nodes(group):
    """The EP cases with every peer on another node: the group reaches them by puts only."""
    far = [j for j in range(group.world_size) if group.heap.node[j] != group.heap.node[group.rank]]
    before = group.heap.wire.stats["payload"]
    errs = format_cases.run_ep_shm(group, SHM_EVERY)
    if not far or group.heap.wire.stats["payload"] <= before:
        errs.append(f"rank {group.rank}: nothing crossed the wire (peers on other nodes: {far})")
    return errs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, per_node", NODE_LAYOUTS)
def test_ep_formats_across_emulated_nodes(world, per_node, monkeypatch):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    errs = moe_comm.launch(_across_nodes, world, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


# ---- nvfp4: one global scale on every rank, checked by every receiver ----------------------------------------

def _scale_round(bufs, xs, idxs, gss, prefill):
    """One nvfp4 dispatch -> combine on a loopback world, rank r with global scale gss[r], every token to
    expert 0 (rank 0's), phase by phase: per rank the dispatch result (or the GlobalScaleError it raised,
    whose ``result`` is that call's), and rank 0's rows from each source (codes, scales), copied before the
    combine (PrefillBuffer's combine writes its zone)."""
    ws = [torch.ones(i.shape) for i in idxs]
    for r, b in enumerate(bufs):
        args = (xs[r], idxs[r], ws[r]) if prefill else (xs[r], idxs[r])
        b.dispatch(*args, phase="send", global_scale=gss[r])
    out = []
    for b in bufs:
        try:
            out.append(b.dispatch(phase="recv"))
        except moe_comm.GlobalScaleError as e:
            out.append(e)
    d0 = out[0].result if isinstance(out[0], Exception) else out[0]
    m = xs[0].shape[0]
    rows = [tuple(t.clone() for t in _rows_from(d0, s, m, prefill)) for s in range(len(bufs))]
    for r, (b, d) in enumerate(zip(bufs, out)):   # the handle of a call that raised a data error works
        d = d.result if isinstance(d, Exception) else d
        if prefill:
            b.combine(torch.zeros(d.recv_x.shape[0], b.hidden, dtype=torch.bfloat16), d.handle, phase="send")
        else:
            b.combine(torch.zeros(*d.x.shape[:2], b.hidden, dtype=torch.bfloat16), ws[r], d.handle, phase="send")
    for b in bufs:
        b.combine(phase="recv")
    return out, rows


def _rows_from(d, source, m, prefill):
    """(codes, scales) of the rows a dispatch result holds from ``source`` (every token to expert 0)."""
    if prefill:
        return d.recv_x[source * m:(source + 1) * m], d.recv_scales[source * m:(source + 1) * m]
    return d.x[0, source * m:(source + 1) * m], d.scales[0, source * m:(source + 1) * m]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prefill, transport", [(False, "store"), (False, "put"), (True, "store")],
                         ids=["ep", "ep-put", "prefill"])
def test_nvfp4_global_scales_that_differ_between_ranks_raise_then_the_next_call_is_exact(prefill, transport,
                                                                                        monkeypatch):
    """Issue 46's reproducer: loopback world 2, rank 1's x 100 times rank 0's, every token to expert 0,
    each rank's global scale computed from its own x (``reference.nvfp4_global_scale(x)``, the usage the
    docs used to show): the receiver dequantizes every row with its own scale, so rank 1's rows came out at
    about 0.01 of their value on rank 0, and nothing said so. Now every source's scale travels with its
    control words and every receiver compares it with its own: both ranks raise GlobalScaleError naming
    the other rank and both scales, carrying the call's result (the rows kept as sent: rank 1's are its own
    quantization, and dequantized with rank 0's scale they are peer_scale / own_scale of their value). The
    next call, with the all-reduced scale on every rank, is exact: rank 1's rows dequantize to its x's
    quantization. EPBuffer also with every peer reached by puts (MOE_COMM_TRANSPORT=put: the scale travels
    in the staged control words); PrefillBuffer's nvfp4 is one node only."""
    monkeypatch.setenv("MOE_COMM_TRANSPORT", transport)
    m, hidden = 4, 128
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    assert groups[0].uses_put == (transport == "put")
    cls = PrefillBuffer if prefill else EPBuffer
    bufs = [cls(g, 4, hidden, m, 1, dispatch_format="nvfp4") for g in groups]
    g = torch.Generator().manual_seed(46)
    xs = [(torch.randn(m, hidden, generator=g) * f).to(torch.bfloat16) for f in (1.0, 100.0)]
    idxs = [torch.zeros(m, 1, dtype=torch.int64)] * 2
    own = [reference.nvfp4_global_scale(x) for x in xs]
    got, rows = _scale_round(bufs, xs, idxs, own, prefill)
    for r, err in enumerate(got):   # rank 1 holds no row (expert 0 is rank 0's), and raises all the same
        assert isinstance(err, moe_comm.GlobalScaleError), (r, err)
        assert (err.rank, err.peer, err.peer_scale, err.own_scale) == (r, 1 - r, float(own[1 - r]), float(own[r]))
        assert "same global_scale" in str(err) and "all-reduced" in str(err) and "calibrated" in str(err)
    for s, (codes, scales) in enumerate(rows):   # rank 0's rows, as sent: each source's own quantization
        want = reference.quantize_nvfp4(xs[s], own[s])
        assert torch.equal(codes, want[0]) and torch.equal(scales.view(torch.uint8), want[1].view(torch.uint8))
    ratio = reference.dequantize_nvfp4(*rows[1], own[0]).norm() / reference.dequantize_nvfp4(*rows[1], own[1]).norm()
    assert float(ratio) == pytest.approx(float(own[1] / own[0]), rel=1e-6)
    assert groups[0].error_counts == {("global_scale", "prefill.dispatch" if prefill else "dispatch", "1"): 1}

    gs = reference.nvfp4_global_scale(torch.cat(xs))   # the max |x| over the ranks: one scale everywhere
    ds, rows = _scale_round(bufs, xs, idxs, [gs, gs], prefill)
    assert not [d for d in ds if isinstance(d, Exception)], ds
    for s, (codes, scales) in enumerate(rows):
        want = reference.quantize_nvfp4(xs[s], gs)
        assert torch.equal(codes, want[0]) and torch.equal(scales.view(torch.uint8), want[1].view(torch.uint8))
        assert torch.equal(reference.dequantize_nvfp4(codes, scales, gs), reference.dequantize_nvfp4(*want, gs))
    for gr in groups:
        gr.check()


def _one_scale_differs(group):
    """A rank of a launched group, EPBuffer nvfp4 (format_cases config 0): the last rank passes twice the
    others' global scale. Every rank raises GlobalScaleError naming a source whose scale differs from its
    own (the others: the last rank; the last rank: rank 0) and both scales; its result's handle combines.
    Then two calls with one scale everywhere are exact (format_cases.ep_call). Returns the problems."""
    rank, odd, ci = group.rank, group.world_size - 1, 0
    ep = format_cases.make_ep(group, ci)
    case = format_cases.Case(ci, "random", 4600)
    cfg, fmt, cfmt, xs, idxs, ws, gs = format_cases.inputs(case, group.world_size)
    scale = [gs * 2 if r == odd else gs for r in range(group.world_size)]
    errs = []
    try:
        ep.dispatch(xs[rank], idxs[rank], global_scale=scale[rank])
        errs.append(f"rank {rank}: no GlobalScaleError")
    except moe_comm.GlobalScaleError as e:
        peer = 0 if rank == odd else odd
        if (e.rank, e.peer, e.peer_scale, e.own_scale) != (rank, peer, float(scale[peer]), float(scale[rank])):
            errs.append(f"rank {rank}: {e!r} names the wrong source or scales")
        d = format_cases.snapshot(e.result)
        ep.combine(format_cases.expert_outputs(d, rank, cfg), ws[rank], d.handle)
    return errs + format_cases.ep_call(ep, rank, format_cases.Case(ci, "skewed", 4601)) + \
        format_cases.ep_call(ep, rank, format_cases.Case(ci, "random", 4602), split=True)


@SWEEP
@pytest.mark.timeout(600)
def test_nvfp4_global_scales_that_differ_raise_across_emulated_nodes(monkeypatch):
    """EPBuffer's nvfp4 dispatch across emulated nodes, world 4 in 2 nodes of 2 (shm processes): the control
    words, the scale among them, cross the emulated wire as the put of the staged words with the flag as
    its signal. One rank's scale differs: every rank raises naming it (it names rank 0), and the next
    calls, with one scale, are exact on every rank. (make test runs the loopback case, stores and puts.)"""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    errs = moe_comm.launch(_one_scale_differs, 4, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


# ---- bad combinations: refused before anything is sent, naming the fix ------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(hidden=40, dispatch_format="nvfp4"), ValueError, r"multiple of 16 .* pad the hidden size to 64"),
    (dict(hidden=80, dispatch_format="nvfp4"), ValueError, r"multiple of 64 .* pad the hidden size to 128"),
    (dict(hidden=64, combine_format="e4m3"), ValueError, r"hidden % 128 == 0 .* combine_format=None"),
    (dict(dtype=torch.float32, combine_format="e4m3"), TypeError, r"bfloat16/float16 .* dtype=torch.bfloat16"),
    (dict(fp8_dispatch=True, dispatch_format="nvfp4"), ValueError, r"two formats: pass dispatch_format='nvfp4'"),
    (dict(dispatch_format="fp4"), ValueError,
     r"dispatch_format must be one of \(None, 'e4m3', 'e4m3-pow2', 'e4m3-ue8m0', 'nvfp4'\)"),
    (dict(fp8_dispatch=True, dispatch_format="e4m3-pow2"), ValueError, r"two formats: pass dispatch_format='e4m3-pow2'"),
    (dict(fp8_dispatch="e4m3"), ValueError, r"fp8_dispatch is True or False .* dispatch_format='e4m3'"),
    (dict(combine_format="fp8"), ValueError, r"combine_format must be one of \(None, 'e4m3'\), got 'fp8' \(fp8 is 'e4m3'"),
])
@pytest.mark.parametrize("cls", [EPBuffer, PrefillBuffer])
def test_bad_format_combinations_raise_at_construction(cls, kwargs, error, match):
    group = moe_comm.init(backend="loopback", device="cpu")[0]
    args = dict(hidden=128, dtype=torch.bfloat16)
    args.update(kwargs)
    hidden = args.pop("hidden")
    with pytest.raises(error, match=match):
        cls(group, 4, hidden, 4, 2, **args)
    with pytest.raises(error, match=match):   # the size check says the same without a group
        cls.required_bytes(2, 4, hidden, 4, 2, **args)


def _bad_calls(bufs, xs, idxs, ws, gs, prefill):
    """Every rank makes the same bad call of each kind in turn (a host-visible input error): each raises before
    its send, naming the fix (each rank takes part in the call without sending: its next launch drains it,
    so on a loopback world every rank refuses one call before any rank refuses the next)."""
    world = len(bufs)
    phase = "both" if world == 1 else "send"

    def dispatch(b, r, **kw):
        return b.dispatch(xs[r], idxs[r], ws[r], phase=phase, **kw) if prefill else \
            b.dispatch(xs[r], idxs[r], phase=phase, **kw)
    bad = ((TypeError, r"needs global_scale=.* same on every rank", None),
           (TypeError, r"global_scale has dtype torch.float64", gs.double()),
           (ValueError, r"global_scale has shape \(2,\): pass one element", gs.repeat(2)))
    for error, match, scale in bad:
        for r, b in enumerate(bufs):
            with pytest.raises(error, match=match):
                dispatch(b, r, global_scale=scale)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("prefill", [False, True])
def test_bad_calls_raise_before_sending_then_every_rank_is_exact(world, prefill):
    """nvfp4 without a usable global scale, a global scale given to another format, and (PrefillBuffer) an fp8
    combine of rows that lie in the zone: refused on every rank before any send; the next calls are exact."""
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0)
    ci = 2   # nvfp4 dispatch, fp8 combine
    make = format_cases.make_prefill if prefill else format_cases.make_ep
    bufs = [make(g, ci) for g in groups]
    case = format_cases.Case(ci, "random", 11)
    cfg, fmt, cfmt, xs, idxs, ws, gs = format_cases.inputs(case, world)
    _bad_calls(bufs, xs, idxs, ws, gs, prefill)
    plain = [EPBuffer(g, cfg.experts_per_rank * world, cfg.hidden, cfg.max_tokens, cfg.topk) for g in groups]
    for r, b in enumerate(plain):
        with pytest.raises(ValueError, match=r"global_scale is the nvfp4 dispatch's.* dispatch_format='nvfp4'"):
            b.dispatch(xs[r], idxs[r], phase="both" if world == 1 else "send", global_scale=gs)
    assert _exact_after(bufs, world, ci) == []
    if prefill:   # bf16 dispatch, fp8 combine: the in-place habit (expert_out = recv_x) is refused on every rank
        ci = 1
        bufs = [make(g, ci) for g in groups]
        cfg, fmt, cfmt, xs, idxs, ws, gs = format_cases.inputs(format_cases.Case(ci, "random", 12), world)
        for r, b in enumerate(bufs):
            b.dispatch(xs[r], idxs[r], ws[r], phase="send")
        ds = [b.dispatch(phase="recv") for b in bufs]
        for b, d in zip(bufs, ds):
            with pytest.raises(ValueError, match=r"lies in this PrefillBuffer's landing zone .* a tensor of their own"):
                b.combine(d.recv_x, d.handle, phase="both" if world == 1 else "send")
        assert _exact_after(bufs, world, ci) == []
    for g in groups:
        g.check()


def _exact_after(bufs, world, ci) -> list[str]:
    """Two more checked round trips on the same buffers (cases of config ``ci``)."""
    round_trip = format_cases.prefill_round_trip if isinstance(bufs[0], PrefillBuffer) else format_cases.ep_round_trip
    return [e for seed in (21, 22) for e in round_trip(bufs, format_cases.Case(ci, "random", seed))]


# ---- bytes on the wire: each format at its floor ----------------------------------------------------------

@pytest.mark.timeout(600)
def test_wire_carries_nvfp4_dispatch_and_fp8_combine_at_their_floor(monkeypatch, nodes=2, per_node=2):
    """Across emulated nodes the wire carries exactly the floor of each format (bench/wire_bytes.py: each
    routed token row once per destination rank, each routed slot's expert row once, rows of the format's
    bytes as formats.py defines them, computed there from the definition, not from the plan), odd sizes and
    unrouted slots included; an nvfp4 dispatch row and an fp8 combine row are the fractions of bf16's that
    docs/formats.md states."""
    import os  # noqa: PLC0415
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    import wire_bytes  # noqa: PLC0415
    hidden, topk = 256, 3
    args = wire_bytes.parse(["--nodes", str(nodes), "--ranks-per-node", str(per_node), "--tokens", "7",
                             "--hidden", str(hidden), "--experts", str(4 * nodes * per_node), "--topk", str(topk),
                             "--unrouted", "0.25", "--dispatch-format", "nvfp4", "--combine-format", "e4m3"])
    rows = wire_bytes.measure(args)
    for r in rows:
        assert r["dispatch_floor"] > 0 and r["combine_floor"] > 0, r
        assert r["dispatch_wire"] == r["dispatch_floor"] and r["combine_wire"] == r["combine_floor"], r
        assert (r["row_bytes"], r["out_row_bytes"]) == (r["plan_row_bytes"], r["plan_out_row_bytes"]), r
    # The rows at H = 256, K = 3: nvfp4 128 + 16 bytes + 12 routing + 4 token index = 160 (bf16: 512 + 16 =
    # 528); e4m3 256 + 8 scale bytes, padded to 272 (bf16: 512).
    assert rows[0]["row_bytes"] == 160 and wire_bytes.dispatch_row_bytes(None, hidden, topk) == 528
    assert rows[0]["out_row_bytes"] == 272 and wire_bytes.combine_row_bytes(None, hidden) == 512


@pytest.mark.timeout(300)
def test_prefill_moe_consumes_nvfp4_and_returns_through_the_fp8_combine():
    """A MoE layer through prefill_moe + local_experts (the library's stand-in expert stage, on the CPU) with
    nvfp4 dispatch and the fp8 combine, 11 tokens in chunks of 5 over two zones, top-3, -1 slots: each
    expert sees the dequantized rows (reference.dequantize_nvfp4 with the global scale, rounded to bf16),
    its partial row crosses as fp8; y is that, bit for bit."""
    from moe_comm.prefill_chunks import local_experts, num_chunks, prefill_moe  # noqa: PLC0415
    g = torch.Generator().manual_seed(22)
    E, H, K, T = 4, 128, 3, 11
    buf = PrefillBuffer(moe_comm.init(backend="loopback", device="cpu")[0], E, H, 5, K, zones=2,
                        dispatch_format="nvfp4", combine_format="e4m3")
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[3, 1], idx[7] = -1, -1
    w = torch.rand(T, K, generator=g)
    gs = reference.nvfp4_global_scale(x)
    scale = torch.rand(E, generator=g) + 0.5

    def expert(e, rows):
        return (rows.float() * scale[e] + 0.3 * e).to(torch.bfloat16)

    y = prefill_moe(buf, x, idx, w, local_experts(buf, expert), num_chunks(T, buf), global_scale=gs)
    xin = reference.dequantize_nvfp4(*reference.quantize_nvfp4(x, gs), gs).to(torch.bfloat16)
    partial = torch.zeros(T, H)
    for k in range(K):
        for t in range(T):
            if idx[t, k] >= 0:
                partial[t] += w[t, k] * expert(int(idx[t, k]), xin[t:t + 1])[0].float()
    want = reference.fp8_round_trip(partial.to(torch.bfloat16)).to(torch.bfloat16)
    assert torch.equal(y, want)
    buf.close()


# ---- PrefillBuffer across nodes: every dispatch format; the fp8 combine refused -------------------------

def _fp8_combine_across_nodes(group):
    """Every rank of a group spanning emulated nodes: the fp8 combine and the nvfp4 dispatch are refused at
    construction (nothing allocated, no collective), naming the fix; an fp8 dispatch builds there."""
    errs = []
    for kw, match in ((dict(dispatch_format="e4m3", combine_format="e4m3"), "combine_format='e4m3' is one node only"),
                      (dict(dispatch_format="nvfp4"), "dispatch_format='nvfp4' is one node only")):
        try:
            PrefillBuffer(group, 2 * group.world_size, 128, 4, 2, **kw)
            errs.append(f"{kw} was built across nodes")
        except ValueError as e:
            if match not in str(e) or "use " not in str(e):
                errs.append(f"unexpected message: {e}")
    buf = PrefillBuffer(group, 2 * group.world_size, 128, 4, 2, dispatch_format="e4m3-pow2")
    if not (buf.plan.put and buf.combine_format is None):
        errs.append("the buffer across nodes has no put plan")
    buf.close()
    return errs


@pytest.mark.timeout(300)
def test_prefill_fp8_combine_and_nvfp4_across_nodes_are_refused_at_construction(monkeypatch):
    """PrefillBuffer's combine across nodes sums each node's rows on that node and forwards the sum in the
    dtype (docs/prefill.md "Across nodes"), so there is no fp8 row to send: combine_format='e4m3' raises
    ValueError there; so does dispatch_format='nvfp4' (its one-warp send compiled with the put path is
    not block-uniform: the sm_90 rule of test_compile_sm90, which the CPU cannot show). At construction
    and in required_bytes(..., ranks_per_node=G), on every rank. The fp8 dispatch formats run across
    nodes (test_emulated_nodes: the prefill wire test)."""
    with pytest.raises(ValueError, match=r"combine_format='e4m3' is one node only.*use combine_format=None"):
        PrefillBuffer.required_bytes(4, 8, 128, 4, 2, combine_format="e4m3", ranks_per_node=2)
    with pytest.raises(ValueError, match=r"dispatch_format='nvfp4' is one node only.*use an fp8 dispatch_format"):
        PrefillBuffer.required_bytes(4, 8, 128, 4, 2, dispatch_format="nvfp4", ranks_per_node=2)
    for kw in (dict(combine_format="e4m3"), dict(dispatch_format="nvfp4")):   # one node: taken
        assert PrefillBuffer.required_bytes(4, 8, 128, 4, 2, **kw) > 0
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    errs = moe_comm.launch(_fp8_combine_across_nodes, 4, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []


def test_nvfp4_is_not_offered_on_gpus_with_a_triton_whose_build_is_unproven(monkeypatch):
    """Triton 3.9 compiles the one-warp nvfp4 dispatch send into code the block-uniform check cannot pass
    (tests/test_compile_sm90.py keeps that finding in view): building an nvfp4 EPBuffer or PrefillBuffer plan
    for a GPU is refused with the fix named; the CPU (interpreter) and Triton 3.6-3.8 are unaffected."""
    import triton
    args = (2, 16, 256, 8, 2, torch.bfloat16, False)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    for cls in (EPBuffer, PrefillBuffer):
        with pytest.raises(ValueError, match=r"verified with Triton 3.6-3.8, not 3.9.0.*triton<3.9.*'e4m3'"):
            cls._plan(*args, "cuda", dispatch_format="nvfp4")
        assert cls._plan(*args, "cpu", dispatch_format="nvfp4") is not None
        assert cls._plan(*args, "cuda", dispatch_format="e4m3") is not None
    monkeypatch.setattr(triton, "__version__", "3.8.1")
    formats.check_compiled("nvfp4", "cuda")
