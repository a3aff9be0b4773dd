"""Pluggable MoE communication backends: how a rank's tokens reach the experts and come back.

Every backend is one rank's object with the same two calls (``MoEComm``):

    x_e, counts, ctx = comm.dispatch(x, topk_idx)       # x [T, H] dtype; topk_idx [T, K] int64, -1 = not routed
        x_e    [E_local, R, H] dtype, R = world * max_tokens: x_e[e, :counts[e]] are the rows for local expert e,
               ordered by (source rank, token index); rows past a count are unspecified
        counts [E_local] int32 on the device (never read on the host by the graph-capturable backends)
    y = comm.combine(y_e, topk_weights, ctx)            # y_e [E_local, R, H]; topk_weights [T, K] float32
        y [T, H] dtype: y[t] = sum over k with topk_idx[t, k] >= 0 of topk_weights[t, k] * y_e[row of (t, k)],
        accumulated in float32 in k order (as EPBuffer.combine does)

``phase="send" | "recv" | "both"`` splits each call in two for loopback worlds (all ranks' sends, then all
receives); the torch.distributed baselines are emulated there by copies through shared memory.

  sync     what serving code does today: counts exchanged, read on the host (.tolist()), then
           all_to_all_single with exact splits. Eager only: a host read cannot be captured.
  sync-graphed  the same exchange as an engine runs it: the device work between the host reads (the
           whole model apart from the exchange) split into pieces that ``piecewise.PiecewiseEngine``
           captures as CUDA graphs; the split read and the collective run eagerly between them.
  padded   the capturable workaround: all_to_all_single with every split padded to the capacity of the
           step's batch bucket (T x min(K, E_local) rows per peer at world 1; at world > 1 the ranks pick
           their buckets independently, so the capacity of the largest bucket).
  dynamic  moe_comm.AllToAllvDynamic (counts stay on the device) + a local permute; capturable.
  fused    moe_comm.EPBuffer dispatch / combine; capturable. Its prefill steps run on a moe_comm.PrefillBuffer
           (``FusedEP.prefill``, a ``PrefillEP``): the high-throughput op, rank-major, each token once per rank.
  fused-layer  moe_comm.MoELayer: dispatch, the expert GEMMs and combine in one layer object per model
           layer (``FusedLayerEP.layer``; the model calls it instead of dispatch / experts / combine, and
           its prefill chunks too); capturable.
"""

from __future__ import annotations

import torch

BACKEND_NAMES = ("sync", "sync-graphed", "padded", "dynamic", "fused", "fused-layer")
# Baselines (torch.distributed all_to_all_single), for the report's comparisons; the rest are moe-comm's.
BASELINE_NAMES = ("sync", "sync-graphed", "padded")


# ---- device-side layout helpers (no host reads) --------------------------------------------------

def positions_by_key(key: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key [N] int64 in [0, n_keys] (n_keys = "none") -> (pos [N] int64, counts [n_keys] int64).

    pos[i] = how many earlier rows have the same key (-1 for key n_keys): a stable grouping without a sort.
    """
    # [n_keys, N], scanned along its last dim: a GPU scans rows in parallel, while a scan down the columns
    # of [N, n_keys] runs each column serially (377 µs at N = 2048, 256 keys on an H100).
    onehot = key[None, :] == torch.arange(n_keys, device=key.device)[:, None]
    running = onehot.cumsum(1, dtype=torch.int32)
    pos = (running * onehot).sum(0, dtype=torch.int64) - 1
    return pos, onehot.sum(1)


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


class PairLayout:
    """Where each (token, k) pair of one rank goes. All tensors [T*K] (flattened row-major over [T, K]).

    valid: topk_idx >= 0; dest: owning rank (world if invalid); local_eid: expert index on dest;
    token: source row of x; pos: index among this rank's pairs to the same dest (token order);
    send_counts [world] int64: pairs per destination rank.
    """

    def __init__(self, topk_idx: torch.Tensor, experts_per_rank: int, world: int):
        flat = topk_idx.reshape(-1).long()
        self.T, self.K = topk_idx.shape
        self.valid = flat >= 0
        self.dest = torch.where(self.valid, flat.div(experts_per_rank, rounding_mode="floor"), world)
        self.local_eid = torch.where(self.valid, flat.remainder(experts_per_rank), -1)
        self.token = torch.arange(flat.numel(), device=flat.device).div(self.K, rounding_mode="floor")
        self.pos, self.send_counts = positions_by_key(self.dest, world)

    def send_slots(self, dest_stride: torch.Tensor | int, dump: int) -> torch.Tensor:
        """Row of each pair in a buffer grouped by destination (dest_stride: start of each dest), dump if invalid."""
        start = dest_stride[self.dest.clamp(max=len(dest_stride) - 1)] if torch.is_tensor(dest_stride) \
            else self.dest * dest_stride
        return torch.where(self.valid, start + self.pos, dump)


def scatter_to_experts(rows: torch.Tensor, local_eid: torch.Tensor, experts: int, rows_per_expert: int):
    """Received rows [N, H] with expert ids [N] (-1 = empty) -> (x_e [E, R, H], counts [E] int32, slot [N]).

    Rows keep their order within an expert. slot[i] = e*R + position of row i (E*R when empty).
    """
    key = torch.where(local_eid >= 0, local_eid, experts)
    pos, counts = positions_by_key(key, experts)
    dump = experts * rows_per_expert
    slot = torch.where(local_eid >= 0, key * rows_per_expert + pos, dump)
    buf = rows.new_empty(dump + 1, rows.shape[1])
    buf.index_copy_(0, slot, rows)
    return buf[:dump].view(experts, rows_per_expert, rows.shape[1]), counts.to(torch.int32), slot


def gather_rows(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """src [N, H]; index [M] (anything where not valid) -> [M, H] with zeros where not valid."""
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])
    return padded[torch.where(valid, index, src.shape[0])]


def weighted_sum(pair_rows: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pair_rows [T*K, H] (zeros for unrouted pairs), topk_weights [T, K] -> [T, H] dtype, float32 in k order."""
    t, k = topk_weights.shape
    rows = pair_rows.view(t, k, pair_rows.shape[1]).float()
    acc = torch.zeros(t, rows.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(k):
        acc = acc + topk_weights[:, j, None].float() * rows[:, j]
    return acc.to(dtype)


# ---- the interface ---------------------------------------------------------------------------------

class MoEComm:
    """One rank's MoE communication backend (see the module docstring for shapes)."""

    name = "?"
    capturable = False  # may be captured in a CUDA graph
    emulated = False    # True when the transport is emulated (loopback copies instead of the real library)

    def __init__(self, rank: int, world: int, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dtype: torch.dtype, device: torch.device):
        self.rank, self.world, self.hidden, self.topk, self.dtype = rank, world, hidden, topk, dtype
        self.num_experts, self.max_tokens, self.device = num_experts, max_tokens, torch.device(device)
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split over {world} ranks")
        self.experts_per_rank = num_experts // world
        self.rows_per_expert = world * max_tokens  # a token reaches an expert at most once
        self.capacity = max_tokens * min(topk, self.experts_per_rank)  # pairs one rank can send one peer

    def _check(self, x: torch.Tensor, topk_idx: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != self.dtype:
            raise ValueError(f"x must be [T, {self.hidden}] {self.dtype}, got {tuple(x.shape)} {x.dtype}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"T={x.shape[0]} tokens > max_tokens={self.max_tokens}")
        if tuple(topk_idx.shape) != (x.shape[0], self.topk):
            raise ValueError(f"topk_idx must be [{x.shape[0]}, {self.topk}], got {tuple(topk_idx.shape)}")

    @property
    def groups(self) -> tuple:
        """The moe-comm CommGroups this backend communicates over (checked and recovered by the engine)."""
        group = getattr(self, "group", None)
        return () if group is None else (group,)

    def dispatch(self, x, topk_idx, phase="both"):
        raise NotImplementedError

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        raise NotImplementedError

    def close(self) -> None:
        pass


# ---- transports of the torch.distributed baselines -------------------------------------------------

class DistExchange:
    """all_to_all_single on the default torch.distributed group (gloo on CPU, NCCL on GPU).

    ``post`` remembers the input; the matching ``fetch`` runs the collective (so only phase "both").
    """

    emulated = False

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self._posted = rank, world, {}

    def post(self, key, inp, in_splits=None):
        self._posted[key] = (inp, in_splits)

    def fetch(self, key, out_splits=None):
        import torch.distributed as dist  # noqa: PLC0415
        inp, in_splits = self._posted.pop(key)
        rows = inp.shape[0] if out_splits is None else sum(out_splits)
        out = inp.new_empty(rows, *inp.shape[1:])
        if dist.is_available() and dist.is_initialized():
            dist.all_to_all_single(out, inp, out_splits, in_splits)
        elif self.world == 1:  # one rank without a process group: the same device copy, no library call
            out.copy_(inp[:rows])
        else:
            raise RuntimeError("the sync/padded backends need torch.distributed initialised (moe_comm.init does)")
        return out


class LoopbackExchange:
    """Emulated all_to_all_single between the ranks of one process: ``post`` in the send phase leaves views
    of each destination's rows in a shared mailbox, ``fetch`` in the receive phase concatenates them."""

    emulated = True

    def __init__(self, rank: int, world: int, mailbox: dict):
        self.rank, self.world, self.mailbox = rank, world, mailbox

    @staticmethod
    def create_world(world: int) -> list["LoopbackExchange"]:
        box: dict = {}
        return [LoopbackExchange(r, world, box) for r in range(world)]

    def post(self, key, inp, in_splits=None):
        parts = inp.split(in_splits) if in_splits is not None else inp.chunk(self.world)
        self.mailbox.setdefault(key, [None] * self.world)[self.rank] = parts

    def fetch(self, key, out_splits=None):
        row = self.mailbox[key]
        return torch.cat([row[src][self.rank] for src in range(self.world)])


# ---- baselines -------------------------------------------------------------------------------------

class SyncAllToAll(MoEComm):
    """Counts exchanged and read on the host, then all_to_all_single with exact splits (eager only)."""

    name = "sync"

    def __init__(self, exchange, **kw):
        super().__init__(**kw)
        self.ex, self.emulated, self._state = exchange, exchange.emulated, None

    def dispatch(self, x, topk_idx, phase="both"):
        if phase in ("send", "both"):
            self._check(x, topk_idx)
            lay = PairLayout(topk_idx, self.experts_per_rank, self.world)
            send_splits = lay.send_counts.tolist()  # host sync: the cost this baseline exists to show
            n_send = sum(send_splits)
            slot = lay.send_slots(exclusive_cumsum(lay.send_counts), n_send)
            pair_of_row = torch.empty(n_send + 1, dtype=torch.int64, device=x.device)
            pair_of_row.index_copy_(0, slot, torch.arange(slot.numel(), device=x.device))
            pair_of_row = pair_of_row[:n_send]
            self.ex.post("counts", lay.send_counts)
            self.ex.post("rows", x[lay.token[pair_of_row]], send_splits)
            self.ex.post("eids", lay.local_eid[pair_of_row], send_splits)
            self._state = (lay, slot, send_splits, n_send)
            if phase == "send":
                return None
        lay, slot, send_splits, n_send = self._state
        recv_splits = self.ex.fetch("counts").tolist()  # host sync
        rows = self.ex.fetch("rows", recv_splits)
        eids = self.ex.fetch("eids", recv_splits)
        x_e, counts, recv_slot = scatter_to_experts(rows, eids, self.experts_per_rank, self.rows_per_expert)
        return x_e, counts, (lay, slot, send_splits, recv_splits, recv_slot, n_send)

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        lay, slot, send_splits, recv_splits, recv_slot, n_send = ctx
        if phase in ("send", "both"):
            back = y_e.reshape(-1, self.hidden)[recv_slot]
            self.ex.post("back", back, recv_splits)
            if phase == "send":
                return None
        out = self.ex.fetch("back", send_splits)
        return weighted_sum(gather_rows(out, slot, lay.valid), topk_weights, self.dtype)


class SyncGraphedAllToAll(MoEComm):
    """``sync``'s exchange (counts read on the host, all_to_all_single with exact splits), with every
    piece of device work outside the exchange graph-capturable.

    Each op is three pieces: the send phase (device only: layout, rows packed by destination into a
    fixed buffer), ``run_pending()`` (eager: split read, counts and rows exchanged into fixed receive
    buffers, tails marked empty) and the receive phase (device only, on the fixed buffers).
    ``piecewise.PiecewiseEngine`` captures the device pieces of a whole step as CUDA graphs and runs the
    eager pieces between them; with ``phase="both"`` (an unphased model) the three run in order. The
    eager piece reads nothing the send phase left on the host: everything it needs is in tensors that
    keep their addresses, so a replayed graph feeds it correctly. Receive-side shapes are fixed per
    bucket at world 1 (``T x min(K, E_local)`` rows) and at the largest bucket's otherwise.
    """

    name = "sync-graphed"
    piecewise = True  # device pieces capturable, split by eager exchanges (not capturable as one graph)

    def __init__(self, exchange, **kw):
        super().__init__(**kw)
        self.ex, self.emulated = exchange, exchange.emulated
        self.pairs_per_token = min(self.topk, self.experts_per_rank)
        n_send, n_recv = self.max_tokens * self.topk, self.world * self.capacity
        dev = self.device
        # Fixed buffers the eager exchange reads and writes (one set: a step's ops run one at a time);
        # the send buffers have one spare row where unrouted pairs are dumped.
        self.send_rows = torch.empty(n_send + 1, self.hidden, dtype=self.dtype, device=dev)
        self.send_eids = torch.empty(n_send + 1, dtype=torch.int64, device=dev)
        self.send_counts = torch.zeros(self.world, dtype=torch.int64, device=dev)
        self.recv_rows = torch.zeros(n_recv, self.hidden, dtype=self.dtype, device=dev)
        self.recv_eids = torch.full((n_recv,), -1, dtype=torch.int64, device=dev)
        self.back_send = torch.empty(n_recv, self.hidden, dtype=self.dtype, device=dev)
        self.back_recv = torch.zeros(n_send, self.hidden, dtype=self.dtype, device=dev)
        self._pending = None
        self._splits: dict = {}  # host splits of the last dispatch exchange, for its combine exchange

    def _recv_rows(self, tokens: int) -> int:
        return self.world * (tokens if self.world == 1 else self.max_tokens) * self.pairs_per_token

    # ---- the eager pieces -------------------------------------------------------------------------
    def take_pending(self):
        """The exchange the last send phase left, or None; cleared. A callable returning a generator
        (eager; reads the host; yields between its posts and fetches).
        ``PiecewiseEngine`` records it once per captured step and calls it at every replay."""
        pending, self._pending = self._pending, None
        return pending

    def run_pending(self) -> None:
        """Run the pending exchange to its end (one rank per process: ``phase="both"``)."""
        pending = self.take_pending()
        if pending is not None:
            for _ in pending():
                pass

    def _direct(self) -> bool:
        """True when the collective can write straight into the fixed buffers (torch.distributed)."""
        import torch.distributed as dist  # noqa: PLC0415
        return isinstance(self.ex, DistExchange) and dist.is_available() and dist.is_initialized()

    def _dispatch_exchange(self, n_recv: int):
        """Generator: yields after each post, so that on a loopback world every rank posts before any
        rank fetches (``model.drive_lockstep`` drives the ranks' exchanges)."""
        send_splits = self.send_counts.tolist()  # host sync
        self.ex.post("counts", self.send_counts)
        yield
        recv_splits = self.ex.fetch("counts").tolist()  # host sync
        n_send, total = sum(send_splits), sum(recv_splits)
        if total > n_recv:
            raise RuntimeError(f"received {total} rows > {n_recv} receive rows (capacity)")
        if self._direct():
            import torch.distributed as dist  # noqa: PLC0415
            dist.all_to_all_single(self.recv_rows[:total], self.send_rows[:n_send], recv_splits, send_splits)
            dist.all_to_all_single(self.recv_eids[:total], self.send_eids[:n_send], recv_splits, send_splits)
        else:
            self.ex.post("rows", self.send_rows[:n_send], send_splits)
            self.ex.post("eids", self.send_eids[:n_send], send_splits)
            yield
            self.recv_rows[:total].copy_(self.ex.fetch("rows", recv_splits))
            self.recv_eids[:total].copy_(self.ex.fetch("eids", recv_splits))
        self.recv_eids[total:n_recv].fill_(-1)
        self._splits = dict(send=send_splits, recv=recv_splits)

    def _combine_exchange(self):
        """Generator, like ``_dispatch_exchange``; the splits are the dispatch's (no host read)."""
        send_splits, recv_splits = self._splits["send"], self._splits["recv"]
        n_back, n_out = sum(recv_splits), sum(send_splits)
        if self._direct():
            import torch.distributed as dist  # noqa: PLC0415
            dist.all_to_all_single(self.back_recv[:n_out], self.back_send[:n_back], send_splits, recv_splits)
            return
        self.ex.post("back", self.back_send[:n_back], recv_splits)
        yield
        self.back_recv[:n_out].copy_(self.ex.fetch("back", send_splits))

    # ---- the device pieces ------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, phase="both"):
        if phase in ("send", "both"):
            self._check(x, topk_idx)
            t = x.shape[0]
            lay = PairLayout(topk_idx, self.experts_per_rank, self.world)
            n = lay.valid.numel()
            slot = lay.send_slots(exclusive_cumsum(lay.send_counts), n)  # grouped by destination; n = dump
            self.send_rows[:n + 1].index_copy_(0, slot, x[lay.token])
            self.send_eids[:n + 1].index_copy_(0, slot, lay.local_eid)
            self.send_counts.copy_(lay.send_counts)
            self._state = (lay, slot, t)
            n_recv = self._recv_rows(t)
            self._pending = lambda: self._dispatch_exchange(n_recv)  # a fresh generator per call
            if phase == "send":
                return None
            self.run_pending()
        lay, slot, t = self._state
        n_recv = self._recv_rows(t)
        x_e, counts, recv_slot = scatter_to_experts(self.recv_rows[:n_recv], self.recv_eids[:n_recv],
                                                    self.experts_per_rank, self.rows_per_expert)
        return x_e, counts, (lay, slot, recv_slot, n_recv)

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        lay, slot, recv_slot, n_recv = ctx
        if phase in ("send", "both"):
            flat = y_e.reshape(-1, self.hidden)
            torch.index_select(flat, 0, recv_slot.clamp(max=flat.shape[0] - 1), out=self.back_send[:n_recv])
            self._pending = self._combine_exchange
            if phase == "send":
                return None
            self.run_pending()
        n = lay.valid.numel()
        return weighted_sum(gather_rows(self.back_recv[:n], slot, lay.valid), topk_weights, self.dtype)


class PaddedAllToAll(MoEComm):
    """all_to_all_single with every split padded to the capacity: fixed shapes, capturable, more bytes."""

    name = "padded"
    capturable = True

    def __init__(self, exchange, **kw):
        super().__init__(**kw)
        self.ex, self.emulated, self._state = exchange, exchange.emulated, None
        self.pairs_per_token = min(self.topk, self.experts_per_rank)  # pairs one token sends one peer

    def bucket_capacity(self, tokens: int) -> int:
        """Rows per peer for a call with ``tokens`` tokens: the bucket's own at world 1; at world > 1
        the largest bucket's, since every rank must send and receive the same padded sizes and this
        engine's ranks choose their buckets independently."""
        return (tokens if self.world == 1 else self.max_tokens) * self.pairs_per_token

    def dispatch(self, x, topk_idx, phase="both"):
        world = self.world
        if phase in ("send", "both"):
            self._check(x, topk_idx)
            cap = self.bucket_capacity(x.shape[0])
            lay = PairLayout(topk_idx, self.experts_per_rank, world)
            slot = lay.send_slots(cap, world * cap)
            send = x.new_empty(world * cap + 1, self.hidden)
            send.index_copy_(0, slot, x[lay.token])
            eids = torch.full((world * cap + 1,), -1, dtype=torch.int64, device=x.device)
            eids.index_copy_(0, slot, lay.local_eid)
            self.ex.post("rows", send[:-1])
            self.ex.post("eids", eids[:-1])
            self._state = (lay, slot)
            if phase == "send":
                return None
        lay, slot = self._state
        rows, eids = self.ex.fetch("rows"), self.ex.fetch("eids")
        x_e, counts, recv_slot = scatter_to_experts(rows, eids, self.experts_per_rank, self.rows_per_expert)
        return x_e, counts, (lay, slot, recv_slot)

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        lay, slot, recv_slot = ctx
        if phase in ("send", "both"):
            flat = y_e.reshape(-1, self.hidden)
            self.ex.post("back", flat[recv_slot.clamp(max=flat.shape[0] - 1)])  # empty slots: ignored garbage
            if phase == "send":
                return None
        out = self.ex.fetch("back")
        return weighted_sum(gather_rows(out, slot, lay.valid), topk_weights, self.dtype)


# ---- ours --------------------------------------------------------------------------------------------

class DynamicAllToAll(MoEComm):
    """moe_comm.AllToAllvDynamic + local permute; counts never leave the device.

    Each sent row is [x | local expert id]: the int32 id rides in the last 4 bytes of the row (bit-copied,
    the a2a moves raw words), so one a2a per direction carries both.
    """

    name = "dynamic"
    capturable = True

    def __init__(self, group, **kw):
        from ..alltoallv import AllToAllvDynamic  # noqa: PLC0415
        super().__init__(**kw)
        self.group = group
        self.emulated = group.backend == "loopback" and group.world_size > 1
        self.id_cols = 4 // torch.empty((), dtype=self.dtype).element_size()
        self.width = self.hidden + self.id_cols
        self.a2a = AllToAllvDynamic(group, self.capacity, (self.width,), self.dtype)
        self._state = None

    def dispatch(self, x, topk_idx, phase="both"):
        if phase in ("send", "both"):
            self._check(x, topk_idx)
            lay = PairLayout(topk_idx, self.experts_per_rank, self.world)
            n = lay.valid.numel()
            slot = lay.send_slots(exclusive_cumsum(lay.send_counts), n)
            send = x.new_empty(n + 1, self.width)
            ids = lay.local_eid.to(torch.int32)[:, None].view(self.dtype)  # [n, id_cols]
            # Scatter into the two column ranges (strided views): no concatenated copy of the rows.
            send[:, :self.hidden].index_copy_(0, slot, x[lay.token])
            send[:, self.hidden:].index_copy_(0, slot, ids)
            self.a2a(send[:n], lay.send_counts, phase="send")
            self._state = (lay, slot)
            if phase == "send":
                return None
        lay, slot = self._state
        res = self.a2a(phase="recv")
        recv = res.recv.view(-1, self.width)  # [world*cap, width]
        live = (torch.arange(self.capacity, device=recv.device)[None, :] < res.recv_counts[:, None]).reshape(-1)
        eids = torch.where(live, recv[:, self.hidden:].contiguous().view(torch.int32)[:, 0].long(), -1)
        x_e, counts, recv_slot = scatter_to_experts(recv[:, :self.hidden], eids, self.experts_per_rank,
                                                    self.rows_per_expert)
        return x_e, counts, (lay, slot, recv_slot, res.handle)

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        lay, slot, recv_slot, handle = ctx
        if phase in ("send", "both"):
            flat = y_e.reshape(-1, self.hidden)
            rows = y_e.new_empty(self.world * self.capacity, self.width)
            # Gather straight into the row columns (index_select takes a strided out): one copy, not two.
            torch.index_select(flat, 0, recv_slot.clamp(max=flat.shape[0] - 1), out=rows[:, :self.hidden])
            self.a2a.combine(rows.view(self.world, self.capacity, self.width), handle, phase="send")
            if phase == "send":
                return None
        back = self.a2a.combine(phase="recv")[:, :self.hidden]  # [T*K, H] in send order
        return weighted_sum(gather_rows(back, slot, lay.valid), topk_weights, self.dtype)

    def close(self) -> None:
        self.a2a.close()


class PrefillEP:
    """moe_comm.PrefillBuffer for an engine's prefill steps (eager): the high-throughput op, while the
    decode steps keep their MoEComm. Same phases as a MoEComm (``phase="send" | "recv" | "both"``):

        d = prefill.dispatch(x, topk_idx, topk_weights)   # x [T, H]; topk_idx [T, K] int64 (-1 = not routed);
                                                          # topk_weights [T, K] float32 -> PrefillDispatchResult
        y = prefill.combine(partial, d.handle)            # partial [world * max_tokens, H] dtype: each received
                                                          # row's local experts, weighted and summed -> [T, H]
    ``model.standard_experts`` computes ``partial`` from ``d``. y[t] sums the ranks' partial rows of token t
    in ascending rank order (``PrefillBuffer.combine``).
    """

    name = "prefill"

    def __init__(self, group, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype):
        from ..prefill import PrefillBuffer  # noqa: PLC0415
        self.group = group
        self.buf = PrefillBuffer(group, num_experts, hidden, max_tokens, topk, dtype=dtype)

    @property
    def groups(self) -> tuple:
        return (self.group,)

    def dispatch(self, x, topk_idx, topk_weights, phase="both"):
        return self.buf.dispatch(phase="recv") if phase == "recv" else \
            self.buf.dispatch(x, topk_idx, topk_weights, phase=phase)

    def combine(self, partial, handle, phase="both"):
        return self.buf.combine(phase="recv") if phase == "recv" else self.buf.combine(partial, handle, phase=phase)

    def close(self) -> None:
        self.buf.close()


class FusedEP(MoEComm):
    """moe_comm.EPBuffer: fused dispatch (one row per token per destination) and weighted combine; its
    ``prefill`` (a PrefillEP on the same group, None on groups that reach a peer by puts) is what the
    model's prefill steps use."""

    name = "fused"
    capturable = True

    def __init__(self, group, **kw):
        from ..ep import EPBuffer  # noqa: PLC0415
        super().__init__(**kw)
        self.group = group
        self.emulated = group.backend == "loopback" and group.world_size > 1
        self.ep = EPBuffer(group, self.num_experts, self.hidden, self.max_tokens, self.topk, dtype=self.dtype)
        # Groups that reach a peer by puts (another node) have no PrefillBuffer: their prefill stays on the EPBuffer.
        self.prefill = None if group.uses_put else PrefillEP(group, self.num_experts, self.hidden, self.max_tokens,
                                                               self.topk, self.dtype)

    def dispatch(self, x, topk_idx, phase="both"):
        if phase != "recv":
            self._check(x, topk_idx)
        d = self.ep.dispatch(phase="recv") if phase == "recv" else self.ep.dispatch(x, topk_idx, phase=phase)
        return None if d is None else (d.x, d.counts, d.handle)

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        if phase == "recv":
            return self.ep.combine(phase="recv")
        return self.ep.combine(y_e, topk_weights, ctx, phase=phase)

    def close(self) -> None:
        self.ep.close()
        if self.prefill is not None:
            self.prefill.close()


class FusedLayerEP(MoEComm):
    """moe_comm.MoELayer, one per model layer: the model hands it the whole routed-expert part of a layer
    (``fuses_experts``): ``comm.layer(lw)(h, topk_idx, topk_weights, phase=...)`` with phases "send",
    "experts", "recv" (or "both"). The layer's weights are the rank's experts of ``lw`` (expert_gate,
    expert_up [E_local, H, I], expert_down [E_local, I, H]) in the layer's layout (w13 [E_local, 2I, H],
    w2 [E_local, H, I]), copied once when the layer is made. Layers are made in model order, the same on
    every rank (their buffers are collective)."""

    name = "fused-layer"
    capturable = True
    fuses_experts = True
    prefill = None   # prefill chunks go through the layer too (T <= max_tokens)

    def __init__(self, group, **kw):
        super().__init__(**kw)
        self.group = group
        self.emulated = group.backend == "loopback" and group.world_size > 1
        self._layers = {}   # id(LayerWeights) -> (its weights, the MoELayer)

    def layer(self, lw):
        """The MoELayer of model layer ``lw`` (made at first use)."""
        from ..moe_layer import MoELayer  # noqa: PLC0415
        hit = self._layers.get(id(lw))
        if hit is None or hit[0] is not lw:
            w13 = torch.cat([lw.expert_gate.transpose(1, 2), lw.expert_up.transpose(1, 2)], dim=1).contiguous()
            w2 = lw.expert_down.transpose(1, 2).contiguous()
            layer = MoELayer(self.group, self.num_experts, self.hidden, w2.shape[2], self.max_tokens, self.topk,
                             w13, w2, dtype=self.dtype)
            hit = self._layers[id(lw)] = (lw, layer)
        return hit[1]

    def dispatch(self, x, topk_idx, phase="both"):
        raise NotImplementedError("the fused-layer backend runs the whole routed-expert part: use comm.layer(lw)")

    combine = dispatch

    def close(self) -> None:
        for _, layer in self._layers.values():
            layer.close()


# ---- one rank of an EP-N deployment on one device ------------------------------------------------------

class EmulatedPeers(MoEComm):
    """One rank of an EP-N world, alone: ``inner`` is a world-1 backend over this rank's E/N experts.

    The router still picks among all E experts. Every peer is emulated as this rank's mirror: what this
    rank sends peer p comes back as peer p's contribution to this rank (the same rows, the same local
    expert index), staged in local memory. So this rank receives, in expectation, the T*K rows a real
    rank of EP-N receives, runs its E/N experts on them and combines them, with every backend's own
    dispatch/combine code; what is missing is the link (``moe_comm.scale_model`` models it) and, for
    dynamic/fused, the multi-rank kernels' extra landing-zone pass (they run their world-1 path).
    Global expert e is computed by local expert e mod E/N: ``tiled_reference_weights`` builds the
    matching reference. The inner backend holds up to T*K rows per local expert (a token may map two
    of its experts to one local expert).
    """

    def __init__(self, inner: MoEComm, emulated_world: int, num_experts: int):
        self.inner, self.name = inner, inner.name
        self.rank, self.world, self.hidden, self.topk = 0, emulated_world, inner.hidden, inner.topk
        self.dtype, self.device, self.num_experts = inner.dtype, inner.device, num_experts
        self.experts_per_rank = inner.num_experts
        if self.experts_per_rank * emulated_world != num_experts:
            raise ValueError(f"{num_experts} experts do not split into {emulated_world} x {inner.num_experts}")
        self.max_tokens = inner.max_tokens // inner.topk
        self.capturable = inner.capturable
        self.piecewise = getattr(inner, "piecewise", False)
        self.fuses_experts = getattr(inner, "fuses_experts", False)
        self.emulated = True

    @property
    def groups(self) -> tuple:
        return self.inner.groups

    def _local(self, topk_idx):
        return torch.where(topk_idx >= 0, topk_idx.remainder(self.experts_per_rank), -1)

    def dispatch(self, x, topk_idx, phase="both"):
        if phase == "recv":
            return self.inner.dispatch(None, None, phase="recv")
        return self.inner.dispatch(x, self._local(topk_idx), phase=phase)

    def combine(self, y_e, topk_weights, ctx, phase="both"):
        return self.inner.combine(y_e, topk_weights, ctx, phase=phase)

    def take_pending(self):
        return self.inner.take_pending() if self.piecewise else None

    def layer(self, lw):
        """A fused-layer inner backend's layer, called with the ids mapped to the local experts."""
        inner = self.inner.layer(lw)

        def call(x=None, topk_idx=None, topk_weights=None, **kw):
            return inner(x, None if topk_idx is None else self._local(topk_idx), topk_weights, **kw)
        return call

    def close(self) -> None:
        self.inner.close()


class _TiledExperts:
    """expert weights indexed by global id e -> local[e mod E_local] (views; for the reference only)."""

    def __init__(self, local: torch.Tensor, num_experts: int):
        self.local, self.num_experts = local, num_experts

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.local[int(e) % self.local.shape[0]]


def tiled_reference_weights(share, num_experts: int):
    """The reference weights of an ``EmulatedPeers`` rank: ``share`` (a ModelWeights holding experts
    [0, E/N)) with every global expert e computed by local expert e mod E/N."""
    from dataclasses import replace  # noqa: PLC0415
    if share.expert_lo != 0:
        raise ValueError("the emulated rank holds experts [0, E/N)")
    layers = [replace(lw, expert_gate=_TiledExperts(lw.expert_gate, num_experts),
                      expert_up=_TiledExperts(lw.expert_up, num_experts),
                      expert_down=_TiledExperts(lw.expert_down, num_experts)) for lw in share.layers]
    return replace(share, layers=layers, expert_lo=0, expert_hi=num_experts)


# ---- factory -----------------------------------------------------------------------------------------

def make_comms(name: str, groups: list, cfg, max_tokens: int, emulate_ep: int = 0) -> list[MoEComm]:
    """One backend object per rank of ``groups`` (one CommGroup in a process-per-rank world, or every
    loopback group of a one-process world, built in rank order).

    emulate_ep = N > 0: ``groups`` is one world-1 group and the backend is one rank of EP-N
    (``EmulatedPeers`` around a world-1 backend over cfg.num_experts / N experts)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; choose from {BACKEND_NAMES}")
    if emulate_ep:
        import dataclasses  # noqa: PLC0415
        if len(groups) != 1 or groups[0].world_size != 1:
            raise ValueError("--emulate-ep runs one rank on one device: a world-1 group")
        local = dataclasses.replace(cfg, num_experts=cfg.experts_per_rank(emulate_ep))
        (inner,) = make_comms(name, groups, local, max_tokens * cfg.topk)
        if hasattr(inner, "pairs_per_token"):  # two of a token's experts may share a local expert
            inner.pairs_per_token = cfg.topk
        return [EmulatedPeers(inner, emulate_ep, cfg.num_experts)]
    g0 = groups[0]
    world = g0.world_size
    loopback = g0.backend == "loopback" and world > 1
    exchanges = LoopbackExchange.create_world(world) if loopback else [DistExchange(g.rank, world) for g in groups]
    out = []
    for g, ex in zip(groups, exchanges):
        kw = dict(rank=g.rank, world=world, num_experts=cfg.num_experts, hidden=cfg.hidden,
                  max_tokens=max_tokens, topk=cfg.topk, dtype=cfg.dtype, device=g.device)
        if name == "sync":
            out.append(SyncAllToAll(ex, **kw))
        elif name == "sync-graphed":
            out.append(SyncGraphedAllToAll(ex, **kw))
        elif name == "padded":
            out.append(PaddedAllToAll(ex, **kw))
        elif name == "dynamic":
            out.append(DynamicAllToAll(g, **kw))
        elif name == "fused-layer":
            out.append(FusedLayerEP(g, **kw))
        else:
            out.append(FusedEP(g, **kw))
    return out
