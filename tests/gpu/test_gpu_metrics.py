"""moe_comm.metrics on a GPU (loopback heap, world 2): device counters reach a scrape through copies that
``group.check()`` enqueues on a side stream, which do not wait for the compute stream; a thread scraping
all the while makes no CUDA call, so a CUDA graph captured meanwhile (global capture mode, the default)
is unharmed; graph replays are counted (the calls come from the device's own counters)."""

import threading
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, EPBuffer, metrics, reference

pytestmark = pytest.mark.gpu
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SPIN_CYCLES = 2_000_000_000   # torch.cuda._sleep: about a second of GPU clock cycles
CAP, ROW = 4, 256


def samples(text: str) -> dict:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(got: dict, name: str, **labels):
    return got.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def test_device_counters_arrive_through_copies_that_do_not_wait_for_the_compute_stream():
    groups = moe_comm.init(backend="loopback", world_size=2, device="cuda", trace=8)
    exp = metrics.Exporter(groups)
    eps = [EPBuffer(g, 8, 256, 4, 2) for g in groups]
    idxs = [torch.tensor([[0, 5], [1, -1], [6, 7]], device="cuda"), torch.tensor([[4, 5], [0, 1], [2, 6]], device="cuda")]
    for _ in range(3):
        for ep, i in zip(eps, idxs):
            ep.dispatch(torch.randn(3, 256, device="cuda").to(torch.bfloat16), i, phase="send")
        ds = [ep.dispatch(phase="recv") for ep in eps]
        for ep, d in zip(eps, ds):
            ep.combine(d.x, torch.rand(3, 2, device="cuda"), d.handle, phase="send")
        for ep in eps:
            ep.combine(phase="recv")
    torch.cuda.synchronize()
    got = samples(exp.text())   # no copy yet: the scrape read none, it asked for them
    assert value(got, "moe_comm_calls_total", rank=0, op="dispatch") is None
    assert value(got, "moe_comm_rows_received_total", rank=0, op="dispatch", peer=1) == 3 * 3   # the ring: pinned
    for g in groups:
        g.check()                # the first copies (they allocate their pinned buffers)
    torch.cuda.synchronize()
    got = samples(exp.text())    # reads those copies, asks for new ones
    for r, ep in enumerate(eps):
        assert value(got, "moe_comm_calls_total", rank=r, op="dispatch") == 3
        assert value(got, "moe_comm_calls_total", rank=r, op="combine") == 3
        rows = ep.expert_token_counts.tolist()
        assert [value(got, "moe_comm_expert_rows_total", rank=r, op="dispatch", expert=4 * r + e)
                for e in range(4)] == rows
        ns, count = ep.dispatch_wait_stats.tolist()
        assert value(got, "moe_comm_waits_total", rank=r, op="dispatch", peer=1 - r) == count[1 - r] == 3
        assert value(got, "moe_comm_wait_seconds_total", rank=r, op="dispatch", peer=1 - r) == \
            pytest.approx(ns[1 - r] / 1e9)
    torch.cuda._sleep(SPIN_CYCLES)   # the compute stream is busy for about a second
    t0 = time.perf_counter()
    for g in groups:
        g.check()                    # the step thread's check enqueues the copies and returns
    host_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for g in groups:   # each group's copies are on its own side stream
        copied = torch.cuda.Event()
        with torch.cuda.stream(exp.state(g).reads._stream):
            copied.record()
        copied.synchronize()
    copy_s = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    print(f"check() enqueuing the copies: {host_s * 1e6:.0f} us; copies done after {copy_s * 1e6:.0f} us; "
          f"compute stream still busy then: {busy}")
    assert busy, "the copies waited for the compute stream"
    assert host_s < 0.05, host_s
    torch.cuda.synchronize()


def test_a_scraping_thread_leaves_a_graph_capture_alone_and_replays_are_counted():
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cuda", trace=8)
    exp = metrics.Exporter(groups)
    ops = [AllToAllvDynamic(g, CAP, (ROW,), torch.bfloat16) for g in groups]
    sends = [torch.zeros(CAP * world, ROW, dtype=torch.bfloat16, device="cuda") for _ in range(world)]
    counts = [torch.zeros(world, dtype=torch.int32, device="cuda") for _ in range(world)]

    def step():   # two calls: the output sets alternate the same way at every replay
        out = []
        for _ in range(2):
            for r, op in enumerate(ops):
                op(sends[r], counts[r], phase="send")
            out = [op(phase="recv") for op in ops]
        return out

    step()
    torch.cuda.synchronize()
    stop, failures, scrapes = threading.Event(), [], [0]

    def scrape():
        while not stop.is_set():
            try:
                exp.text()
                scrapes[0] += 1
            except Exception as e:   # noqa: BLE001
                failures.append(e)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        time.sleep(0.2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):   # capture_error_mode="global"
            out = step()
            for g in groups:
                g.check()               # a copy asked for now is left for a check after the capture
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert not failures and scrapes[0] > 0, (failures, scrapes)
    replays = 5
    for seed in range(replays):
        gen = torch.Generator().manual_seed(seed)
        c = [torch.randint(0, CAP + 1, (world,), generator=gen, dtype=torch.int32) for _ in range(world)]
        s = [torch.randn(CAP * world, ROW, generator=gen).to(torch.bfloat16) for _ in range(world)]
        for r in range(world):
            counts[r].copy_(c[r])
            sends[r].copy_(s[r])
        graph.replay()
        torch.cuda.synchronize()
        for g in groups:
            g.check()
        for r, (recv, rc) in enumerate(reference.alltoallv(s, c, CAP)):
            assert torch.equal(out[r].recv_counts.cpu(), rc)
            for j in range(world):
                assert torch.equal(out[r].recv[j, :int(rc[j])].cpu(), recv[j, :int(rc[j])])
    exp.refresh()                       # asks for copies; the next check makes them
    for g in groups:
        g.check()
    torch.cuda.synchronize()
    got = samples(exp.text())
    for r in range(world):
        assert value(got, "moe_comm_calls_total", rank=r, op="alltoallv") == 2 * (1 + replays)
