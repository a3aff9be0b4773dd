"""The flight recorder (moe_comm/trace, triton_kernels/trace.py): what the kernels record matches what
the calls did, and the analyzer names the slow rank, the rank that never published a call (from its
peers' dumps alone) and a desync with both call numbers."""

import json
import os

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommDesyncError, CommTimeoutError, EPBuffer, LaunchError
from moe_comm.trace import analyze, layout
from moe_comm.trace.recorder import channel_records, trace_calls

from fault_cases import slow_then_dead

ROW = (8,)          # float32 rows of the AllToAllvDynamic tests: 32 bytes
CAP = 4


def _loopback_a2a(world, trace, timeout_s=2.0):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=timeout_s, trace=trace)
    return groups, [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in groups]


def _round(ops, counts, back=True):
    """One forward (and reverse) call on every loopback rank; counts[r] = rank r's send counts."""
    sends = [torch.randn(int(c.sum()), *ROW) for c in counts]
    for op, s, c in zip(ops, sends, counts):
        op(s, c, phase="send")
    res = [op(phase="recv") for op in ops]
    if back:
        for op, r in zip(ops, res):
            op.combine(r.recv, r.handle, phase="send")
        for op in ops:
            op.combine(phase="recv")
    return res


def test_recorder_holds_the_last_calls_with_their_rows_bytes_and_times():
    """Three calls on a ring of two: the last two are kept, with this rank's rows to and from every peer
    (forward: the counts; reverse: the same rows back), 32-byte rows, an "ok" outcome, every source's flag
    seen during the receive, and one wait per source and call in the wait statistics. Off: nothing."""
    groups, ops = _loopback_a2a(3, trace=2)
    calls = [[torch.tensor([1, 0, 2]), torch.tensor([3, 1, 0]), torch.tensor([0, 2, 4])],
             [torch.tensor([2, 2, 0]), torch.tensor([0, 0, 1]), torch.tensor([4, 1, 1])],
             [torch.tensor([0, 1, 1]), torch.tensor([1, 1, 1]), torch.tensor([3, 0, 2])]]
    for counts in calls:
        _round(ops, counts)
    for r, op in enumerate(ops):
        fwd, rev = channel_records(op._fwd), channel_records(op._rev)
        assert [x.call for x in fwd] == [2, 3] and [x.call for x in rev] == [2, 3]
        for rec, back, counts in zip(fwd, rev, calls[1:]):
            sent = counts[r].tolist()
            got = [int(counts[j][r]) for j in range(3)]
            assert (rec.op, rec.epoch, rec.outcome, rec.row_bytes) == ("alltoallv", 0, "ok", 32)
            assert rec.sent_rows == sent and rec.recv_rows == got
            assert rec.sent_bytes == [32 * n for n in sent] and rec.recv_bytes == [32 * n for n in got]
            assert (back.op, back.sent_rows, back.recv_rows) == ("alltoallv.combine", got, sent)
            assert rec.send_start <= rec.send_end and rec.recv_start <= rec.recv_end
            assert all(rec.recv_start <= t <= rec.recv_end for t in rec.seen)
        ns, count = op._fwd.wait_stats.tolist()
        assert count == [3, 3, 3] and all(n >= 0 for n in ns)
    groups, ops = _loopback_a2a(2, trace=0)
    _round(ops, [torch.tensor([1, 1]), torch.tensor([1, 1])], back=False)
    assert not ops[0]._fwd.trace.any() and not ops[0]._fwd.wait_stats.any()
    assert channel_records(ops[0]._fwd) == []


def test_dispatch_and_combine_record_their_calls(tmp_path):
    """Dispatch records the slots (rows of d.x) this rank routed to each rank and received from each
    source, as the ids say; combine the same slots on their way back (rows of expert_out). Both "ok",
    and ``dump_trace`` writes them all."""
    E, H, M, K = 8, 128, 3, 2
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=2.0, trace=4)
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    idxs = [torch.tensor([[0, 5], [1, -1], [6, 7]]), torch.tensor([[4, 5], [0, 1], [2, 6]])]
    for ep, i in zip(eps, idxs):
        ep.dispatch(torch.randn(M, H).to(torch.bfloat16), i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    for ep, d in zip(eps, ds):
        ep.combine(d.x, torch.rand(M, K), d.handle, phase="send")
    for ep in eps:
        ep.combine(phase="recv")
    slots = [[int(((i >= 0) & (i // (E // 2) == j)).sum()) for j in range(2)] for i in idxs]   # [src][dst]
    for r, ep in enumerate(eps):
        (d,), (c,) = channel_records(ep._dispatch_ch), channel_records(ep._combine_ch)
        assert (d.op, d.call, d.outcome, c.op, c.call, c.outcome) == ("dispatch", 1, "ok", "combine", 1, "ok")
        assert d.sent_rows == slots[r] and d.recv_rows == [slots[0][r], slots[1][r]]
        assert d.sent_bytes == [n * H * 2 for n in slots[r]]
        assert c.sent_rows == d.recv_rows and c.recv_rows == d.sent_rows
        assert c.recv_bytes == [n * H * 2 for n in slots[r]]
        for rec in (d, c):
            assert rec.send_start <= rec.send_end and all(rec.recv_start <= t <= rec.recv_end for t in rec.seen)
        assert ep._dispatch_ch.wait_stats[1].tolist() == [1, 1] == ep._combine_ch.wait_stats[1].tolist()
        dump = json.load(open(groups[r].dump_trace(tmp_path)))
        assert [ch["name"] for ch in dump["channels"]] == ["ep.dispatch", "ep.combine"]
        assert dump["channels"][0]["records"][0]["recv_rows"] == d.recv_rows


def test_trace_option_parses_and_says_the_fix(monkeypatch):
    monkeypatch.setenv("MOE_COMM_TRACE", "on")
    assert trace_calls() == layout.DEFAULT_CALLS
    monkeypatch.setenv("MOE_COMM_TRACE", "0")
    assert trace_calls() == 0 and trace_calls(16) == 16 and trace_calls(True) == layout.DEFAULT_CALLS
    with pytest.raises(ValueError, match="number of calls to keep per channel"):
        trace_calls("lots")


def test_a_skipped_call_is_named_a_desync_with_both_call_numbers(tmp_path, monkeypatch):
    """Rank 1's forward channel skips two call numbers (what a rank that ran ahead publishes): rank 0's
    receive of call 2 sees call 4, raises CommDesyncError, and with MOE_COMM_TRACE_DIR set every rank's
    GroupError dumps its recorder; the analyzer says which rank expected which call and saw which."""
    monkeypatch.setenv("MOE_COMM_TRACE_DIR", str(tmp_path))
    groups, ops = _loopback_a2a(2, trace=8, timeout_s=1.0)
    _round(ops, [torch.tensor([1, 2]), torch.tensor([2, 1])], back=False)
    ops[0](torch.randn(2, *ROW), torch.tensor([1, 1]), phase="send")
    ops[1]._fwd.send_seq += 2
    ops[1](torch.randn(2, *ROW), torch.tensor([1, 1]), phase="send")
    with pytest.raises(CommDesyncError, match="expected call 2 from peer rank 1 but got call 4"):
        ops[0](phase="recv")
    with pytest.raises(CommDesyncError):
        ops[1](phase="recv")
    assert sorted(os.listdir(tmp_path)) == ["trace-rank0.json", "trace-rank1.json"]
    diag = analyze.analyze(analyze.load_dumps(str(tmp_path)))
    assert diag.desyncs[0] == dict(channel="a2a.fwd", op="alltoallv", epoch=0, rank=0, peer=1, expected=2, got=4)
    assert ("DESYNC: rank 0 expected alltoallv call 2 from rank 1 but saw call 4 (channel a2a.fwd, epoch 0): "
            "the two are 2 calls out of step (one of them skipped a call)") in diag.lines, diag.lines
    assert not any(x["rank"] == 1 and x["call"] == 2 for x in diag.never_published)
    assert json.load(open(tmp_path / "trace-rank0.json"))["error"].startswith("alltoallv: rank 0 expected call 2")
    chrome = tmp_path / "timeline.json"
    assert analyze.main([str(tmp_path), "--chrome", str(chrome)]) == 0
    slices = [e for e in json.load(open(chrome))["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["name"]) for e in slices} >= {(0, "alltoallv send #2"), (0, "alltoallv recv #2"),
                                                      (1, "alltoallv send #4")}
    assert [e["args"]["outcome"] for e in slices if e["pid"] == 0 and e["name"] == "alltoallv recv #2"] == ["desync"]
    assert analyze.main([str(tmp_path / "empty")]) == 1


SLOW, DEAD, SLEEP_S, CALLS = 2, 3, 1.0, 3


def _slow_then_dead(group, all_dir):
    """World 4: calls 1..CALLS with rank SLOW sleeping before each send; every rank dumps to
    ``all_dir``; then rank DEAD dies before call CALLS + 1 and the others wait for it (their
    CommTimeoutError dumps them to MOE_COMM_TRACE_DIR)."""
    return slow_then_dead(group, SLOW, DEAD, SLEEP_S, CALLS, lambda: group.dump_trace(all_dir))


def test_slow_rank_and_dead_rank_are_named_from_the_dumps(tmp_path, monkeypatch):
    """Shm processes, world 4. From all four dumps: rank 2 (a sleep before each send) is the slowest,
    the others having waited about SLEEP_S per call for it. From the three survivors' dumps alone (rank 3
    died without one): rank 3 never published call CALLS + 1, and ranks 0, 1, 2 waited for it."""
    all_dir, fault_dir = tmp_path / "all", tmp_path / "fault"
    monkeypatch.setenv("MOE_COMM_TRACE", "8")
    monkeypatch.setenv("MOE_COMM_TRACE_DIR", str(fault_dir))
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_slow_then_dead, 4, str(all_dir), backend="shm", timeout_s=6)
    assert list(info.value.failures) == [DEAD]
    assert all("waiting for peer rank 3" in r for r in info.value.results[:DEAD]), info.value.results

    diag = analyze.analyze(analyze.load_dumps(str(all_dir)))
    assert diag.missing == [] and diag.slowest == SLOW, diag.lines
    for r in (0, 1, 3):
        # at least half the sleep: a rank starved of CPU (2 cores, 4 interpreted ranks) reaches its wait late
        assert diag.waits[(r, SLOW)]["total_ns"] > 0.5 * CALLS * SLEEP_S * 1e9, diag.lines
    assert any(line.startswith(f"SLOWEST: rank {SLOW}") for line in diag.lines)

    diag = analyze.analyze(analyze.load_dumps(str(fault_dir)))
    assert diag.ranks == [0, 1, 2] and diag.missing == [DEAD]
    dead = [x for x in diag.never_published if x["rank"] == DEAD]
    assert [(x["op"], x["call"], x["waiters"]) for x in dead] == [("alltoallv", CALLS + 1, [0, 1, 2])], diag.lines
    assert not [x for x in diag.never_published if x["rank"] != DEAD], diag.lines
    assert (f"NEVER PUBLISHED: rank {DEAD} never published alltoallv call {CALLS + 1} (channel a2a.fwd, "
            f"epoch 0): ranks 0, 1, 2 waited for it (receive: timeout)") in diag.lines


# ---- consistent records (issue 33, item 4): a seqlock per half, rows prepared for the next call -------

def test_a_dump_while_a_receive_waits_never_pairs_its_tag_with_an_older_calls_words(monkeypatch):
    """A ring of two calls (three rows) on loopback world 2: calls 1-3, then call 4 reuses call 1's row.
    Rank 1 does not come to call 4, and while rank 0's receive waits, a dump reads rank 0's ring at
    every poll (the interpreter runs the poll between two statements of the kernel). The call-4 receive
    is there, running (no end, no outcome), and its per-peer words are its own, never call 1's (they
    used to be reported under call 4's tag).

    Which waits had ended at a dump depends on the order the receive's programs run in (a GPU runs them
    in any order; so does the interpreter under ``MOE_COMM_INTERPRET_ORDER``), so every dump is checked
    against what holds in every order. A source's words are written together by the program that
    recorded it (SEEN, WAITED, then its rows; no poll in between): at a dump each source's words are
    either not written yet (no SEEN, 0 rows, 0 WAITED) or call 4's. Call 4 sees rank 0's flag at or
    after its start, never rank 1's; calls 1-3 sent other counts and saw both flags before call 4
    began, so a word of call 1 shows as a SEEN before call 4's start, a SEEN of rank 1, other rows, or
    a WAITED beside no SEEN of rank 0. Rank 1's wait ends only by the timeout, recorded in rank 0's
    error word before any wait gives up: at the dumps before it (there are some in every order: the
    first wait for rank 1 polls for the whole timeout) rank 1's WAITED is 0 too. Rank 0's own flag
    seen in this call is checked on the record the call leaves (in some orders no dump comes after
    rank 0's words: under ``reverse`` its program runs last)."""
    from moe_comm.interpreter import twin_module
    groups, ops = _loopback_a2a(2, trace=2, timeout_s=1.0)
    older = [torch.tensor([2, 2]), torch.tensor([3, 1])]   # calls 1-3: rank 0 sends [2, 2], gets [2, 3]
    counts = [torch.tensor([1, 3]), torch.tensor([2, 4])]  # call 4: rank 0 sends [1, 3], gets [1, 0]
    for _ in range(3):
        _round(ops, older, back=False)
    twin = twin_module("moe_comm.triton_kernels.sync")
    now, dumps = twin.now_ns, []

    def poll():
        dumps.append((int(groups[0].error_word[0]), channel_records(ops[0]._fwd)))
        return now()
    monkeypatch.setattr(twin, "now_ns", poll)
    ops[0](torch.randn(4, *ROW), counts[0], phase="send")
    with pytest.raises(CommTimeoutError, match="peer rank 1"):
        ops[0](phase="recv")
    monkeypatch.undo()
    assert any(err == 0 for err, _ in dumps), "no dump while the first wait for rank 1 polled"
    for err, recs in dumps:
        assert [r.call for r in recs] == [2, 3, 4], recs
        rec = recs[-1]
        assert rec.recv_start is not None and rec.recv_end is None and rec.outcome is None, rec
        assert rec.sent_rows == [1, 3], rec
        if rec.seen[0] is None:
            assert rec.recv_rows[0] == 0 and rec.waited[0] == 0, rec
        else:
            assert rec.seen[0] >= rec.recv_start and rec.recv_rows[0] == 1, rec
            assert 0 <= rec.waited[0] <= rec.seen[0] - rec.recv_start, rec
        assert rec.seen[1] is None and rec.recv_rows[1] == 0, rec
        if err == 0:
            assert rec.waited[1] == 0, rec
    (rec,) = [r for r in channel_records(ops[0]._fwd) if r.call == 4]
    assert rec.outcome == "timeout" and rec.recv_start <= rec.recv_end, rec
    assert rec.seen[0] is not None and rec.recv_start <= rec.seen[0] <= rec.recv_end, rec
    assert rec.seen[1] is None and rec.recv_rows == [1, 0] and rec.sent_rows == [1, 3], rec


def test_rows_are_prepared_and_a_call_on_an_unprepared_row_reports_no_per_peer_words():
    """After every phase the next call's row is prepared (tag PREP of that call, per-peer words 0) and
    the phase's own tag carries DONE. A call whose row nobody prepared (the one after an aborted call)
    is marked STALE: its header is reported, its per-peer words are not (they may be an older call's).
    ``reset()`` prepares the row of the new epoch's first call: its record is complete."""
    groups, ops = _loopback_a2a(2, trace=2)
    counts = [torch.tensor([1, 3]), torch.tensor([2, 4])]
    _round(ops, counts, back=False)
    ring, flag = ops[0]._fwd.trace, layout.split_tag
    row, nxt = ring[1].tolist(), ring[2].tolist()
    for t in (layout.T_SEND_TAG, layout.T_RECV_TAG):
        assert row[t] == 1 | layout.DONE_BIT and nxt[t] == 2 | layout.PREP_BIT, (row, nxt)
    assert nxt[layout.HEADER_WORDS:] == [0] * 8
    for _ in range(2):
        _round(ops, counts, back=False)           # calls 2, 3: row 1 prepared for call 4
    recs = {r.call: r for r in channel_records(ops[0]._fwd)}
    assert sorted(recs) == [2, 3] and recs[3].recv_rows == [1, 2] and recs[3].seen[1] is not None
    for op in ops:                                # call 4 aborted on every rank: nothing traced
        with pytest.raises(TypeError, match="dtype"):
            op(torch.randn(4, *ROW).double(), torch.tensor([1, 3]), phase="send")
    _round(ops, counts, back=False)               # call 5, on call 2's row, never prepared
    recs = {r.call: r for r in channel_records(ops[0]._fwd)}
    assert sorted(recs) == [5] and ops[0]._fwd.trace[2, layout.T_RECV_TAG] & layout.STALE_BIT
    assert (recs[5].outcome, recs[5].recv_rows, recs[5].seen, recs[5].sent_rows) == ("ok", [], [], [])
    for g in groups:
        g.reset()
    assert not ops[0]._fwd.trace[1].any()        # row 1, epoch 0's call 4 prepared by call 3: cleared
    _round(ops, counts, back=False)               # epoch 1, call 1: on the row the reset prepared
    (after,) = [r for r in channel_records(ops[0]._fwd) if r.epoch == 1]
    assert (after.call, after.outcome, after.recv_rows, after.sent_rows) == (1, "ok", [1, 2], [1, 3])
    _round(ops, counts, back=False)               # call 2 was prepared by call 1
    (two,) = [r for r in channel_records(ops[0]._fwd) if (r.epoch, r.call) == (1, 2)]
    assert two.recv_rows == [1, 2] and two.sent_rows == [1, 3]


class _Row:
    """A ring row whose tag words read ``tags[k]`` at the k-th read (a writer publishing meanwhile)."""

    def __init__(self, words, tags):
        self.words, self.tags, self.reads = list(words), tags, {}

    def __getitem__(self, t):
        k = self.reads.get(t, 0)
        self.reads[t] = k + 1
        return self.tags.get(t, [self.words[t]])[min(k, len(self.tags.get(t, [0])) - 1)]

    def tolist(self):
        return list(self.words)


def test_the_reader_keeps_a_half_only_when_its_tag_reads_alike_around_its_words():
    """``consistent_row``: a half whose tag changes while its words are read (a phase beginning or ending
    meanwhile) is given up after its retries; the other half is kept. ``decode_row``: end words only
    under DONE, per-peer words not under STALE, a prepared row is no record."""
    from moe_comm.trace.recorder import READ_TRIES, consistent_row
    world, words = 2, [0] * layout.record_words(2)
    words[layout.T_SEND_TAG], words[layout.T_RECV_TAG] = 7 | layout.DONE_BIT, 7
    words[layout.T_SEND_END], words[layout.T_RECV_END], words[layout.T_OUTCOME] = 50, 60, 1
    words[layout.HEADER_WORDS:layout.HEADER_WORDS + 2] = [3, 4]          # SENT_ROWS
    moving = [7 | layout.DONE_BIT, 0] * READ_TRIES                         # never reads alike twice
    got = consistent_row([_Row(words, {layout.T_SEND_TAG: moving})], 0)
    assert got[layout.T_SEND_TAG] == 0 and got[layout.T_RECV_TAG] == 7
    (rec,) = layout.decode_row(got, world, 4)
    assert rec.send_start is None and rec.recv_start is not None
    assert (rec.recv_end, rec.outcome) == (None, None)                    # no DONE: the end words are not read
    (rec,) = layout.decode_row(words, world, 4)
    assert (rec.send_end, rec.sent_rows) == (50, [3, 4])
    stale = list(words)
    stale[layout.T_SEND_TAG] |= layout.STALE_BIT
    assert layout.decode_row(stale, world, 4)[0].sent_rows == []
    prepared = list(words)
    prepared[layout.T_SEND_TAG] = prepared[layout.T_RECV_TAG] = 8 | layout.PREP_BIT
    assert layout.decode_row(prepared, world, 4) == []

def test_dumps_made_with_the_recorder_off_say_so_and_how_to_turn_it_on(tmp_path, monkeypatch, capsys):
    """World 3, recorder off, rank 2 silent: ranks 0 and 1 time out and dump (MOE_COMM_TRACE_DIR), rank
    2 dumps by hand. The analyzer says the recorder was off on every rank, how to turn it on, what
    works without it, and the error each rank raised, instead of only "3 of 3 ranks dumped". A dump
    of a version that did not write ``recorder_calls`` is recognised by its empty channels."""
    monkeypatch.setenv("MOE_COMM_TRACE_DIR", str(tmp_path))
    groups, ops = _loopback_a2a(3, trace=0, timeout_s=0.3)
    for op in ops[:2]:
        op(torch.randn(2, *ROW), torch.tensor([1, 1, 0]), phase="send")
    for op in ops[:2]:
        with pytest.raises(CommTimeoutError):
            op(phase="recv")
    groups[2].dump_trace(tmp_path)
    legacy = json.load(open(tmp_path / "trace-rank2.json"))
    del legacy["recorder_calls"]
    json.dump(legacy, open(tmp_path / "trace-rank2.json", "w"))
    assert analyze.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 of 3 ranks dumped"
    assert out[1].startswith("RECORDER OFF on ranks 0, 1, 2: their dumps hold no calls") and "MOE_COMM_TRACE=1" in out[1]
    assert "docs/metrics.md" in out[1]
    assert out[2].startswith("  rank 0 raised: alltoallv: rank 0 timed out after 0.3 s waiting for peer rank 2")
    assert out[3].startswith("  rank 1 raised: alltoallv: rank ") and "waiting for peer rank 2" in out[3]
    assert out[4].startswith("timeline: ") and len(out) == 5
    traced, tops = _loopback_a2a(2, trace=4)
    _round(tops, [torch.tensor([1, 1]), torch.tensor([1, 1])], back=False)
    for g in traced:
        g.dump_trace(tmp_path / "on")
    assert not analyze.analyze(analyze.load_dumps(str(tmp_path / "on"))).recorder_off
