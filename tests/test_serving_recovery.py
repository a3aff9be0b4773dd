"""A serving framework's MoE layers after a rank dies (the adapters' shared group, moe_comm.serving.ep_group):
the next layer raises the named error, ``recover()`` on the survivors excludes the dead rank, and the
layers go on exactly (against the reference over the survivors, the dead rank's experts unrouted). With
``MOE_COMM_TRACE_DIR`` set (how a served model asks for dumps: the adapters take no options of their
own), the survivors' flight recorders are dumped at the error and the analyzer names the dead rank."""

import os

import pytest
import torch

import moe_comm
from moe_comm import CommTimeoutError, LaunchError, reference
from moe_comm.serving import ep_group
from moe_comm.trace import analyze
from moe_comm.trace.recorder import ENV_TRACE, ENV_TRACE_DIR

E, H, M, K = 6, 64, 3, 2   # 2 experts per rank at world 3


def _inputs(step, world):
    g = torch.Generator().manual_seed(100 + step)
    xs = [torch.randn(M, H, generator=g).to(torch.bfloat16) for _ in range(world)]
    idxs = [torch.randint(-1, E, (M, K), generator=g) for _ in range(world)]
    ws = [torch.rand(M, K, generator=g) for _ in range(world)]
    return xs, idxs, ws


def _layer(ep, x, idx, w):
    ep_group.check_group(ep.group)   # what each adapter does at the start of a dispatch
    d = ep.dispatch(x, idx)
    return d, ep.combine((d.x.float() * 2).to(torch.bfloat16), w, d.handle)


def _serve(group, on_error=lambda e: ("error", e.peer, ep_group.recover()), extra=lambda: ()):
    """Four steps of one layer on this rank, rank 2 dying before its step 1; per step ("exact" | "MISMATCH",
    excluded ranks, *extra()) or, for a step that raised CommTimeoutError, what ``on_error(err)`` returns
    (it recovers)."""
    ep_group.use_group(group)
    ep = ep_group.shared_buffer(group, E, H, M, K, torch.bfloat16, None)
    me, log = group.rank, []
    for step in range(4):
        xs, idxs, ws = _inputs(step, group.world_size)
        if step == 1 and me == 2:
            os._exit(3)                      # rank 2 dies before its step-1 layer
        dead = set(range(group.world_size)) - set(group.live_ranks)
        try:
            d, y = _layer(ep, xs[me], idxs[me], ws[me])
        except CommTimeoutError as e:
            log.append(on_error(e))
            continue
        exp = reference.dispatch(xs, idxs, E, M, excluded=dead)
        eos = [(e["x"].float() * 2).to(torch.bfloat16) for e in exp]
        exact = torch.equal(d.counts, exp[me]["counts"]) and all(
            torch.equal(d.x[e, :n], exp[me]["x"][e, :n]) for e, n in enumerate(exp[me]["counts"].tolist()))
        exact = exact and torch.equal(y, reference.combine(eos, ws, idxs, E, M, excluded=dead)[me])
        log.append(("exact" if exact else "MISMATCH", sorted(dead), *extra()))
    return log


@pytest.mark.timeout(240)
def test_adapters_group_recovers_from_a_dead_rank_and_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_TRACE, "1")
    monkeypatch.setenv(ENV_TRACE_DIR, str(tmp_path))
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_serve, 3, backend="shm", timeout_s=1.5, grace_s=60)
    err = info.value
    assert sorted(err.failures) == [2] and "exit code 3" in err.failures[2]
    for rank in (0, 1):
        log = err.results[rank]
        assert log[0] == ("exact", []), log
        assert log[1] == ("error", 2, [2]), log            # named, then excluded by recover()
        assert log[2:] == [("exact", [2]), ("exact", [2])], log
    diag = analyze.analyze(analyze.load_dumps(str(tmp_path)))
    assert diag.ranks == [0, 1] and diag.missing == [2], diag.lines
    assert {(x["rank"], x["op"], x["call"]) for x in diag.never_published} == {(2, "dispatch", 2)}, diag.lines


class _VllmManager:
    """Stand-in for vLLM 0.32's DeepEPLLAll2AllManager: the three fault queries its model runner (after every
    step: query_fault, then query_active_mask in the error) and its worker sentinel (retry: clean_buffers)
    call, vLLM's own answers replaced by a DeepEP that is not here (they must not be reached)."""

    def query_active_mask(self):
        raise AssertionError("vLLM's own answer reached: moe-comm was requested")

    query_fault = clean_buffers = query_active_mask


def _serve_vllm_queries(group):
    """_serve's steps with vLLM's fault-tolerance flow in place of recover(): the plugin's wrapped queries
    answer from moe-comm (requested); after the named error, the sentinel's clean_buffers() recovers
    (excludes the dead rank), the mask shows it, and query_fault is False again until another exclusion."""
    from moe_comm.serving import vllm_plugin
    vllm_plugin.requested_options = lambda: {}   # this process serves with moe-comm
    for name in vllm_plugin.FT_METHODS:
        setattr(_VllmManager, name, vllm_plugin._wrap_fault_query(name, getattr(_VllmManager, name)))
    manager = _VllmManager()

    def queries():
        return manager.query_active_mask().tolist(), bool(manager.query_fault())

    def retry(err):
        manager.clean_buffers()
        return ("error", err.peer, *queries())
    return _serve(group, retry, queries)


@pytest.mark.timeout(240)
def test_vllm_fault_queries_answer_from_the_exclusion():
    """Issue 45 item 4, vLLM's hook: vLLM 0.32's fault tolerance (--enable-fault-tolerance with its DeepEP
    low-latency manager) asks the all2all manager query_fault() after every step, query_active_mask() (int32,
    1 = masked) for its error, and clean_buffers() on retry; with moe-comm requested the plugin answers them
    from the group's exclusion. Rank 2 of 3 dies before its step-1 layer: the survivors' step 1 raises
    CommTimeoutError naming it, clean_buffers() recovers (excludes it: the retry is collective, every live
    worker runs it), the mask shows [0, 0, 1], query_fault is False from that baseline, and steps 2 and 3 are
    exact among the survivors. A stand-in of the manager class (vLLM is not in this environment); the wrapper
    is the one register() installs on vLLM's class."""
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_serve_vllm_queries, 3, backend="shm", timeout_s=1.5, grace_s=60)
    err = info.value
    assert sorted(err.failures) == [2] and "exit code 3" in err.failures[2]
    for rank in (0, 1):
        assert err.results[rank] == [("exact", [], [0, 0, 0], False), ("error", 2, [0, 0, 1], False),
                                     ("exact", [2], [0, 0, 1], False), ("exact", [2], [0, 0, 1], False)], err.results[rank]


def test_fault_query_sees_an_exclusion_until_clean_buffers(monkeypatch):
    """query_fault is True once a rank was excluded since the last clean_buffers (e.g. by the DeepEP door's
    mask), the mask says which; clean_buffers makes it the baseline. Without moe-comm requested, the
    plugin's wrapper calls vLLM's own method."""
    from moe_comm.serving import vllm_plugin
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    ep_group.use_group(groups[0])
    assert ep_group.query_active_mask().tolist() == [0, 0] and not bool(ep_group.query_fault())
    groups[0].exclude([1])
    assert ep_group.query_active_mask().tolist() == [0, 1] and bool(ep_group.query_fault())
    ep_group.clean_buffers()
    assert ep_group.query_active_mask().tolist() == [0, 1] and not bool(ep_group.query_fault())
    own = vllm_plugin._wrap_fault_query("query_fault", lambda self: "vllm's own")
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: None)
    assert own(object()) == "vllm's own"
    monkeypatch.setattr(vllm_plugin, "requested_options", lambda: {})
    assert bool(own(object())) is False
    ep_group.use_group(None)
