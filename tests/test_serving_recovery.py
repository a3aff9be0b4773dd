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


def _serve(group):
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
            log.append(("error", e.peer, ep_group.recover()))
            continue
        exp = reference.dispatch(xs, idxs, E, M, excluded=dead)
        eos = [(e["x"].float() * 2).to(torch.bfloat16) for e in exp]
        exact = torch.equal(d.counts, exp[me]["counts"]) and all(
            torch.equal(d.x[e, :n], exp[me]["x"][e, :n]) for e, n in enumerate(exp[me]["counts"].tolist()))
        exact = exact and torch.equal(y, reference.combine(eos, ws, idxs, E, M, excluded=dead)[me])
        log.append(("exact" if exact else "MISMATCH", sorted(dead)))
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
