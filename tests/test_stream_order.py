"""Issue 28, item 2: the launches of one channel on different CUDA streams are ordered. Every launch
(send, receive, abort) waits for the channel's previous launch on this rank: recv(i) after send(i),
send(i+1) after recv(i), hence send(i+1) after send(i) and recv(i+1) after recv(i). Checked on the CPU
with recording stand-ins for ``torch.cuda.Event``, ``current_stream`` and ``is_current_stream_capturing``
(rank 0's channel only), while the kernels really run on loopback."""

import pytest
import torch

from moe_comm.channel import Channel

from test_faults import _exact_round, _inputs, _loopback_eps


class _Cuda:
    """The current stream, the capture state and a log of event records and stream waits."""

    def __init__(self, monkeypatch):
        self.log, self.events, self.stream, self.capturing = [], 0, "S", False
        cuda = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def __eq__(self, other):
                return isinstance(other, Stream) and other.name == self.name

            def wait_event(self, event):
                cuda.log.append(("wait", self.name, event.id))

        class Event:
            def __init__(self):
                cuda.events += 1
                self.id = cuda.events

            def record(self, stream):
                cuda.log.append(("record", stream.name, self.id))

            def synchronize(self):
                cuda.log.append(("synchronize", None, self.id))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(cuda.stream))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cuda.capturing)
        drain = Channel.drain

        def logged_drain(ch):
            if ch._drain_op is not None:
                cuda.log.append(("drain",))
            drain(ch)

        monkeypatch.setattr(Channel, "drain", logged_drain)

    def run(self, stream, fn, capturing=False):
        """Run ``fn`` with ``stream`` current; returns the log entries it made."""
        self.stream, self.capturing, start = stream, capturing, len(self.log)
        fn()
        return self.log[start:]


def _happens_before(launches):
    """launches: [(stream, waited event ids, recorded event id)] in issue order. Returns before(a, b):
    launch a is ordered before launch b (same stream earlier, or a waited chain of events)."""
    preds = [{j for j in range(k) if launches[j][0] == s or launches[j][2] in waits}
             for k, (s, waits, _) in enumerate(launches)]

    def before(a, b):
        todo, seen = [b], set()
        while todo:
            for p in preds[todo.pop()] - seen:
                if p == a:
                    return True
                seen.add(p)
                todo.append(p)
        return False
    return before


def test_every_launch_waits_for_the_previous_launch_of_its_channel(monkeypatch):
    groups, eps = _loopback_eps()
    cuda = _Cuda(monkeypatch)
    for ep in eps:
        ep._ensure_allocated()
    eps[0]._dispatch_ch._ordered = True
    launches = []

    def phase(stream, what, call, expect_waits, capturing=False, drained=False):
        """Rank 0's phase ``what`` of ``call`` on ``stream`` (rank 1's right after it, not logged)."""
        xs, idxs, _ = _inputs(2, call)
        if what == "send":
            fns = [lambda r=r: eps[r].dispatch(xs[r], idxs[r], phase="send") for r in range(2)]
        elif what == "abort":
            def fn(r):
                with pytest.raises(TypeError, match="dtype"):
                    eps[r].dispatch(xs[r].float(), idxs[r], phase="send")
            fns = [lambda r=r: fn(r) for r in range(2)]
        else:
            fns = [lambda r=r: eps[r].dispatch(phase="recv") for r in range(2)]
        got = cuda.run(stream, fns[0], capturing)
        fns[1]()
        record = ("record", stream, cuda.events)
        expect = [("wait", stream, e) for e in expect_waits] + [("drain",)] * drained + [record]
        assert got == expect, (what, call, got, expect)
        launches.append((stream, set(expect_waits), cuda.events))

    phase("S", "send", 1, [])          # the first launch waits for nothing
    phase("R", "recv", 1, [1])         # recv(1) after send(1)
    phase("S", "send", 2, [2])         # send(2) after recv(1)
    phase("R", "recv", 2, [3])
    phase("S", "abort", 3, [4])        # an abort is a launch like the others
    phase("R", "send", 4, [5], drained=True)   # ... and its receive side runs first at the next launch
    phase("S", "recv", 4, [6])
    phase("S", "send", 5, [])          # same stream as the previous launch: already in order
    phase("S", "recv", 5, [])
    before = _happens_before(launches)
    kinds = ["send", "recv", "send", "recv", "abort", "send", "recv", "send", "recv"]
    sends = [k for k, w in enumerate(kinds) if w in ("send", "abort")]
    recvs = [k for k, w in enumerate(kinds) if w == "recv"]
    recvs.insert(2, sends[2])          # the abort stands for call 3's receive too (its drain runs later)
    for i in range(len(sends)):
        assert before(sends[i], recvs[i]) or sends[i] == recvs[i]
        if i + 1 < len(sends):
            assert before(recvs[i], sends[i + 1]) and before(sends[i], sends[i + 1])
            assert before(recvs[i], recvs[i + 1])

    # Graph capture boundary: a captured launch never waits for an eager one, nor the reverse.
    phase("C", "send", 6, [], capturing=True)
    phase("R", "recv", 6, [])
    phase("C", "send", 7, [], capturing=True)
    phase("C", "recv", 7, [], capturing=True)
    phase("R", "send", 8, [])
    phase("S", "recv", 8, [cuda.events])
    _exact_round(eps, 9)


class _Graph:
    """A stand-in for a ``torch.cuda.CUDAGraph`` being captured (weak-referencable, told apart by identity)."""


def test_captures_are_told_apart_by_their_capture_not_by_a_flag(monkeypatch):
    """Issue 33, item 7: a launch waits for the channel's previous launch only within the same capture
    sequence (or both eager), found by the capture's graph (``current_capture``: torch's
    ``CUDAGraph.get_currently_capturing_graph``, keyed by the stream's capture id), not by whether the
    stream is capturing at all: two captures under way on two streams must not wait across each other
    (CUDA rejects that dependency and invalidates the capture). A capture torch cannot name (not begun
    by torch.cuda.CUDAGraph) is told apart from eager launches only. Checked on the channel's ordering
    alone (``after_previous`` / ``launched``, no kernel) with the recording stand-ins; what CUDA does
    with a cross-capture wait is for tests/gpu/test_gpu_capture.py."""
    import moe_comm
    from moe_comm.channel import UNIDENTIFIED_CAPTURE, current_capture
    cuda = _Cuda(monkeypatch)
    capture = {"graph": None}

    def currently_capturing():
        if capture["graph"] is None or capture["graph"] is UNIDENTIFIED_CAPTURE:
            raise RuntimeError("The current stream is not capturing a torch.cuda.CUDAGraph")
        return capture["graph"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capture["graph"] is not None)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", staticmethod(currently_capturing),
                        raising=False)
    g = moe_comm.init(backend="loopback", world_size=1, device="cpu")[0]
    ch = Channel(g, "order", (2, 1), torch.int32)
    ch._ordered = True

    def launch(stream, graph=None):
        """One launch of the channel on ``stream`` in capture ``graph``: the event ids it waited for."""
        capture["graph"] = graph

        def fn():
            ch.after_previous()
            ch.launched()
        return [e for kind, _, e in cuda.run(stream, fn) if kind == "wait"]

    one, two = _Graph(), _Graph()
    assert current_capture() is None
    capture["graph"] = one
    first = current_capture()
    assert first == current_capture()       # the same capture, asked again
    capture["graph"] = two
    assert first != current_capture()
    assert launch("A", one) == []
    assert launch("B", two) == []           # another capture under way: no wait (a flag said "both captured")
    assert launch("C", two) == [2]          # the same capture on a side stream: in order
    assert launch("A", one) == []           # back to the first capture
    assert launch("D", None) == []          # eager after captured: no wait
    assert launch("E", None) == [5]         # eager after eager on another stream
    assert launch("F", UNIDENTIFIED_CAPTURE) == []
    assert launch("G", UNIDENTIFIED_CAPTURE) == [7]   # unnamed captures: ordered among themselves, as before
    assert launch("H", one) == []
    del one                                 # a dead capture's graph is no one's: a new graph never matches it
    assert launch("I", _Graph()) == []
    ch.free()                               # waits for the last launch before the buffers go
    assert cuda.log[-1] == ("synchronize", None, cuda.events)
    g.close()


def _storages(obj, seen=None, depth=0) -> set:
    """Storage addresses of every tensor reachable from ``obj`` through moe_comm objects, containers and
    dataclasses (an op's own buffers, its channels', its group's)."""
    seen = set() if seen is None else seen
    out = set()
    if id(obj) in seen or depth > 6:
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif type(obj).__module__.startswith("moe_comm") and hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return out
    for item in items:
        out |= _storages(item, seen, depth + 1)
    return out


def test_what_a_receive_reads_of_its_send_is_recorded_for_the_receive_stream(monkeypatch):
    """Issue 33, item 2: every tensor a receive launch reads or writes that is not the op's own (made or
    given at the send: the world-1 dispatch's copies of x and topk_idx, combine's contiguous expert_out,
    its weights and out given at the send, AllToAllvDynamic's reverse output, PrefillBuffer's combine
    out) is handed to ``record_for_current_stream`` at the receive, before its launch; so is what
    DeepEP's dispatch hook writes of the send's allocations. Checked on loopback worlds 1 and 2 on the CPU:
    ``record_for_current_stream`` is a recording stand-in, the receive launches' per-call tensor
    arguments are logged, and the op's own buffers are found by walking the op. What the CPU cannot show:
    that the CUDA caching allocator then keeps the memory until the receive stream's work is done, and
    that it would reuse it without (tests/gpu/test_gpu_streams.py)."""
    import moe_comm
    from moe_comm import AllToAllvDynamic, EPBuffer, PrefillBuffer, launches, phased
    from moe_comm.compat import deep_ep
    recorded, launched, phase = [], [], {"now": "send"}
    monkeypatch.setattr(phased, "record_for_current_stream",
                        lambda items, device: recorded.extend(t for t in items if isinstance(t, torch.Tensor)))
    init = launches.Launch.__init__

    def logged_init(self, kernel, device, grid, aligned=True, **static):
        init(self, kernel, device, grid, aligned, **static)
        run = self.run

        def logged(**args):
            launched.append((phase["now"], kernel.fn.__name__, args))
            run(**args)
        self.run = logged
    monkeypatch.setattr(launches.Launch, "__init__", logged_init)

    def rounds(ops, calls):
        """calls: per op, (send(op, r), recv(op, r)) phases; the per-call tensors of the receive launches
        that are not the op's own, and those not recorded."""
        checked, missing = set(), []
        for op, (send, recv) in zip(ops, calls):
            owned = {p for o in op for p in _storages(o)}   # before the send: nothing pending yet
            for r in range(len(op)):
                phase["now"] = "send"
                send(op[r], r)
            del recorded[:], launched[:]
            phase["now"] = "recv"
            for r in range(len(op)):
                recv(op[r], r)
            done = {t.untyped_storage().data_ptr() for t in recorded}
            for when, name, args in launched:
                for arg, t in args.items():
                    if when == "recv" and isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in owned:
                        checked.add((name, arg))
                        if t.untyped_storage().data_ptr() not in done:
                            missing.append((name, arg))
        return checked, missing

    H, M, K, E = 64, 3, 2, 4
    g1 = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    g2 = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    x = torch.randn(M, H).bfloat16()
    idx = torch.tensor([[0, 1], [2, -1], [3, 0]])
    w = torch.rand(M, K)
    checked, missing = set(), []
    for groups in (g1, g2):
        world = len(groups)
        eps = [EPBuffer(g, E, H, M, K) for g in groups]
        a2as = [AllToAllvDynamic(g, 4, (8,), torch.float32) for g in groups]
        pfs = [PrefillBuffer(g, E, H, M, K) for g in groups]
        for op in eps + pfs:
            op._ensure_allocated()
        counts = torch.ones(world, dtype=torch.int32)
        ds, res, pds = {}, {}, {}
        c, m = rounds((eps, a2as, pfs), (
            (lambda o, r: o.dispatch(x, idx, phase="send"), lambda o, r: ds.__setitem__(r, o.dispatch(phase="recv"))),
            (lambda o, r: o(torch.randn(world, 8), counts, phase="send"),
             lambda o, r: res.__setitem__(r, o(phase="recv"))),
            (lambda o, r: o.dispatch(x, idx, w, phase="send"), lambda o, r: pds.__setitem__(r, o.dispatch(phase="recv")))))
        checked |= c
        missing += m
        c, m = rounds((eps, a2as, pfs), (
            (lambda o, r: o.combine(ds[r].x.transpose(1, 2).contiguous().transpose(1, 2), w, ds[r].handle,
                                    out=torch.empty(M, H, dtype=torch.bfloat16), phase="send"),
             lambda o, r: o.combine(phase="recv")),
            (lambda o, r: o.combine(res[r].recv.clone(), res[r].handle, phase="send"), lambda o, r: o.combine(phase="recv")),
            (lambda o, r: o.combine(pds[r].recv_x, pds[r].handle, out=torch.empty(M, H, dtype=torch.bfloat16),
                                    phase="send"), lambda o, r: o.combine(phase="recv"))))
        checked |= c
        missing += m
        for g in groups:
            g.close()
    assert missing == []
    assert {("dispatch_local_kernel", "x_ptr"), ("dispatch_local_kernel", "idx_ptr"),
            ("combine_recv_kernel", "expert_out_ptr"), ("combine_recv_kernel", "weights_ptr"),
            ("combine_recv_kernel", "out_ptr"), ("a2a_recv_kernel", "dst_ptr"),
            ("prefill_combine_recv_kernel", "out_ptr")} <= checked, checked

    # DeepEP's low-latency dispatch hook writes tensors the send phase allocated.
    (buf,) = [deep_ep.Buffer(g, num_nvl_bytes=0, low_latency_mode=True, num_rdma_bytes=1 << 24, num_qps_per_rank=E)
              for g in moe_comm.init(backend="loopback", world_size=1, device="cpu")]
    out = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    del recorded[:]
    out[4]()
    done = {t.untyped_storage().data_ptr() for t in recorded}
    assert {out[1].untyped_storage().data_ptr(), out[2][0].untyped_storage().data_ptr(),
            out[2][1].untyped_storage().data_ptr()} <= done
