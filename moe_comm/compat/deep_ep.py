"""DeepEP's API over moe-comm: code written for DeepEP runs by changing one import. The low-latency mode
runs on EPBuffers, the normal (high-throughput) mode on a PrefillBuffer.

    from moe_comm.compat import deep_ep          # instead of: import deep_ep

    buffer = deep_ep.Buffer(group, num_nvl_bytes=0, low_latency_mode=True, num_qps_per_rank=num_local_experts,
                            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, W, E))
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=True)
    y, event, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

Shapes, dtypes and layouts are DeepEP's (W ranks, M = num_max_dispatch_tokens_per_rank, E experts,
L = E // W local experts, R = W * M, H hidden):

low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=None, *, use_fp8=True, ...)
    x         [T, H] bfloat16 on the group's device, T <= M
    topk_idx  [T, K] int64 (``topk_idx_t``; int32 accepted): expert ids, -1 = slot not routed
    returns (recv_x, recv_count, handle, event, hook):
    recv_x    [L, R, H] bfloat16, or with use_fp8 a tuple (data [L, R, H] float8_e4m3fn, scales [L, R, S]
              whose last two dimensions are column-major, strides (S * R, 1, R)); data * scale per 128
              columns ~= x. Scales: float32 S = H/128 (amax / 448; with round_scale=True powers of two), or
              with use_ue8m0=True (needs round_scale=True, H % 512 == 0) int32 S = H/512, the exponents of
              the power-of-two scales as UE8M0 bytes, four per int32 (``moe_comm.formats``). Rows
              recv_x[e, :recv_count[e]] are valid.
    recv_count  int32 [L]: rows received per local expert (one per (token, k) routed to it)
    handle    tuple (src_info int32 [L, R], layout_range int64 [L, W], M, H, E): src_info = the row's token
              index on its source rank; layout_range[e, j] = (first row << 32) | rows of source rank j
    cumulative_local_expert_recv_stats  optional int32 [L], incremented by recv_count
low_latency_combine(x, topk_idx, topk_weights, handle, *, zero_copy=False, async_finish=False,
                    return_recv_hook=False, out=None)
    x             [L, R, H] bfloat16: row i of expert e answers recv_x[e, i] (rows past recv_count unread)
    topk_weights  [T, K] float32;  out: optional [T, H] bfloat16, written in place and returned
    returns (combined_x [T, H] bfloat16, event, hook): combined_x[t] = sum over the token's routed slots k,
    ascending, of topk_weights[t, k] * its expert's row, in float32, then rounded (bitwise reproducible).

Normal mode (``num_nvl_bytes`` is the budget of its PrefillBuffers, one per (H, E, K, input format). The
first call of an (H, E, K) fixes its capacity M, tokens per rank per call, for every input format: the
largest whose ``Buffer.get_normal_size_hint`` (a buffer of each input format ``normal_input_formats(H)``
takes: bf16 and the fp8 tuples H allows) fits in what is left, reserved then; each format's buffer is
allocated at its own first call. So one Buffer serves bf16 and fp8 input alike, as DeepEP's does; a call
with more tokens raises ValueError naming the size to ask. ``previous_event`` (an EventOverlap): the
caller's stream waits on its event before the call's kernels). Intranode and internode alike: on a
group whose ranks span nodes (peers reached by NVSHMEM puts; on the CPU, emulated nodes) the PrefillBuffer
sends each token once per destination node and forwards it inside the node (docs/prefill.md "Across
nodes"), the normal mode's internode path; ``internode_dispatch`` / ``internode_combine`` are the same
calls, as DeepEP's ``dispatch`` / ``combine`` call them on such a group:

get_dispatch_layout(topk_idx, E, ...) -> (num_tokens_per_rank int32 [W], num_tokens_per_rdma_rank int32
    [N] (tokens with an expert on each node; None on one node), num_tokens_per_expert int32 [E],
    is_token_in_rank bool [T, W], event), computed on the device.
dispatch(x, num_tokens_per_rank=, is_token_in_rank=, num_tokens_per_expert=, topk_idx=, topk_weights=,
         expert_alignment=1, num_worst_tokens=0, ...) -> (recv_x, recv_topk_idx, recv_topk_weights,
         num_recv_tokens_per_expert_list, handle, event)
    x           [T, H] bfloat16, T <= M, or pre-quantized fp8 as DeepEP takes it: a tuple (data [T, H]
                float8_e4m3fn, scales) with float32 scales [T, H/128] (any strides; power-of-two values
                too) or int32 [T, H/512] packed UE8M0 scales (SGLang's DeepGEMM UE8M0 path). The data
                and scales are copied as they are: no dequantization, no requantization, no check of
                the values. topk_idx [T, K] int64 (int32 accepted), -1 = not routed; topk_weights [T, K]
                float32 or None
    recv_x      [N, H] bfloat16 (or, for fp8 input, the tuple (data [N, H] float8_e4m3fn, scales [N, S]
                as given, row-major)): every token with at least one expert on this rank, once, ordered
                by (source rank, token index) as DeepEP's intranode kernels order them (N read on the
                host, as DeepEP's normal mode reads it)
    recv_topk_idx  int64 [N, K]: local expert ids, -1 where the slot's expert is elsewhere
    recv_topk_weights  float32 [N, K] (0 where the id is -1), or None without topk_weights
    num_recv_tokens_per_expert_list  list of L ints: slots per local expert, rounded up to expert_alignment
    handle      a ``NormalHandle`` (opaque; DeepEP's is a tuple of layout tensors)
    num_worst_tokens > 0: DeepEP's fixed-size receive for CUDA graphs: N = num_worst_tokens, nothing is
                read on the host; rows past the received count have recv_topk_idx -1 and weights 0
                (recv_x rows there are unspecified), and num_recv_tokens_per_expert_list is [] (as in
                DeepEP). A rank that receives more rows than num_worst_tokens keeps the first ones and
                CapacityError is raised (at once on CPU, else at the next check: never silent).
    The layout arguments are checked for presence only: the PrefillBuffer routes from topk_idx.
combine(x, handle, ...) -> (combined_x [T, H] bfloat16, None, event)
    x           [N, H] bfloat16: row i answers recv_x[i] (the token's local experts, weighted and summed;
                rows past the received count of a fixed-size receive are not read)
    combined_x[t] = sum over the ranks holding one of token t's experts, ascending, of their rows for t, in
    float32, rounded once (bitwise reproducible; DeepEP sums unweighted too, in its own order). Across
    nodes each other node's share is summed on that node first and rounded to bf16 once
    (``reference.prefill_combine(..., ranks_per_node=G)``), as DeepEP's internode combine reduces in its
    forwarder.

Where the normal mode does not map (NotImplementedError, naming the reason): a cached dispatch
(``handle=``: one PrefillBuffer dispatch is answered by one combine, no layout is kept to replay), a
dispatch without ``topk_idx`` (DeepEP's ``with_topk=False``, which routes by ``is_token_in_rank`` alone:
the PrefillBuffer routes from the ids), fp8 scales of other layouts than the two above, ``topk_weights``
and ``bias`` in combine (reducing per-slot weights back is DeepEP's backward pass), and a loopback group
of several ranks (the normal API has no receive hook to run phases). Every dispatch must be answered by
its combine before the next normal-mode dispatch with the same sizes and format (RuntimeError otherwise).

Low-latency hooks (``return_recv_hook=True``): the call runs the op's send phase and returns at once;
``hook()`` runs its receive phase (for low_latency_dispatch also its handle's layout) and must be called exactly once before the
results are read. On a loopback group of several ranks (one process holds every rank) hooks are required:
call every rank's dispatch, then every rank's hook. ``async_finish=True`` returns an ``EventOverlap``
recorded on the current stream.

Differences from DeepEP (none is silent: an unsupported argument raises NotImplementedError):

- Both modes work on every Buffer; ``low_latency_mode`` (default True, DeepEP's is False) is stored only.
  ``use_logfmt=True``, ``allow_nvlink_for_low_latency_mode=False``,
  ``allow_mnnvl=True``, ``comm=`` (mpi4py), ``get_comm_stream`` and ``get_local_buffer_tensor`` raise
  NotImplementedError.
- ``group``: a moe_comm ``CommGroup`` (any backend), or torch.distributed's default (world) group, for
  which one CommGroup per process is made with ``moe_comm.init("auto")`` (NVSHMEM heap on CUDA, shared
  memory on CPU) and shared by every Buffer. Subgroups are not supported.
- ``num_rdma_bytes`` is a budget for the symmetric memory of the buffers this Buffer creates (one pair per (M,
  H, E, K, format), format = bf16 or one of the fp8 scale formats, made at the first call that uses it); a
  call that would exceed it raises ValueError. ``get_low_latency_rdma_size_hint`` is moe-comm's own figure:
  bf16 and one fp8 format (any of the three), top-k up to 11 (DeepEP's limit); a Buffer that dispatches in
  several fp8 formats needs the hint's fp8 share once more per format. ``num_qps_per_rank`` is checked and has
  no effect (peers are reached by load/store, there are no RDMA queue pairs). ``clean_low_latency_buffer``
  checks its arguments and does nothing (flags carry call numbers: nothing needs zeroing).
- ``recv_x`` (the fp8 data included) is not allocated per call: it is the buffer's receive tensor,
  valid until two more dispatches with the same sizes and format have received (two buffers
  alternate); ``.clone()`` it to keep it longer. recv_count, the fp8 scales and the handle's tensors are
  per call, as in DeepEP. A handle is valid for combine until four more such dispatches.
- Row order: each expert's rows are sorted by (source rank, token index), a special case of DeepEP's
  layout (within a source rank's run DeepEP's order is arbitrary).
- fp8: DeepEP's formulas operation for operation, so the same codes and scales: per 128 columns amax =
  max(max |x|, 1e-4); data = e4m3(x * (448 / amax)), scale = amax * (1 / 448); with round_scale=True
  e = ceil(log2(amax * (1 / 448))), data = e4m3(x * 2**-e), scale = 2**e (use_ue8m0=True: its exponent
  byte e + 127, packed four per int32 in DeepEP's byte order); each step one float32 rounding
  (``moe_comm.formats``, ``reference.quantize_fp8``, ``triton_kernels/quant.py``). Any H with H % 128 == 0
  (DeepEP needs H % 512 for fp8), H % 512 == 0 with use_ue8m0; bf16 any even H. ``use_ue8m0`` without
  ``round_scale``, or either without ``use_fp8``, raises ValueError before anything is sent (DeepEP asserts
  the first and ignores the second).
- combine: the slots combined are those routed at dispatch; ``topk_idx`` is only checked for shape
  (DeepEP re-reads it). The rank's own share of ``x`` is read in place by the receive phase: keep ``x``
  unchanged until the hook has run. ``zero_copy=True`` reads the tensor of
  ``get_next_low_latency_combine_buffer(handle)`` instead of ``x`` (it saves no copy here: the op always
  reads expert outputs in place).
- Streams: kernels run on the caller's current stream (there is no communication stream), so
  ``async_finish`` overlaps nothing; the event is still valid to wait on. On CPU calls complete before
  returning.
- ``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` (int64 [W]): incremented by the
  time this rank's receive waited for each source rank's data, in **nanoseconds** (DeepEP: clock cycles),
  from the flight recorder's wait statistics (``EPBuffer.dispatch_wait_stats``); they need the recorder
  on (``MOE_COMM_TRACE=1`` or ``init(trace=...)``), else ValueError.
- Arguments after ``cumulative_local_expert_recv_stats`` (dispatch) and after ``handle`` (combine) are
  keyword-only: DeepEP's positional order differs between its versions.
- Errors follow moe-comm's fault model: an expert id outside [-1, E) is not routed and raises
  InvalidIndexError (a ValueError) at the end of the call; a dead peer raises CommTimeoutError after
  the group's timeout (DeepEP: undefined / hang). Input errors that this module finds itself (the
  statistics tensor, ``topk_idx``'s shape at combine, unsupported arguments) raise before the op is
  entered, as in DeepEP; make every rank pass the same arguments.
- Rank masking (``enable_shrink=True``; without it the three methods raise RuntimeError, as DeepEP
  asserts) is moe-comm's exclusion (``CommGroup.exclude``): ``low_latency_update_mask_buffer(r, True)``
  excludes rank r, after which no kernel sends to or waits for it and the slots routed to its experts are
  dropped (combine sums the token's other experts; both modes, the exclusion is the group's);
  ``low_latency_query_mask_buffer(mask)`` writes int32 [W] 1 = masked, on the device. DeepEP masks a rank
  inside the kernel that timed out on it and returns that call's data without the rank's; here that call
  raises CommTimeoutError naming the rank (its outputs are not exact: never silent), and the caller masks
  it: ``update_mask_buffer`` is collective over the survivors (every live rank masks the same rank, as
  each has timed out on it), then the next calls are exact among them. A masked rank cannot be unmasked
  (``mask=False``, ``low_latency_clean_mask_buffer`` with a rank masked: NotImplementedError): an
  excluded rank never rejoins a moe-comm group.
"""

from __future__ import annotations

import torch

from .. import phased
from .. import formats
from ..checks import check_tensor
from ..ep import EPBuffer
from ..errors import MoECommError, op_id
from ..group import CommGroup
from ..interpreter import kernel_for
from ..planner import plan_ep
from ..prefill import PrefillBuffer
from ..topology import node_layout
from ..triton_kernels.capacity import check_capacity_kernel
from . import deep_ep_layout as layout

topk_idx_t = torch.int64          # DeepEP's expert-id dtype (int32 is accepted too)
HINT_MAX_TOPK = 11                # DeepEP's low-latency kernels take at most 11 experts per token
BUFFERS_PER_FORMAT = 2            # EPBuffers alternating per (shapes, format): recv_x of two calls stay valid
DTYPE = torch.bfloat16            # DeepEP's token dtype (low-latency and normal mode)
NORMAL_MAX_TOKENS = 1 << 20       # the largest normal-mode capacity (tokens per rank) a budget can buy

_shared_group: CommGroup | None = None   # the CommGroup made for torch.distributed's default group


def _unsupported(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"moe_comm.compat.deep_ep: {what} is not supported; {instead}")


def low_latency_format(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> str | None:
    """The EPBuffer format (``moe_comm.formats``) of DeepEP's three low-latency flags; ValueError for the
    combinations DeepEP rejects (use_ue8m0 without round_scale) or ignores (either without use_fp8)."""
    if not use_fp8:
        if round_scale or use_ue8m0:
            raise ValueError("round_scale / use_ue8m0 shape fp8 scales, but use_fp8=False dispatches bfloat16: pass "
                             "use_fp8=True, or drop round_scale and use_ue8m0")
        return None
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 holds power-of-two scales only, as DeepEP "
                         "asserts): pass round_scale=True too")
    return formats.E4M3_UE8M0 if use_ue8m0 else formats.E4M3_POW2 if round_scale else formats.E4M3


def normal_input_formats(hidden: int) -> tuple:
    """The PrefillBuffer dispatch formats of the normal mode's inputs at ``hidden``: None (bfloat16 x), and
    DeepEP's pre-quantized tuples the hidden allows (float32 scales per 128 columns: "e4m3"; packed UE8M0
    int32 per 512: "e4m3-ue8m0")."""
    return (None,) + tuple(f for f in (formats.E4M3, formats.E4M3_UE8M0) if hidden % formats.hidden_multiple(f) == 0)


def _check_int(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def _comm_group(group, comm) -> CommGroup:
    """The CommGroup behind DeepEP's ``group`` argument (see the module docstring)."""
    global _shared_group
    if comm is not None:
        raise _unsupported("comm= (an mpi4py communicator)", "pass a torch.distributed ProcessGroup or a "
                           "moe_comm CommGroup as group")
    if isinstance(group, CommGroup):
        return group
    import torch.distributed as dist  # noqa: PLC0415
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or a moe_comm CommGroup, got "
                        f"{type(group).__name__}")
    if group.size() != dist.get_world_size() or group.rank() != dist.get_rank():
        raise _unsupported("a torch.distributed subgroup", "pass the default (world) group, or a moe_comm "
                           "CommGroup built for the ranks that take part")
    if _shared_group is None or _shared_group.closed:
        from ..group import init  # noqa: PLC0415
        _shared_group = init("auto")
    return _shared_group


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, or ``with event:`` (waits on exit).

    ``event`` is a ``torch.cuda.Event`` recorded on the stream the op ran on, or None: on CPU (the op
    completed before returning) and for calls made without ``async_finish``.
    """

    def __init__(self, event=None, extra_tensors=None, valid: bool | None = None):
        self.event, self.extra_tensors = event, extra_tensors
        self._valid = event is not None if valid is None else valid

    def current_stream_wait(self) -> None:
        if not self._valid:
            raise RuntimeError("this EventOverlap holds no event: the call was made without async_finish=True")
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._valid:
            self.current_stream_wait()


def _event_after(device: torch.device, tensors) -> EventOverlap:
    """An EventOverlap marking the end of the work just queued on ``device``'s current stream."""
    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return EventOverlap(ev, tensors)
    return EventOverlap(None, tensors, valid=True)


def _wait_previous(previous_event) -> None:
    """DeepEP's ``previous_event``: the work it marks comes before this call's kernels. They run on the
    caller's current stream, so that stream waits on its CUDA event (an EventOverlap made without
    ``async_finish``, or on CPU, holds none: nothing to wait for, its work is ordered or done)."""
    if previous_event is None:
        return
    if not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap (from a call with async_finish=True, or "
                        f"Buffer.capture()), got {type(previous_event).__name__}")
    if previous_event.event is not None:
        previous_event.current_stream_wait()


class _Hook:
    """DeepEP's receive hook: runs a receive phase, once."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is None:
            raise RuntimeError("this receive hook has already run (each hook runs its receive phase once)")
        fn()


class LowLatencyHandle(tuple):
    """DeepEP's dispatch handle: the tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts), plus what ``low_latency_combine`` needs from the EPBuffer dispatch."""

    def __new__(cls, items, owner, ep: EPBuffer, num_tokens: int, topk: int):
        h = super().__new__(cls, items)
        h.owner, h.ep, h.num_tokens, h.topk = owner, ep, num_tokens, topk
        h.ep_handle = None   # EPBuffer's handle, once the dispatch's receive phase has run
        return h


class Config:
    """DeepEP's performance-tuning config of the normal mode (SMs, chunk sizes): kept for API compatibility,
    accepted and unused (the PrefillBuffer plans its own launch shapes)."""

    def __init__(self, num_sms: int = 20, *tuning):
        self.num_sms, self.tuning = num_sms, tuning


class NormalHandle:
    """The handle of a normal-mode dispatch (opaque, unlike DeepEP's tuple of layout tensors): what
    ``combine`` needs. Valid for one combine, before the next normal-mode dispatch with the same sizes and
    format."""

    def __init__(self, owner, buf: PrefillBuffer, recv: layout.PackedReceive, num_tokens: int):
        self.owner, self.buf, self.recv, self.num_tokens = owner, buf, recv, num_tokens


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` in low-latency mode (see the module docstring for the differences).

    Collective like DeepEP's: every rank builds its Buffer and makes the same calls in the same order
    (on a loopback group: one Buffer per rank, built in rank order).
    """

    num_sms: int = 20   # DeepEP's SM count for its normal-mode kernels (kept for API compatibility)

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = True,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None):
        if not allow_nvlink_for_low_latency_mode:
            raise _unsupported("allow_nvlink_for_low_latency_mode=False", "peers on the same node are always "
                               "reached by load/store")
        if allow_mnnvl:
            raise _unsupported("allow_mnnvl=True", "pass False")
        self.num_rdma_bytes = _check_int("num_rdma_bytes", num_rdma_bytes, 0)
        self.num_nvl_bytes = _check_int("num_nvl_bytes", num_nvl_bytes, 0)
        self.num_qps_per_rank = _check_int("num_qps_per_rank", num_qps_per_rank, 1)
        self.comm_group = _comm_group(group, comm)
        self.group = group
        self.rank, self.group_size = self.comm_group.rank, self.comm_group.world_size
        self.low_latency_mode = bool(low_latency_mode)
        self.enable_shrink = bool(enable_shrink)   # the rank-mask methods are available (as in DeepEP)
        self.explicitly_destroy = bool(explicitly_destroy)
        self._pairs: dict[tuple, list] = {}     # (M, H, E, K, format) -> [EPBuffers, calls]
        self._prefill: dict[tuple, PrefillBuffer] = {}   # (H, E, K, format) -> the normal mode's buffer
        self._normal_tokens: dict[tuple, int] = {}       # (H, E, K) -> its capacity, shared by every input format
        self._nvl_bytes_used = 0                         # num_nvl_bytes reserved by those capacities
        self._staging: dict[int, torch.Tensor] = {}   # id(EPBuffer) -> zero-copy combine input
        self._symmetric_bytes = 0
        self._destroyed = False

    # ---- sizes -----------------------------------------------------------------------------------
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Symmetric bytes a Buffer needs for low-latency calls with these sizes, bf16 and (when hidden %
        128 == 0) one fp8 format (the largest: float32 scales; packed UE8M0 needs less), up to 11 experts
        per token. Pass it as ``num_rdma_bytes``."""
        M = _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        H = _check_int("hidden", hidden, 1)
        W = _check_int("num_ranks", num_ranks, 1)
        E = _check_int("num_experts", num_experts, 1)
        _check_divisible(E, W)
        fmts = (None, formats.E4M3) if H % formats.FP8_GROUP == 0 else (None,)
        return sum(BUFFERS_PER_FORMAT * plan_ep(W, E, H, M, HINT_MAX_TOPK, DTYPE, False, "cpu", fmt).symmetric_bytes
                   for fmt in fmts)

    @property
    def symmetric_bytes(self) -> int:
        """Symmetric bytes of the buffers made so far (counted against ``num_rdma_bytes``)."""
        return self._symmetric_bytes

    def _ep_for(self, M: int, hidden: int, E: int, topk: int, fmt: str | None) -> EPBuffer:
        """The EPBuffer for the next call with these sizes and format: two alternate, each made on first use."""
        key = (M, hidden, E, topk, fmt)
        pair = self._pairs.get(key)
        if pair is None:   # checks first: a refused format leaves nothing behind
            formats.check_hidden(fmt, hidden)
            pair = self._pairs[key] = [[], 0]
        bufs, calls = pair
        slot = calls % BUFFERS_PER_FORMAT
        if slot == len(bufs):
            ep = EPBuffer(self.comm_group, E, hidden, M, topk, dtype=DTYPE, dispatch_format=fmt)
            need = ep.plan.symmetric_bytes
            if self._symmetric_bytes + need > self.num_rdma_bytes:
                hint = self.get_low_latency_rdma_size_hint(M, hidden, self.group_size, E)
                raise ValueError(
                    f"num_rdma_bytes={self.num_rdma_bytes} is too small: this call (M={M}, hidden={hidden}, "
                    f"num_experts={E}, topk={topk}, format {fmt or 'bf16'}) needs {need} more symmetric bytes on "
                    f"top of the {self._symmetric_bytes} in use; build the Buffer with num_rdma_bytes="
                    f"Buffer.get_low_latency_rdma_size_hint({M}, {hidden}, {self.group_size}, {E}) (= {hint})"
                    + ("" if topk <= HINT_MAX_TOPK else f" or more: the hint assumes topk <= {HINT_MAX_TOPK}"))
            self._symmetric_bytes += need
            bufs.append(ep)
        pair[1] += 1
        return bufs[slot]

    def _check_wait_cost(self, name: str, cost) -> None:
        """A ``*_wait_recv_cost_stats`` tensor: int64 [W] on the group's device, recorder on."""
        if cost is None:
            return
        check_tensor(name, cost, self.comm_group.device, (torch.int64,), (self.group_size,))
        if not self.comm_group.trace_calls:
            raise ValueError(f"{name} comes from the flight recorder's wait statistics: turn it on with "
                             f"MOE_COMM_TRACE=1 (or moe_comm.init(..., trace=True)) before the group is made")

    def _check_call(self, async_finish: bool, return_recv_hook: bool) -> None:
        """Checks every call makes first (the same on every rank: nothing is launched before them)."""
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as in DeepEP)")
        g = self.comm_group
        if g.backend == "loopback" and g.world_size > 1 and not return_recv_hook:
            raise ValueError("a loopback group holds every rank in one process: pass return_recv_hook=True, "
                             "make this call on every rank, then call every rank's hook")

    # ---- dispatch --------------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None, *,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """Send each token to the ranks of its experts; returns (recv_x, recv_count, handle, event, hook)
        (module docstring)."""
        fmt = low_latency_format(use_fp8, round_scale, use_ue8m0)
        self._check_call(async_finish, return_recv_hook)
        M = _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        E = _check_int("num_experts", num_experts, 1)
        W, dev = self.group_size, self.comm_group.device
        _check_divisible(E, W)
        L, R = E // W, W * M
        for name, t in (("x", x), ("topk_idx", topk_idx)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        hidden, topk = int(x.shape[1]), int(topk_idx.shape[1])
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", stats, dev, (torch.int32,), (L,))
        self._check_wait_cost("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        fp8 = fmt is not None
        ep = self._ep_for(M, hidden, E, topk, fmt)
        add_wait_cost = _wait_cost_adder(dispatch_wait_recv_cost_stats, lambda: ep.dispatch_wait_stats)

        recv_count = torch.empty(L, dtype=torch.int32, device=dev)
        src_info = torch.empty((L, R), dtype=torch.int32, device=dev)
        layout_range = torch.empty((L, W), dtype=torch.int64, device=dev)
        scales = (layout.empty_column_major_scales(L, R, ep.plan.scale_words, dev, ep.plan.scale_dtype) if fp8
                  else None)
        handle = LowLatencyHandle((src_info, layout_range, M, hidden, E), self, ep, int(x.shape[0]), topk)

        def finish(d) -> None:
            # Made at the send, written here (the hook may run on another stream): recorded for this one.
            phased.record_for_current_stream((recv_count, src_info, layout_range, scales), dev)
            recv_count.copy_(d.counts)
            layout.src_info(d.src, M, out=src_info)
            layout.layout_range(d.src, d.counts, M, W, out=layout_range)
            if scales is not None:
                layout.column_major_scales(d.scales, out=scales)
            if stats is not None:
                stats.add_(d.counts)
            add_wait_cost()
            handle.ep_handle = d.handle

        def outputs(hook):
            recv_x = _receive_tensor(ep)
            recv = (recv_x, scales) if fp8 else recv_x
            event = (_event_after(dev, (x, topk_idx, recv_x, recv_count, src_info, layout_range))
                     if async_finish else EventOverlap())
            return recv, recv_count, handle, event, hook

        if return_recv_hook:
            ep.dispatch(x, topk_idx, phase="send")
            return outputs(_Hook(lambda: _completed(lambda: ep.dispatch(phase="recv"), finish)))
        _completed(lambda: ep.dispatch(x, topk_idx), finish, lambda: outputs(None))
        return outputs(None)

    # ---- combine ---------------------------------------------------------------------------------
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, *, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, combine_wait_recv_cost_stats=None):
        """Return expert outputs to their tokens, weighted and reduced; returns (combined_x, event, hook)
        (module docstring)."""
        if use_logfmt:
            raise _unsupported("use_logfmt=True", "the combine sends bfloat16")
        self._check_call(async_finish, return_recv_hook)
        self._check_wait_cost("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        if not isinstance(handle, LowLatencyHandle) or handle.owner is not self:
            raise TypeError("handle must come from low_latency_dispatch on this Buffer")
        if handle.ep_handle is None:
            raise RuntimeError("the dispatch of this handle has not received yet: call its hook first")
        ep, T = handle.ep, handle.num_tokens
        if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != (T, handle.topk):
            raise ValueError(f"topk_idx must be the dispatch's [{T}, {handle.topk}] tensor, got "
                             f"{getattr(topk_idx, 'shape', type(topk_idx).__name__)}")
        if zero_copy:
            x = self._staging.get(id(ep))
            if x is None:
                raise RuntimeError("zero_copy=True reads the tensor of get_next_low_latency_combine_buffer(handle): "
                                   "fill it first")
        dev = self.comm_group.device
        add_wait_cost = _wait_cost_adder(combine_wait_recv_cost_stats, lambda: ep.combine_wait_stats)

        def receive():
            y = ep.combine(phase="recv")
            add_wait_cost()
            return y

        if return_recv_hook:
            if out is None:
                out = torch.empty((T, ep.hidden), dtype=DTYPE, device=dev)
            ep.combine(x, topk_weights, handle.ep_handle, out=out, phase="send")
            return out, EventOverlap(), _Hook(receive)
        ep.combine(x, topk_weights, handle.ep_handle, out=out, phase="send")
        combined = receive()
        event = _event_after(dev, (x, topk_idx, topk_weights, combined)) if async_finish else EventOverlap()
        return combined, event, None

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """bfloat16 [L, R, H]: fill it with the expert outputs, then call ``low_latency_combine(...,
        zero_copy=True)`` (one such tensor per internal buffer, made on first use)."""
        self._check_call(False, True)
        if not isinstance(handle, LowLatencyHandle) or handle.owner is not self:
            raise TypeError("handle must come from low_latency_dispatch on this Buffer")
        ep = handle.ep
        t = self._staging.get(id(ep))
        if t is None:
            t = self._staging[id(ep)] = torch.zeros(
                (ep.num_local_experts, self.group_size * ep.max_tokens_per_rank, ep.hidden), dtype=DTYPE,
                device=self.comm_group.device)
        return t

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Checks its arguments; nothing to clean (flags carry call numbers, never reset between calls)."""
        self._check_call(False, True)
        _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        _check_int("hidden", hidden, 1)
        _check_divisible(_check_int("num_experts", num_experts, 1), self.group_size)

    # ---- lifetime and misc -----------------------------------------------------------------------
    def destroy(self) -> None:
        """Free the symmetric buffers (collective). As in DeepEP, only for ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a Buffer built with explicitly_destroy=True (as in DeepEP)")
        self._check_call(False, True)
        for bufs, _ in self._pairs.values():
            for ep in bufs:
                ep.close()
        for buf in self._prefill.values():
            buf.close()
        self._pairs.clear()
        self._prefill.clear()
        self._staging.clear()
        self._destroyed = True

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap on the current stream (CUDA), or a completed one (CPU)."""
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return _event_after(dev, None)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count of its normal-mode kernels: stored (``Buffer.num_sms``), used by nothing here."""
        if _check_int("new_num_sms", new_num_sms, 2) % 2:
            raise ValueError("the SM count must be even (as in DeepEP)")
        Buffer.num_sms = new_num_sms

    # ---- normal (high-throughput) mode: PrefillBuffer --------------------------------------------
    @staticmethod
    def get_normal_size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                             num_topk: int, ranks_per_node: int | None = None) -> int:
        """``num_nvl_bytes`` that buys the normal mode a capacity of ``num_max_tokens_per_rank`` tokens per
        rank per call at these sizes in every input format it takes (``normal_input_formats``: bf16, and
        the fp8 tuples ``hidden`` allows), one PrefillBuffer each; ``ranks_per_node``: G of a group
        spanning nodes. moe-comm's own figure (DeepEP sizes its normal-mode ring from chunk configs)."""
        M = _check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        W, E = _check_int("num_ranks", num_ranks, 1), _check_int("num_experts", num_experts, 1)
        _check_divisible(E, W)
        return sum(PrefillBuffer.required_bytes(W, E, hidden, M, num_topk, DTYPE, dispatch_format=fmt,
                                                ranks_per_node=ranks_per_node)
                   for fmt in normal_input_formats(hidden))

    def _prefill_for(self, hidden: int, num_experts: int, topk: int, fmt: str | None = None) -> PrefillBuffer:
        """The PrefillBuffer of the normal-mode calls with these sizes and input format (None: bf16; an fp8
        format for pre-quantized input), made at its first call with the capacity of its sizes
        (``_normal_capacity``: shared by every input format). The same on every rank (same arguments, same
        order), as the buffer is collective."""
        key = (hidden, num_experts, topk, fmt)
        if key not in self._prefill:
            M = self._normal_capacity(hidden, num_experts, topk)
            self._prefill[key] = PrefillBuffer(self.comm_group, num_experts, hidden, M, topk, dtype=DTYPE,
                                               dispatch_format=fmt)
        return self._prefill[key]

    def _normal_capacity(self, hidden: int, num_experts: int, topk: int) -> int:
        """Tokens per rank per call of the normal mode at these sizes, fixed at the first call with them: the
        largest M whose ``get_normal_size_hint`` (a buffer of every input format at M) fits in what is left
        of ``num_nvl_bytes``, reserved then, so that one Buffer serves bf16 and fp8 input alike, as DeepEP's
        one buffer does (each format's buffer is allocated at its own first call)."""
        shape = (hidden, num_experts, topk)
        if shape not in self._normal_tokens:
            W, left, G = self.group_size, self.num_nvl_bytes - self._nvl_bytes_used, _ranks_per_node(self.comm_group)

            def need(m):
                return self.get_normal_size_hint(m, hidden, W, num_experts, topk, G)
            if need(1) > left:
                raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for DeepEP's normal mode with "
                                 f"hidden={hidden}, num_experts={num_experts}, topk={topk}: {need(1)} bytes hold one "
                                 f"token per rank in each input format ({self._nvl_bytes_used} in use by the "
                                 f"buffers of other sizes); size it with deep_ep.Buffer.get_normal_size_hint("
                                 f"tokens_per_rank, {hidden}, {W}, {num_experts}, {topk}"
                                 + ("" if G is None else f", ranks_per_node={G}") + ")")
            lo, hi = 1, 2
            while hi < NORMAL_MAX_TOKENS and need(hi) <= left:
                lo, hi = hi, hi * 2
            while hi - lo > 1:   # need(lo) fits, need(hi) does not (or hi is the cap)
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if need(mid) <= left else (lo, mid)
            self._normal_tokens[shape] = lo
            self._nvl_bytes_used += need(lo)
        return self._normal_tokens[shape]

    def _check_normal_call(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")
        g = self.comm_group
        if g.backend == "loopback" and g.world_size > 1:
            raise _unsupported("DeepEP's normal mode on a loopback group of several ranks (one process holds "
                               "every rank, and the normal API has no receive hook to run the phases)",
                               "use one process per rank (moe_comm.launch, torchrun), or moe_comm.PrefillBuffer "
                               "with phase='send' / 'recv'")

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's layout of a dispatch, computed on the device from ``topk_idx`` [T, K] (-1 = not routed):
        (num_tokens_per_rank int32 [W]: tokens with an expert on each rank, None (no RDMA ranks: one
        node), num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W], event). ``dispatch`` routes
        from ``topk_idx`` itself: these are informational, as DeepEP's callers use them."""
        self._check_normal_call()
        E, W = _check_int("num_experts", num_experts, 1), self.group_size
        _check_divisible(E, W)
        check_tensor("topk_idx", topk_idx, self.comm_group.device, (torch.int32, torch.int64), (None, None))
        _wait_previous(previous_event)
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = layout.dispatch_layout(topk_idx, E, W)
        g = _ranks_per_node(self.comm_group)
        per_node = None if g is None else layout.tokens_per_node(is_token_in_rank, g)
        event = (_event_after(self.comm_group.device, (topk_idx,)) if async_finish else EventOverlap())
        return num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's normal-mode dispatch on a PrefillBuffer; returns (recv_x, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event) (module docstring)."""
        self._check_normal_call()
        _wait_previous(previous_event)   # the caller's stream waits for it; nothing is launched before
        if handle is not None:
            raise _unsupported("a cached dispatch (handle=)", "every PrefillBuffer dispatch is answered by its "
                               "combine before the next one, so a layout is not kept to be replayed: dispatch "
                               "with topk_idx again")
        if topk_idx is None:
            raise _unsupported("a dispatch without topk_idx (DeepEP's with_topk=False, routed by is_token_in_rank "
                               "alone)", "pass topk_idx (and topk_weights): the PrefillBuffer routes every token "
                               "from its expert ids")
        if num_tokens_per_expert is None:
            raise ValueError("a non-cached dispatch needs num_tokens_per_expert (from get_dispatch_layout), as in "
                             "DeepEP")
        worst = _check_int("num_worst_tokens", num_worst_tokens, 0)
        align = _check_int("expert_alignment", expert_alignment, 1)
        E = int(num_tokens_per_expert.shape[0])
        _check_divisible(E, self.group_size)
        dev = self.comm_group.device
        data, fmt = self._normal_input(x)
        check_tensor("topk_idx", topk_idx, dev, (torch.int32, torch.int64), (data.shape[0], None))
        T, hidden, topk = int(data.shape[0]), int(data.shape[1]), int(topk_idx.shape[1])
        buf = self._prefill_for(hidden, E, topk, fmt)
        if T > buf.max_tokens_per_rank:
            raise ValueError(f"{T} tokens: this Buffer's normal mode holds {buf.max_tokens_per_rank} tokens per rank "
                             f"per call at hidden={hidden}, num_experts={E}, topk={topk} within num_nvl_bytes="
                             f"{self.num_nvl_bytes}; raise num_nvl_bytes to deep_ep.Buffer.get_normal_size_hint("
                             f"{T}, {hidden}, {self.group_size}, {E}, {topk}"
                             + ("" if _ranks_per_node(self.comm_group) is None
                                else f", ranks_per_node={_ranks_per_node(self.comm_group)}")
                             + ") or more, or dispatch in chunks")
        weights = (torch.zeros(topk_idx.shape, dtype=torch.float32, device=dev) if topk_weights is None
                   else topk_weights)
        recv = layout.PackedReceive(buf.dispatch(x, topk_idx, weights), align, worst)  # N read on the host unless worst
        recv_x = recv.x if recv.scales is None else (recv.x, recv.scales)
        recv_weights = None if topk_weights is None else recv.topk_weights
        h = NormalHandle(self, buf, recv, T)
        event = _event_after(dev, (data, recv.x)) if async_finish else EventOverlap()
        outputs = (recv_x, recv.topk_idx, recv_weights, recv.counts, h, event)
        if worst:
            self._check_worst(recv, worst, outputs)
        return outputs

    def _normal_input(self, x) -> tuple[torch.Tensor, str | None]:
        """(the tokens' data tensor, the PrefillBuffer format) of a normal-mode ``x``: bfloat16 [T, H], or
        DeepEP's pre-quantized tuple (float8_e4m3fn [T, H], scales): float32 [T, H/128] -> "e4m3" (any
        values, power-of-two ones included: they are copied as they are), int32 [T, H/512] -> packed
        "e4m3-ue8m0". Raises before anything is sent otherwise, naming what is taken."""
        dev = self.comm_group.device
        if not isinstance(x, tuple):
            check_tensor("x", x, dev, (DTYPE,), (None, None))
            return x, None
        if len(x) != 2:
            raise ValueError(f"pre-quantized x is DeepEP's tuple (data, scales), got a tuple of {len(x)}")
        data, scales = x
        check_tensor("x[0] (the fp8 data)", data, dev, (torch.float8_e4m3fn,), (None, None))
        T, H = data.shape
        takes = (f"float32 [{T}, {H} // 128] scales (one per 128 columns) or int32 [{T}, {H} // 512] packed UE8M0 "
                 f"scales (four per int32, as DeepEP's use_ue8m0)")
        if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or scales.shape[0] != T:
            raise ValueError(f"x[1] (the scales) must be a 2-D tensor with a row per token: {takes}, got "
                             f"{getattr(scales, 'dtype', type(scales).__name__)} {tuple(getattr(scales, 'shape', ()))}")
        for fmt in normal_input_formats(H)[1:]:
            if scales.dtype == formats.scale_dtype(fmt) and scales.shape[1] == formats.scale_columns(fmt, H):
                check_tensor("x[1] (the scales)", scales, dev, (scales.dtype,), None)
                return data, fmt
        raise ValueError(f"x[1] (the scales) is {scales.dtype} {tuple(scales.shape)}; the normal mode takes {takes} "
                         f"(other scale layouts: dispatch bfloat16 x, or quantize with moe_comm.reference."
                         f"quantize_fp8)")

    def _check_worst(self, recv: layout.PackedReceive, worst: int, outputs) -> None:
        """A fixed-size receive keeps the first ``worst`` rows: record CapacityError when more arrived (on
        the device; on CPU, where reading is free, raised here with the call's outputs as its result)."""
        g = self.comm_group
        kernel_for(check_capacity_kernel, g.device)[(1,)](recv.received, g.state, g.rank, worst,
                                                           OP=op_id("deep_ep.dispatch"))
        if g.device.type == "cpu":
            try:
                g.check()
            except MoECommError as e:
                e.result = e.call_result = outputs
                raise

    def combine(self, x: torch.Tensor, handle: "NormalHandle", topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's normal-mode combine: sums every rank's row of a token at the token's rank, unweighted;
        returns (combined_x [T, hidden] bfloat16, None, event) (module docstring)."""
        self._check_normal_call()
        if not isinstance(handle, NormalHandle) or handle.owner is not self:
            raise TypeError("handle must come from dispatch (normal mode) on this Buffer")
        if topk_weights is not None:
            raise _unsupported("topk_weights in combine (per-slot weights reduced back to their tokens, DeepEP's "
                               "backward pass)", "pass None: the forward combine needs no weights")
        if bias is not None:
            raise _unsupported("bias in combine", "add the bias to the combined output")
        check_tensor("x", x, self.comm_group.device, (DTYPE,), (handle.recv.x.shape[0], handle.buf.hidden))
        _wait_previous(previous_event)
        y = handle.recv.combine(handle.buf, x)
        event = _event_after(self.comm_group.device, (x, y)) if async_finish else EventOverlap()
        return y, None, event

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, config=None, previous_event=None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """DeepEP's internode dispatch (what its ``dispatch`` calls on a group spanning nodes): ``dispatch``,
        which sends across nodes once per node on such a group (module docstring)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, 0, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: "NormalHandle", topk_weights=None, bias=None,
                          config=None, previous_event=None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """DeepEP's internode combine: ``combine`` (module docstring)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> "Config":
        """A ``Config`` (accepted by dispatch/combine and unused: the PrefillBuffer plans its own launches)."""
        return Config(Buffer.num_sms)

    get_combine_config = get_dispatch_config

    # ---- rank masking (shrink mode): moe-comm's exclusion ---------------------------------------------
    def _check_shrink(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")
        if not self.enable_shrink:
            raise RuntimeError("the rank mask needs a Buffer built with enable_shrink=True (as DeepEP asserts)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask ``rank_to_mask`` (``mask=True``): ``CommGroup.exclude([rank_to_mask])``, so no kernel sends
        to or waits for it and the slots routed to its experts are dropped (low-latency and normal mode
        alike: the exclusion is the group's). Collective over the survivors: every live rank masks the same
        rank (DeepEP's mask is per rank; after a rank dies every survivor has timed out on it and masks it).
        Masking a masked rank does nothing. Unmasking (``mask=False``) a masked rank is refused: an excluded
        rank never rejoins a moe-comm group (build a new group and Buffer with it); unmasking a live rank
        does nothing."""
        self._check_shrink()
        r = _check_int("rank_to_mask", rank_to_mask, 0)
        if r >= self.group_size:
            raise ValueError(f"rank_to_mask={r} is not a rank of this group of {self.group_size}")
        live = r in self.comm_group.live_ranks
        if mask and live:
            self.comm_group.exclude([r])
        elif not mask and not live:
            raise _unsupported(f"unmasking rank {r}", "an excluded rank never rejoins a moe-comm group: build a new "
                               "group and Buffer over the ranks to serve with")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into ``mask_status`` (int32 [num_ranks] on the group's device): 1 for each masked
        (excluded) rank, 0 for each live one. Read on the device (``CommGroup.excluded_mask``), no host read."""
        self._check_shrink()
        check_tensor("mask_status", mask_status, self.comm_group.device, (torch.int32,), (self.group_size,))
        self.comm_group.excluded_mask(out=mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank: nothing to do while none is masked; refused once one is (see
        ``low_latency_update_mask_buffer``)."""
        self._check_shrink()
        gone = sorted(set(range(self.group_size)) - set(self.comm_group.live_ranks))
        if gone:
            raise _unsupported(f"unmasking ranks {gone}", "an excluded rank never rejoins a moe-comm group: build a "
                               "new group and Buffer over the ranks to serve with")

    def get_comm_stream(self):
        raise _unsupported("get_comm_stream()", "kernels run on the caller's current stream")

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise _unsupported("get_local_buffer_tensor()", "the symmetric buffers are internal to moe_comm.EPBuffer")


def _ranks_per_node(group: CommGroup) -> int | None:
    """G of a group whose ranks span nodes (some peers reached by puts), None on one node."""
    if not group.uses_put or group.world_size == 1:
        return None
    return node_layout(group.transports, group.rank).ranks_per_node


def _check_divisible(num_experts: int, num_ranks: int) -> None:
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the {num_ranks} ranks (each rank owns "
                         f"num_experts // num_ranks experts): use a multiple of {num_ranks}, e.g. "
                         f"{-(-num_experts // num_ranks) * num_ranks} with experts that no token selects")


def _receive_tensor(ep: EPBuffer) -> torch.Tensor:
    """The EPBuffer's receive tensor d.x ([L, R, H]; fixed for its life, allocated by its first dispatch)."""
    return ep._x


def _wait_cost_adder(cost, wait_stats):
    """What adds this call's waits (ns per source: row 0 of the op's live ``wait_stats()`` after the
    receive minus now) to the caller's ``cost``; a no-op without ``cost``. Device ops only."""
    if cost is None:
        return lambda: None
    before = wait_stats()[0].clone()
    return lambda: cost.add_(wait_stats()[0] - before)


def _completed(call, finish, outputs=None) -> None:
    """Run an EPBuffer receive ``call`` and ``finish(DispatchResult)``. A data error raised at the end of
    the op carries this call's result (``err.call_result``): it is finished too, and the error then
    carries the DeepEP-style outputs (``outputs()``) instead, as ``err.result`` too if this call
    recorded it (else ``err.result`` is None: an earlier call's, already returned)."""
    try:
        d = call()
    except MoECommError as e:
        if e.call_result is None:
            raise
        finish(e.call_result)
        mine = e.result is e.call_result
        e.call_result = outputs() if outputs is not None else None
        e.result = e.call_result if mine else None
        raise
    finish(d)
