"""Prometheus metrics of this process's moe-comm groups (``pip install 'moe-comm[metrics]'``).

    moe_comm.metrics.serve(9400)      # standalone: http://<host>:9400/metrics (scripts, the DecodeEngine)
    moe_comm.metrics.register()       # into prometheus_client's registry (the serving adapters do this)
    moe_comm.metrics.text()           # one scrape, as text

Every CommGroup of the process is exported (``moe_comm.group.live_groups``), labelled by its ``rank``;
``op`` is an ``errors.OPS`` name, ``peer`` another rank. The list, what needs the flight recorder
(``MOE_COMM_TRACE``) and a sample scrape: docs/metrics.md.

Where the numbers come from (nothing here adds device work or a device sync to a call):

- host state of the group: errors raised (``CommGroup.error_counts``), epoch, excluded ranks;
- device counters the kernels already keep: calls (each channel's receive count ``recv_seq``, plus
  ``calls_before_reset``), rows per local expert and rows addressed to excluded ranks
  (``PhasedOp.counters``), wait totals per source (``Channel.wait_stats``, recorder on);
- the flight recorder's rings (pinned host memory on CUDA): per call, rows and bytes per peer and the
  wait for each source (the histogram). A refresh reads the ended records it has not read yet, in call
  order (epoch, then call); a call whose record was overwritten first, or has no per-peer words (STALE:
  the call after an aborted one), is counted in ``moe_comm_recorder_missed_calls_total``.

Reading without blocking a step. A refresh runs in the scraping thread (or, in prometheus_client's
multiprocess mode, a refresher thread) under a lock no op takes. Host state and the rings are plain
host memory. Device counters: on the CPU the tensors themselves; on CUDA the scraping thread makes no
CUDA call at all (a call from another thread during a CUDA graph capture in global mode can invalidate
the capture): it reads pinned copies and asks for new ones (``CommGroup.on_check``); the next
``group.check()`` on the step thread, which runs at the end of every eager op call and at the engines'
per-step check, enqueues one non-blocking copy per counter on a side stream that does not wait for the
compute stream (never while capturing), and returns. Each counter is an int64 that only grows (within an
epoch), so a copy read while it lands still holds, word by word, values the counter had. So device
counters lag by one scrape on CUDA; under pure CUDA-graph replay with no ``check()`` between steps
they stay at the last copy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .group import live_groups
from .phased import PhasedOp
from .trace import layout
from .trace.recorder import consistent_rows

logger = logging.getLogger(__name__)

ENV_INTERVAL = "MOE_COMM_METRICS_INTERVAL_S"   # multiprocess mode: seconds between refreshes
DEFAULT_INTERVAL_S = 5.0
NS_PER_S = 1e9
# Buckets of moe_comm_call_wait_seconds, one per decade: GPU waits are microseconds, a straggler
# milliseconds, a timeout (and the CPU interpreter) seconds. Few, since every (op, peer) has them all.
WAIT_BUCKETS_S = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
INSTALL_FIX = "pip install 'moe-comm[metrics]' (prometheus-client)"
# How prometheus_client's multiprocess mode merges a gauge's files (one per process): the value written
# last. A rank label has one live process, but a restarted rank is a new process next to the dead one's
# file: "max" would keep the dead process's epoch and exclusions for ever ("live*" modes drop a process's
# file only when someone calls mark_process_dead(pid) for it). tests/test_metrics.py restarts a rank.
GAUGE_MODE = "mostrecent"


@dataclass(frozen=True)
class Spec:
    """One exported metric."""

    kind: str        # "counter" | "gauge" | "histogram"
    name: str        # exposed name (counters: with _total)
    labels: tuple    # label names
    recorder: bool   # True: needs the flight recorder (MOE_COMM_TRACE); False: works with it off
    help: str


SPECS = (
    Spec("counter", "moe_comm_calls_total", ("rank", "op"), False,
         "Calls of the op on this rank whose receive phase ran (aborted calls included; CUDA graph replays "
         "included). World 1 runs one kernel per call and counts none."),
    Spec("counter", "moe_comm_errors_total", ("rank", "op", "kind", "peer"), False,
         "Errors this rank raised, by kind (timeout, abort, desync, excluded, capacity, invalid_index, "
         "global_scale, other) and peer (the rank waited for or out of step; the destination of a capacity "
         "error; the source of a global_scale error; empty for invalid_index). A group-wide error counts "
         "once per epoch however often it is raised again."),
    Spec("gauge", "moe_comm_epoch", ("rank",), False, "The group's epoch: 0, then one more per reset."),
    Spec("counter", "moe_comm_resets_total", ("rank",), False,
         "group.reset() calls completed on this rank (exclude() ends with one)."),
    Spec("gauge", "moe_comm_peer_excluded", ("rank", "peer"), False, "1 if this rank's group excluded the peer."),
    Spec("counter", "moe_comm_expert_rows_total", ("rank", "op", "expert"), False,
         "Rows (token, expert slots) received by each local expert (global expert id): the expert load."),
    Spec("counter", "moe_comm_excluded_rows_total", ("rank", "op"), False,
         "Dispatch slots / alltoallv rows this rank addressed to excluded ranks: not sent."),
    Spec("gauge", "moe_comm_recorder_records", ("rank",), False,
         "Calls per channel the flight recorder keeps (MOE_COMM_TRACE); 0: off, the recorder metrics stay empty."),
    Spec("counter", "moe_comm_wait_seconds_total", ("rank", "op", "peer"), True,
         "Time this rank's receives waited for the peer's flag, every call (waits that got it). Recorder on."),
    Spec("counter", "moe_comm_waits_total", ("rank", "op", "peer"), True,
         "Waits counted in moe_comm_wait_seconds_total. Recorder on."),
    Spec("histogram", "moe_comm_call_wait_seconds", ("rank", "op", "peer"), True,
         "Per recorded call: how long this rank's receive waited for the peer's flag (until it came or the "
         "wait gave up). Recorder on; calls overwritten before a refresh: moe_comm_recorder_missed_calls_total."),
    Spec("counter", "moe_comm_rows_sent_total", ("rank", "op", "peer"), True,
         "Rows this rank's sends addressed to the peer (its own rank: read in place), recorded calls."),
    Spec("counter", "moe_comm_rows_received_total", ("rank", "op", "peer"), True,
         "Rows this rank's receives took from the peer, recorded calls."),
    Spec("counter", "moe_comm_bytes_sent_total", ("rank", "op", "peer"), True,
         "Bytes of moe_comm_rows_sent_total (rows x the channel's row bytes)."),
    Spec("counter", "moe_comm_bytes_received_total", ("rank", "op", "peer"), True,
         "Bytes of moe_comm_rows_received_total."),
    Spec("counter", "moe_comm_recorder_missed_calls_total", ("rank", "op"), True,
         "Calls whose record the flight recorder's ring overwrote before a refresh read it (at least), or "
         "whose record has no per-peer words (the call after an aborted one): their rows, bytes and per-call "
         "waits are not in the counters above (the wait totals are)."),
)


def _prometheus():
    try:
        import prometheus_client  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"moe_comm.metrics needs prometheus_client: {INSTALL_FIX}") from e
    return prometheus_client


def status() -> dict:
    """For ``python -m moe_comm info``: whether the exporter can run here (prometheus_client installed)."""
    try:
        import prometheus_client  # noqa: F401, PLC0415
    except ImportError:
        return dict(available=False, detail=f"not available: {INSTALL_FIX}")
    from importlib.metadata import version  # noqa: PLC0415
    return dict(available=True, detail=f"prometheus_client {version('prometheus-client')}: "
                                       f"moe_comm.metrics.serve(port); the vLLM/SGLang adapters register it")


def multiprocess_mode() -> bool:
    """True if prometheus_client keeps values in files shared by processes (PROMETHEUS_MULTIPROC_DIR was
    set when it was imported): the server's registry then reads those files, not collectors."""
    from prometheus_client import values  # noqa: PLC0415
    return values.ValueClass is not values.MutexValue


# ---- device counters, read without a sync -------------------------------------------------------

class DeviceReads:
    """Host copies of one group's device counters (see the module docstring).

    ``read(owner, name, tensor, base)`` -> (int64 NumPy array of ``tensor``, ``base()``) or None before
    the first copy (``owner``: the op the counter belongs to, ``name`` the counter's). Without copies
    (CPU) the array is the tensor's own memory and ``base()`` is read first. With copies (CUDA;
    ``copy=True`` makes a CPU group copy too, for tests) both come from the last copy, ``base()`` taken
    when the copy was enqueued: a reset (which synchronizes the device first) cannot fall between them.
    """

    def __init__(self, group, copy: bool | None = None):
        self._group = weakref.ref(group)
        self.cuda = group.device.type == "cuda"
        self.copy = self.cuda if copy is None else copy
        self._wanted: list = []   # (owner, name, tensor, base) the last refresh read (scraping thread)
        # owner -> name -> (host array, base at copy, host tensor) (copying thread); an op that is gone
        # takes its copies with it
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stream = None

    def begin(self) -> None:
        self._wanted = []

    def read(self, owner, name: str, tensor: torch.Tensor, base=None):
        if not self.copy:
            b = base() if base is not None else 0
            return tensor.numpy(), b
        self._wanted.append((owner, name, tensor, base))
        return self._copies.get(owner, {}).get(name)

    def request(self) -> None:
        """Ask the next ``group.check()`` for fresh copies of what the last refresh read."""
        g = self._group()
        if self.copy and self._wanted and g is not None:
            g.on_check = self._copy_now

    def _copy_now(self) -> None:
        """Run by ``group.check()`` (the step thread): enqueue the copies, never wait for them."""
        g = self._group()
        g.on_check = None
        if self.cuda and torch.cuda.is_current_stream_capturing():
            g.on_check = self._copy_now   # a copy must not be captured: the next check does it
            return
        if self.cuda and self._stream is None:
            self._stream = torch.cuda.Stream(g.device)
        for owner, name, t, base in list(self._wanted):
            copies = self._copies.setdefault(owner, {})
            old = copies.get(name)
            # The first copy of a counter allocates its pinned buffer (page-locked allocation: CUDA may
            # serialize the device's streams there, once per counter); every later copy reuses it.
            host = torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.cuda) if old is None else old[2]
            b = base() if base is not None else 0
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    host.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
            else:
                host.copy_(t)
            copies[name] = (host.numpy(), b, host)


# ---- the exporter ----------------------------------------------------------------------------------

class _Cursor:
    """How far a refresh has read one op's flight-recorder ring: the newest ended record read of each
    half, by its call's flag (``protocol.flag(epoch, call)``, no status bits: it orders calls by (epoch,
    call)), and the (epoch, call) of that receive (a gap to the next one was missed)."""

    def __init__(self):
        self.recv_flag = 0          # newest ended receive phase read
        self.send_flag = 0          # newest ended send phase read
        self.epoch = self.call = 0  # (epoch, call) of recv_flag


def _ended_after(tags: np.ndarray, after: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Of one half's tags (a ring snapshot's, ``layout``): the rows holding an ended record (DONE) of a
    call after flag ``after``, in call order; those of them whose per-peer words are the call's (not
    STALE); and the newest flag among them (``after`` if none)."""
    flags = tags & ~layout.TAG_BITS
    ended = ((tags & layout.DONE_BIT) != 0) & ((tags & layout.PREP_BIT) == 0) & (flags > after)
    rows = np.nonzero(ended)[0]
    rows = rows[np.argsort(flags[rows], kind="stable")]
    fresh = rows[(tags[rows] & layout.STALE_BIT) == 0]
    return rows, fresh, int(flags[rows[-1]]) if len(rows) else after


class _GroupState:
    """What the exporter keeps per group: its device reads, the cumulative values it last pushed, ring
    cursors, label children."""

    def __init__(self, group, copy=None):
        self.reads = DeviceReads(group, copy)
        # Cumulative values last pushed, per source: the group itself (key None) or an op (two buffers of
        # one group share labels: each adds its own growth). {(metric name, labels): value}
        self.pushed: dict = {}
        self.op_pushed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # PhasedOp -> {...}
        self.children: dict = {}                             # (metric name, labels) -> labelled child
        self.cursors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # PhasedOp -> _Cursor


class Exporter:
    """prometheus_client metric objects brought up to date by ``refresh()`` from ``groups`` (default:
    every live group of the process, ``live_groups``). Counters advance by the growth of their source
    (``_advance``). The process has one (``exporter()``: what ``serve``/``register``/``text`` use); another
    with its own groups (e.g. a test's) keeps its own values, but only ``exporter()`` belongs in a
    multiprocess directory (two would add up there)."""

    def __init__(self, groups=None):
        pc = _prometheus()
        self._groups = None if groups is None else [weakref.ref(g) for g in groups]
        self.lock = threading.Lock()
        self.states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # CommGroup -> _GroupState
        self.m = {}
        for s in SPECS:
            if s.kind == "counter":
                self.m[s.name] = pc.Counter(s.name, s.help, s.labels, registry=None)
            elif s.kind == "gauge":
                self.m[s.name] = pc.Gauge(s.name, s.help, s.labels, registry=None, multiprocess_mode=GAUGE_MODE)
            else:
                self.m[s.name] = pc.Histogram(s.name, s.help, s.labels, registry=None, buckets=WAIT_BUCKETS_S)
        self.registries: list = []
        self.refreshes = 0          # refreshes completed
        self.refresher: threading.Thread | None = None
        self._failed: set = set()

    def state(self, group, copy=None) -> _GroupState:
        st = self.states.get(group)
        if st is None:
            st = self.states[group] = _GroupState(group, copy)
        return st

    # ---- refresh -----------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Bring every metric up to date with every live group of this process."""
        groups = live_groups() if self._groups is None else [g for g in (r() for r in self._groups)
                                                             if g is not None and not g.closed]
        with self.lock:
            for g in groups:
                try:
                    self._refresh_group(g, self.state(g))
                except Exception:   # noqa: BLE001  (a scrape must answer; say once per group what failed)
                    if id(g) not in self._failed:
                        self._failed.add(id(g))
                        logger.warning("moe_comm.metrics: refresh of %r failed", g, exc_info=True)
            self.refreshes += 1

    def _child(self, st, name: str, labels: tuple):
        """The labelled child of metric ``name`` (made once: ``labels()`` costs microseconds)."""
        child = st.children.get((name, labels))
        if child is None:
            child = st.children[(name, labels)] = self.m[name].labels(*labels)
        return child

    def _advance(self, st, name: str, labels: tuple, value, scale: float = 1.0, restart: bool = False,
                 op: PhasedOp | None = None) -> None:
        """Counter ``name`` follows a cumulative source (of ``op``, or of the group) now at ``value``: add
        its growth since the last push. A source that went down: with ``restart`` (its owner zeroed it) it
        counts again from zero, else the lower value is a read racing an update and is ignored until the
        source passes the last one."""
        child = self._child(st, name, labels)
        pushed = st.pushed if op is None else st.op_pushed.setdefault(op, {})
        last = pushed.get((name, labels), 0)
        if value > last:
            child.inc((value - last) / scale)
        elif value < last and restart:
            child.inc(value / scale)
        else:
            return
        pushed[(name, labels)] = value

    def _refresh_group(self, g, st: _GroupState) -> None:
        rank, world = str(g.rank), g.world_size
        st.reads.begin()
        self._child(st, "moe_comm_epoch", (rank,)).set(g.epoch)
        self._advance(st, "moe_comm_resets_total", (rank,), g.epoch)
        self._child(st, "moe_comm_recorder_records", (rank,)).set(g.trace_calls)
        for j in range(world):
            self._child(st, "moe_comm_peer_excluded", (rank, str(j))).set(0 if g._live[j] else 1)
        for (kind, op, peer), n in g.error_counts.items():
            self._advance(st, "moe_comm_errors_total", (rank, op, kind, peer), n)
        for op in _ops(g):
            self._refresh_op(g, st, op, rank)
            time.sleep(0)   # let a waiting step thread have the GIL between ops
        st.reads.request()

    def _refresh_op(self, g, st: _GroupState, op: PhasedOp, rank: str) -> None:
        ch, name, world = op.channel, op.name, g.world_size
        got = st.reads.read(op, "calls", ch.recv_seq, lambda: ch.calls_before_reset)
        if got is not None:
            self._advance(st, "moe_comm_calls_total", (rank, name), got[1] + int(got[0][0]), op=op)
        for key, t in op.counters.items():
            got = st.reads.read(op, key, t)
            if got is None:
                continue
            if key == "expert_rows":
                first = g.rank * t.shape[0]
                for e, n in enumerate(got[0].tolist()):
                    self._advance(st, "moe_comm_expert_rows_total", (rank, name, str(first + e)), n, restart=True,
                                  op=op)
            elif key == "excluded_rows":
                self._advance(st, "moe_comm_excluded_rows_total", (rank, name), int(got[0][0]), restart=True, op=op)
        if not g.trace_calls:
            return
        got = st.reads.read(op, "waits", ch.wait_stats)
        if got is not None:
            ns, count = got[0].tolist()
            for j in range(world):
                if j == g.rank:   # its own flag (a peer is another rank, as in the histogram)
                    continue
                labels = (rank, name, str(j))
                self._advance(st, "moe_comm_wait_seconds_total", labels, ns[j], scale=NS_PER_S, op=op)
                self._advance(st, "moe_comm_waits_total", labels, count[j], op=op)
        self._read_ring(g, st, op, rank)

    def _read_ring(self, g, st: _GroupState, op: PhasedOp, rank: str) -> None:
        """The records of ``op``'s ring that no refresh has read, in call order (epoch, then call): each
        ended receive phase (its waits per source into the histogram, its rows per source) and each ended
        send phase (rows per peer). A STALE record (the call after an aborted one: its per-peer words are
        not its own) adds no rows nor waits and counts as missed."""
        ch, name, world, me = op.channel, op.name, g.world_size, g.rank
        cur = st.cursors.get(op)
        if cur is None:
            cur = st.cursors[op] = _Cursor()
        rows = consistent_rows(ch.trace)   # host memory (pinned on CUDA): a snapshot, then decoded
        ended, new, cur.recv_flag = _ended_after(rows[:, layout.T_RECV_TAG], cur.recv_flag)
        missed = len(ended) - len(new)
        for tag in rows[ended, layout.T_RECV_TAG].tolist():   # calls of an epoch are consecutive: a gap was
            epoch, call = layout.split_tag(tag & ~layout.TAG_BITS)   # overwritten (or aborted: no record)
            if epoch != cur.epoch:   # and so were the rest of the epochs in between (calls of each at its reset)
                missed += sum(ch.epoch_calls.get(e, 0) for e in range(cur.epoch, epoch)) - cur.call
            missed += call - 1 - (cur.call if epoch == cur.epoch else 0)
            cur.epoch, cur.call = epoch, call
        at = layout.seen_word(world), layout.waited_word(world), layout.recv_rows_word(world)
        seen, waited, recv = (rows[new, w:w + world] for w in at)
        waited_for = (waited != 0) | (seen != 0)
        for j in range(world):
            if j != me and waited_for[:, j].any():   # a peer is another rank
                observe_many(self._child(st, "moe_comm_call_wait_seconds", (rank, name, str(j))),
                             waited[waited_for[:, j], j] / NS_PER_S)
        _, sent_new, cur.send_flag = _ended_after(rows[:, layout.T_SEND_TAG], cur.send_flag)
        w = layout.sent_rows_word(world)
        for direction, counts in (("sent", rows[sent_new, w:w + world].sum(axis=0)), ("received", recv.sum(axis=0))):
            for j, n in enumerate(counts.tolist()):
                labels = (rank, name, str(j))
                rows_total = self._child(st, f"moe_comm_rows_{direction}_total", labels)
                bytes_total = self._child(st, f"moe_comm_bytes_{direction}_total", labels)
                if n:
                    rows_total.inc(n)
                    bytes_total.inc(n * ch.row_bytes)
        missed_total = self._child(st, "moe_comm_recorder_missed_calls_total", (rank, name))
        if missed:
            missed_total.inc(missed)

    # ---- exposition ----------------------------------------------------------------------------------
    def text(self) -> str:
        """One scrape, in Prometheus' text format."""
        pc = _prometheus()
        registry = pc.CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return pc.generate_latest(registry).decode()

    def collect(self):
        """Refresh, then every metric family (without the ``_created`` samples)."""
        self.refresh()
        for metric in self.m.values():
            for family in metric.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family

    def start_refresher(self, interval_s: float) -> None:
        """A daemon thread that refreshes every ``interval_s`` (multiprocess mode: nobody scrapes here)."""
        if self.refresher is not None:
            return
        stop = threading.Event()

        def loop():
            while not stop.wait(interval_s):
                self.refresh()

        self.refresher = threading.Thread(target=loop, name="moe_comm-metrics", daemon=True)
        self.refresher.stop = stop
        self.refresher.start()


class _Collector:
    """What a prometheus_client registry calls at every scrape: a refresh, then the families."""

    def __init__(self, exporter: Exporter):
        self.exporter = exporter

    def collect(self):
        return self.exporter.collect()

    def describe(self):
        return [family for metric in self.exporter.m.values() for family in metric.describe()]


_BOUNDS = np.array(WAIT_BUCKETS_S + (float("inf"),))


def observe_many(child, seconds: np.ndarray) -> None:
    """``child.observe(v)`` for every v of ``seconds``, as one update per bucket: a prometheus_client
    Histogram child keeps a count per bucket (``_buckets``: the first bound >= v counts v) and a sum
    (``_sum``), which observe() updates one value at a time (~1-4 us each). A version of
    prometheus_client without them gets observe() per value. tests/test_metrics.py compares the two."""
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if buckets is None or total is None or len(buckets) != len(_BOUNDS):
        for v in seconds.tolist():
            child.observe(v)
        return
    counts = np.bincount(np.searchsorted(_BOUNDS, seconds, side="left"), minlength=len(_BOUNDS))
    for i in np.nonzero(counts)[0].tolist():
        buckets[i].inc(int(counts[i]))
    total.inc(float(seconds.sum()))


def _ops(group) -> list[PhasedOp]:
    """The group's open ops that have a channel (every op direction: dispatch, combine, ...)."""
    out = []
    for ref in list(group._members):   # a copy: the step thread may append
        m = ref()
        if isinstance(m, PhasedOp) and m.channel is not None and not m._closed:
            out.append(m)
    return out


_EXPORTER: Exporter | None = None
_EXPORTER_LOCK = threading.Lock()


def exporter() -> Exporter:
    """This process's exporter (made on first use)."""
    global _EXPORTER
    with _EXPORTER_LOCK:
        if _EXPORTER is None:
            _EXPORTER = Exporter()
        return _EXPORTER


# ---- public API ------------------------------------------------------------------------------------

def refresh() -> None:
    """Bring the metrics up to date now (what a scrape does first)."""
    exporter().refresh()


def text() -> str:
    """One scrape of this process's groups, in Prometheus' text format."""
    return exporter().text()


@dataclass
class Server:
    """A running standalone exporter: ``port`` (the one bound), ``close()``."""

    port: int
    _server: object

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(port: int = 0, addr: str = "0.0.0.0") -> Server:
    """Serve ``/metrics`` of this process's groups over HTTP (prometheus_client's server, a daemon thread),
    on ``port`` (0: any free port; ``Server.port`` says which). Each scrape refreshes first; nothing runs
    between scrapes."""
    pc = _prometheus()
    registry = pc.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(exporter()))
    server, _thread = pc.start_http_server(port, addr=addr, registry=registry)
    return Server(server.server_port, server)


def register(registry=None) -> str:
    """Export this process's groups through a prometheus_client ``registry`` (default
    ``prometheus_client.REGISTRY``: what vLLM serves on /metrics when the engine runs in its API server's
    process); idempotent. In prometheus_client's multiprocess mode (``multiprocess_mode()``: SGLang with
    --enable-metrics, vLLM with several API servers or PROMETHEUS_MULTIPROC_DIR set) the server's
    registry reads the files every process writes, and a collector here would never be asked: a daemon
    thread refreshes this process's values instead, every MOE_COMM_METRICS_INTERVAL_S (default 5 s).
    Returns "multiprocess" or "collector"."""
    pc = _prometheus()
    exp = exporter()
    if multiprocess_mode():
        exp.start_refresher(float(os.environ.get(ENV_INTERVAL, DEFAULT_INTERVAL_S)))
        return "multiprocess"
    registry = pc.REGISTRY if registry is None else registry
    with _EXPORTER_LOCK:
        if not any(r is registry for r in exp.registries):
            registry.register(_Collector(exp))
            exp.registries.append(registry)
    return "collector"
