"""The combine's open half: ``EPBuffer.combine(..., ready=words)`` starts the send before every expert is
done, and a kernel of the user's own signals each local expert once its rows of expert_out are written
(``EPBuffer.ready_words``, ``moe_comm.triton_kernels.ready``, docs/moe-layer.md "Ready words").

How the overlap is emulated on the CPU. The interpreter runs one kernel at a time per process, so a send
waiting on a signal that a later launch produces could only time out. Here the user's expert kernel runs
*inside* the send's wait: every poll pause of an interpreted wait (``sync.poll_pause``) hands the CPU to
the next step of the "GEMM stream", one launch of the user's Triton kernel for one local expert, in
REVERSE expert order (``_GemmStream``). expert_out is NaN before its expert's step, so a send that read
rows before their signal would put NaN into y. What this shows: the send waits per expert, reads each
expert's rows only after its signal (exact y, bit for bit against ``moe_comm.reference``), in any program
order, over the store and put transports and across emulated nodes; a missing or stale signal fails the
group with a named error on every rank, and after reset() the next call is exact. What it cannot show:
two kernels running at once on a GPU, memory ordering between the GEMM's stores and the signal (the sm_90
PTX rules check the release/acquire: tests/test_compile_sm90.py), or SM sharing between them.
"""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import interpreter_builder

import moe_comm
from moe_comm import CommTimeoutError, EPBuffer, GroupError, reference
from moe_comm.heap.shm import RANKS_PER_NODE_ENV
from moe_comm.interpret_order import ORDER_ENV
from moe_comm.interpreter import kernel_for, twin_module
from moe_comm.protocol import EPOCH_SHIFT
from moe_comm.triton_kernels.quant import cast_rne
from moe_comm.triton_kernels.ready import ready_flag, signal_expert

import budget
from moe_cases import make_inputs

L, H, M, K = 3, 64, 4, 2
TIMEOUT_S = 20.0       # a happy call's bound (never reached: the waits end on the signals)
SHORT_TIMEOUT_S = 0.4  # the fault cases': a never-signalled expert times out this fast (loopback: no peer waits)
SHM_FAULT_TIMEOUT_S = 5.0   # across processes every wait has this bound: interpreted peers on a loaded CPU


def _scale(e):
    return (e + 1) * 0.375


@triton.jit
def _expert_kernel(x_ptr, out_ptr, counts_ptr, words_ptr, state_ptr, call_ptr, first, CAP: tl.constexpr,
                   H: tl.constexpr, BR: tl.constexpr):
    """The user's expert GEMM's stand-in: program p computes local expert e = first - p (in reverse order
    when launched over several), out[e, i] = x[e, i] * (e + 1) * 0.375 for its rows i < counts[e] (in
    float32, rounded to nearest even), then marks e ready with this call's flag."""
    e = first - tl.program_id(0)
    n = tl.load(counts_ptr + e)
    c = tl.arange(0, H)
    for r0 in range(0, n, BR):
        r = r0 + tl.arange(0, BR)
        live = (r < n)[:, None]
        at = (e * CAP + r).to(tl.int64)[:, None] * H + c[None, :]
        v = tl.load(x_ptr + at, mask=live).to(tl.float32) * ((e + 1) * 0.375)
        tl.store(out_ptr + at, cast_rne(v, out_ptr.dtype.element_ty), mask=live)
    signal_expert(words_ptr, e, ready_flag(state_ptr, call_ptr))


def _run_expert(ep, d, out, e, programs=1):
    """Launch the user's kernel for local experts e, e - 1, ..., e - programs + 1 (in that order)."""
    rw = ep.ready_words()
    kernel_for(_expert_kernel, ep.group.device)[(programs,)](
        d.x, out, d.counts, rw.words, rw.state, rw.call, e, CAP=ep.plan.capacity, H=H, BR=4)


def _expected_out(d):
    return _expected_out_of(d.x)


class _GemmStream:
    """The other stream, emulated: ``steps`` (callables) run one per poll pause of an interpreted wait,
    i.e. only while some kernel of this process waits. ``ran_in_wait`` counts them. Restores the pacer on
    exit. The interpreter's grid state belongs to the waiting launch: it is kept across a step's launch."""

    def __init__(self, steps):
        self.steps, self.ran_in_wait = list(steps), 0
        self.sync = twin_module("moe_comm.triton_kernels.sync")
        self.pacer = self.sync._pace_poll

    def __enter__(self):
        self.sync._pace_poll = self._pause
        return self

    def __exit__(self, *exc):
        self.sync._pace_poll = self.pacer

    def _pause(self):
        if not self.steps:
            return self.pacer()
        saved = interpreter_builder.grid_idx, interpreter_builder.grid_dim
        try:
            self.steps.pop(0)()
        finally:
            interpreter_builder.grid_idx, interpreter_builder.grid_dim = saved
        self.ran_in_wait += 1


def _ready_call(eps, xs, idxs, ws, steps_of=None):
    """One dispatch and one ready combine on every rank of this process (``eps``: one per rank, loopback, or
    this rank's alone). The combine sends are launched with expert_out all NaN; each rank's experts are then
    computed and signalled in reverse order by ``_GemmStream`` while the sends wait. Returns (ys, outs,
    the steps that ran inside a wait)."""
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    outs = [torch.full_like(d.x, float("nan")) for d in ds]
    steps = [lambda ep=ep, d=d, o=o, e=e: _run_expert(ep, d, o, e)
             for ep, d, o in zip(eps, ds, outs) for e in reversed(range(L))]
    with _GemmStream(steps) as stream:
        for ep, d, o, w in zip(eps, ds, outs, ws):
            ep.combine(o, w, d.handle, phase="send", ready=ep.ready_words())
        assert stream.steps == [], "a send finished before every expert was signalled"
    ys = [ep.combine(phase="recv") for ep in eps]
    return ys, [_expected_out(d) for d in ds], stream.ran_in_wait


def _check_exact(ys, expert_outs, ws, idxs, world, ranks):
    """Each rank in ``ranks`` (ys, expert_outs: theirs, in order) against the reference of the whole world;
    ``expert_outs`` holds every rank's."""
    want = reference.combine(expert_outs, ws, idxs, L * world, M)
    return [f"rank {r}: y differs" for r, y in zip(ranks, ys) if not torch.equal(y, want[r])]


def _inputs(world, seed):
    return make_inputs(world, [M, 3, 0, 1][:world] if world > 1 else [M], L * world, K, H, seed)


def _all_outs(world, xs, idxs):
    """Every rank's expected expert_out (what each rank's user kernel computes), from the reference dispatch."""
    return [_expected_out_of(r["x"]) for r in reference.dispatch(xs, idxs, L * world, M)]


def _expected_out_of(x):
    e = torch.arange(L, dtype=torch.float32).view(-1, 1, 1)
    return (x.float() * _scale(e)).to(x.dtype)


def _loopback(world, timeout_s=TIMEOUT_S):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=timeout_s)
    return groups, [EPBuffer(g, L * world, H, M, K) for g in groups]


def _happy_calls(eps, world, ranks, calls=(1, 2)):
    """Two ready calls (the second one's words hold the first one's flags when it starts); returns mismatches."""
    errs = []
    for call in calls:
        xs, idxs, ws = _inputs(world, call)
        ys, _, ran = _ready_call(eps, [xs[r] for r in ranks], [idxs[r] for r in ranks], [ws[r] for r in ranks])
        errs += _check_exact(ys, _all_outs(world, xs, idxs), ws, idxs, world, ranks)
        if ran != L * len(ranks):
            errs.append(f"call {call}: {ran} of {L * len(ranks)} experts were signalled while a send waited")
    return errs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_the_send_waits_for_each_expert_signalled_in_reverse_order(world):
    """Loopback: the combine sends are launched before any expert_out row exists (all NaN); the user's Triton
    kernel computes and signals each local expert, last expert first, while the sends wait; y is exact."""
    groups, eps = _loopback(world)
    assert _happy_calls(eps, world, list(range(world))) == []


def _shm_rank(group, world, per_node):
    ep = EPBuffer(group, L * world, H, M, K)
    wire = group.heap.wire.stats["bytes"] if per_node else 0
    errs = _happy_calls([ep], world, [group.rank])
    if per_node and (not ep.plan.put or group.heap.wire.stats["bytes"] <= wire):
        errs.append(f"rank {group.rank}: no puts across the emulated nodes")
    return errs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, per_node", [(2, None), (4, 2), budget.sweep(3, 1)])
def test_ready_combine_across_processes_and_emulated_nodes(monkeypatch, world, per_node):
    """shm ranks (one process each; the user's kernel and the send in the same process, as above); with
    MOE_COMM_RANKS_PER_NODE the ranks of another node are reached by the put transport only (the send
    stages each put rank's run, waiting per expert, then puts it)."""
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    if per_node:
        monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    errs = moe_comm.launch(_shm_rank, world, world, per_node, backend="shm", timeout_s=TIMEOUT_S)
    assert errs == [[]] * world


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order, transport", [("reverse", "store"), ("asis", "put"), budget.sweep("random", "put")])
def test_ready_combine_in_adversarial_program_order_and_over_puts(monkeypatch, order, transport):
    """Loopback world 2 with the send's programs in reverse (or random) order, and with every peer reached
    by puts (MOE_COMM_TRANSPORT=put: the staged runs)."""
    monkeypatch.setenv(ORDER_ENV, order)
    if transport == "put":
        monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
    groups, eps = _loopback(2)
    assert eps[0].plan.put == (transport == "put")
    assert _happy_calls(eps, 2, [0, 1]) == []


def _signal_all_but(ep, missing):
    """``ReadyWords.signal`` from the host's stream: every local expert (no ids given), or all but ``missing``
    (and an id out of range, which is ignored)."""
    rw = ep.ready_words()
    if not missing:
        rw.signal()
    else:
        rw.signal(torch.tensor([e for e in range(L) if e not in missing] + [L], dtype=torch.int64))


def _dispatch_all(eps, xs, idxs):
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    return [ep.dispatch(phase="recv") for ep in eps]


def _signalled_call(eps, groups, world, seed, missing=None):
    """One call whose experts are computed (torch) and signalled before the sends, but rank 0's ``missing``
    experts; returns (the errors the receives raised, the mismatches of the ys that returned)."""
    xs, idxs, ws = _inputs(world, seed)
    ds = _dispatch_all(eps, xs, idxs)
    outs = [_expected_out(d) for d in ds]
    for r, ep in enumerate(eps):
        _signal_all_but(ep, missing if r == 0 and missing else ())
    for ep, d, o, w in zip(eps, ds, outs, ws):
        ep.combine(o, w, d.handle, phase="send", ready=ep.ready_words())
    got, ys = [], []
    for ep in eps:
        try:
            ys.append(ep.combine(phase="recv"))
            got.append(None)
        except GroupError as e:
            ys.append(None)
            got.append(e)
    want = reference.combine(outs, ws, idxs, L * world, M)
    bad = [f"rank {r}: y differs" for r, y in enumerate(ys) if y is not None and not torch.equal(y, want[r])]
    return got, bad


def _named(err, expert, rank=0):
    return (isinstance(err, CommTimeoutError) and (err.op, err.rank, err.expert) == ("combine_ready", rank, expert)
            and f"its local expert {expert} to be signalled ready" in str(err) and "group.reset()" in str(err))


@pytest.mark.timeout(120)
def test_an_expert_never_signalled_is_named_on_every_rank_and_reset_recovers():
    """Rank 0 never signals its local expert 1 (world 2): rank 0's send times out naming it, rank 1 gets
    the same named error (the group's status), and after reset() the next call is exact on both. (Loopback
    runs rank 1's receive after rank 0's send has timed out, so rank 1 adopts the record; on a GPU its own
    wait for rank 0's flag may time out first and name rank 0 instead: docs/moe-layer.md.)"""
    groups, eps = _loopback(2, SHORT_TIMEOUT_S)
    assert _signalled_call(eps, groups, 2, 1) == ([None, None], [])
    got, bad = _signalled_call(eps, groups, 2, 2, missing=(1,))
    assert bad == [] and all(_named(e, 1) for e in got), got
    for g in groups:   # sticky until reset()
        with pytest.raises(CommTimeoutError, match="combine_ready: rank 0 .* local expert 1"):
            g.check()
    for g in groups:
        g.reset()
    assert _signalled_call(eps, groups, 2, 4) == ([None, None], [])


@pytest.mark.timeout(120)
def test_a_stale_signal_of_the_previous_call_or_epoch_does_not_satisfy_the_wait():
    """World 1: call 2 starts with every word holding call 1's flag; expert 0 not signalled again -> the
    send times out naming it. After reset() (a new epoch, the call count back at 1) a word holding the old
    epoch's call-1 flag does not satisfy the new call 1 either; the next fully signalled call is exact."""
    groups, eps = _loopback(1, SHORT_TIMEOUT_S)
    assert _signalled_call(eps, groups, 1, 1) == ([None], [])
    words = eps[0].ready_words().words
    assert words.tolist() == [1] * L   # epoch 0, call 1
    got, bad = _signalled_call(eps, groups, 1, 2, missing=(0,))
    assert words.tolist() == [1, 2, 2] and _named(got[0], 0), got
    groups[0].reset()
    words[:] = 1   # the old epoch's call-1 flag, as call 1 of the new epoch would compute it without the epoch
    got, bad = _signalled_call(eps, groups, 1, 3, missing=(2,))
    assert words.tolist() == [(1 << EPOCH_SHIFT) | 1] * 2 + [1] and _named(got[0], 2), got
    groups[0].reset()
    assert _signalled_call(eps, groups, 1, 4) == ([None], [])


def _shm_never_signalled(group):
    """shm: rank 0 never signals its local expert 1; returns what each step showed on this rank."""
    world = group.world_size
    ep = EPBuffer(group, L * world, H, M, K)
    seen = []
    for seed, missing in ((1, ()), (2, (1,))):
        xs, idxs, ws = _inputs(world, seed)
        d = _dispatch_all([ep], [xs[group.rank]], [idxs[group.rank]])[0]
        _signal_all_but(ep, missing if group.rank == 0 else ())
        try:
            ep.combine(_expected_out(d), ws[group.rank], d.handle, ready=ep.ready_words())
            seen.append(None)
        except CommTimeoutError as e:
            seen.append((e.op, e.rank, e.expert if e.op == "combine_ready" else e.peer))
    group.reset()
    errs = _happy_calls([ep], world, [group.rank], calls=(3,))
    return seen, errs


@pytest.mark.timeout(300)
@budget.SWEEP
def test_an_expert_never_signalled_across_processes():
    """shm world 2 (the ranks run at once): rank 0 names its expert 1; rank 1 raises that record, or, if
    its own wait for rank 0's flag timed out first, the combine's timeout naming rank 0; after reset()
    the next call is exact on both."""
    out = moe_comm.launch(_shm_never_signalled, 2, backend="shm", timeout_s=SHM_FAULT_TIMEOUT_S)
    assert out[0] == ([None, ("combine_ready", 0, 1)], []), out
    assert out[1][1] == [] and out[1][0][0] is None and out[1][0][1] in (("combine_ready", 0, 1), ("combine", 1, 0)), out
