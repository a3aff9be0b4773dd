"""Host-side planning: capacities, buffer layouts and launch shapes, from static sizes only.

Nothing here reads a device value: every size follows from the capacities the caller declared
(``max_rows_per_peer``, ``max_tokens_per_rank``, ...), so plans are fixed for the life of a buffer and
every launch is capturable in a CUDA graph.

The launch shapes follow the device: wide grids on CUDA, few wide programs for the CPU interpreter.
``MOE_COMM_LAUNCH_SHAPES=gpu`` plans CPU launches with the CUDA shapes too (a test setting: the interpreter
then runs the multi-program grids a GPU would, slowly; see docs/testing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import os

import torch

from . import formats
from .formats import FP8_GROUP, NVFP4_GROUP, fp8_row_words
from .protocol import VEC_BYTES


def channel_done_words(world: int) -> int:
    """int32 words of a Channel's arrival counters ``done`` (``moe_comm/channel.py``): one per destination,
    the send total, the receive, the receive's entry (flight recorder)."""
    return world + 3


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


STAGE_ZONES = 2   # zones of a channel's put staging (call % 2): reused by causality (triton_kernels/transport.py)


def stage_ctrl_shape(world: int, ctrl_words: int) -> tuple:
    """int64 [zones, world, ctrl_words]: a channel's staged control words with puts (``channel.py``)."""
    return (STAGE_ZONES, world, ctrl_words)


def stage_ctrl_bytes(world: int, ctrl_words: int) -> int:
    return 8 * math.prod(stage_ctrl_shape(world, ctrl_words))


def channel_counter_bytes(world: int) -> int:
    """Bytes of one Channel's counters: send and receive counts (int64 each) and ``done``."""
    return 8 + 8 + 4 * channel_done_words(world)


SHAPES_ENV = "MOE_COMM_LAUNCH_SHAPES"
SHAPES = ("auto", "gpu")   # auto: by the device; gpu: CUDA launch shapes on every device

# GPU launch shape: enough programs per peer to keep many SMs busy on large payloads.
GPU_TARGET_PROGRAMS = 132
# 16 KB per copy iteration (32 words per thread at 4 warps): a 14 KB DeepSeek-V3 row in one step
# instead of four dependent 4 KB ones (the same reasoning as GPU_EP_COPY_WORDS below).
GPU_BLOCK_BYTES = 16384
GPU_TILE_ELEMS = 1024  # elements of one register tile (8 per thread at 4 warps)
# The interpreter's largest tile: Triton refuses a tensor of more elements (TRITON_MAX_TENSOR_NUMEL).
CPU_MAX_TILE_ELEMS = 1 << 20

def gpu_shapes(device) -> bool:
    """Plan ``device``'s launches with the CUDA shapes: on CUDA, or everywhere when SHAPES_ENV is 'gpu'."""
    mode = os.environ.get(SHAPES_ENV, "auto").strip().lower() or "auto"
    if mode not in SHAPES:
        raise ValueError(f"{SHAPES_ENV}={os.environ[SHAPES_ENV]!r} is not valid: set it to one of "
                         f"{', '.join(SHAPES)} (or unset it)")
    return mode == "gpu" or torch.device(device).type == "cuda"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CopyPlan:
    """How a phase kernel moves rows: payload rows are copied as raw words (the dtype does not matter)."""

    word_dtype: torch.dtype  # rows are viewed as words of this type; row bytes are a multiple of its size
    row_words: int           # words per row
    block_rows: int          # rows per program iteration
    block_words: int         # words per program iteration along a row
    blocks_per_peer: int     # programs per peer in each phase's grid (grid = world x blocks_per_peer)

    @property
    def vector_rows(self) -> bool:
        """Rows are whole 16-byte vectors (32-bit words, a multiple of 4 per row)."""
        return self.word_dtype == torch.int32 and self.row_words % 4 == 0


def vector_aligned(*tensors) -> bool:
    """True when every tensor's first byte is 16-byte aligned (torch's allocations are; a view that
    starts mid-row may not be); None entries (absent optional buffers) are skipped. With row lengths
    multiples of 16 bytes this lets the copy loops declare 16-byte accesses (their ``ALIGNED``
    constexpr); otherwise they move narrower words, still exact."""
    for t in tensors:   # a loop, not all(...) over a generator: this runs at every launch
        if t is not None and t.data_ptr() % VEC_BYTES:
            return False
    return True


def plan_copy(row_bytes: int, max_rows: int, world: int, device: torch.device) -> CopyPlan:
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8
    row_words = row_bytes // elem_size(word)
    if gpu_shapes(device):
        block_words = min(next_pow2(row_words), GPU_BLOCK_BYTES // elem_size(word))
        block_rows = 1 if row_words >= block_words else max(1, min(16, block_words // next_pow2(row_words)))
        blocks_needed = math.ceil(max_rows / block_rows)
        blocks_per_peer = max(1, min(blocks_needed, GPU_TARGET_PROGRAMS // max(1, world)))
    else:
        # The interpreter pays per program and per op, not per element: few, wide programs.
        block_words = min(next_pow2(row_words), 4096)
        block_rows = min(next_pow2(max_rows), max(1, 8192 // block_words))
        blocks_per_peer = 1
    return CopyPlan(word, row_words, block_rows, block_words, blocks_per_peer)


@dataclass(frozen=True)
class AllToAllvPlan:
    """Buffers of one AllToAllvDynamic (forward and reverse channel each have their own)."""

    world: int
    max_rows_per_peer: int
    row_shape: tuple
    dtype: torch.dtype
    copy: CopyPlan
    # Symmetric landing zone per channel: words [2 zones, world source ranks, max_rows_per_peer, row_words].
    # Zone = call sequence number % 2, so call i+1 never lands on rows call i is still reading.
    data_shape: tuple
    # Symmetric control words per channel: int64 [2 zones, world source ranks, 2] = (row count, flag).
    ctrl_shape: tuple
    # Put transport (``group.uses_put``): each channel also holds its staging, shaped as its landing zone
    # (two zones, call % 2, reused by causality: ``triton_kernels/transport.py``) and staged control words.
    put: bool = False

    def buffer_layout(self) -> dict:
        """What sizes the buffers allocated from this plan: every field but the copy's launch shapes."""
        return dict(world=self.world, max_rows_per_peer=self.max_rows_per_peer, row_shape=self.row_shape,
                    dtype=self.dtype, word_dtype=self.copy.word_dtype, row_words=self.copy.row_words,
                    data_shape=self.data_shape, ctrl_shape=self.ctrl_shape, put=self.put)

    @property
    def row_bytes(self) -> int:
        return numel(self.row_shape) * elem_size(self.dtype)

    @property
    def symmetric_bytes(self) -> int:
        """Both channels: landing zone and control words, and with puts the same again as staging."""
        per_channel = numel(self.data_shape) * elem_size(self.copy.word_dtype) + numel(self.ctrl_shape) * 8
        if self.put:
            per_channel += numel(self.data_shape) * elem_size(self.copy.word_dtype) + stage_ctrl_bytes(self.world, 2)
        return 2 * per_channel

    @property
    def output_bytes(self) -> int:
        """Local output buffers: two alternating recv sets plus their metadata."""
        return 2 * (self.world * self.max_rows_per_peer * self.row_bytes + self.world * (4 + 4 + 8))


def plan_alltoallv(world: int, max_rows_per_peer: int, row_shape, dtype: torch.dtype,
                   device: torch.device, put: bool = False) -> AllToAllvPlan:
    row_shape = tuple(int(s) for s in row_shape)
    row_bytes = numel(row_shape) * elem_size(dtype)
    copy = plan_copy(row_bytes, max_rows_per_peer, world, device)
    return AllToAllvPlan(world, max_rows_per_peer, row_shape, dtype, copy,
                         data_shape=(2, world, max_rows_per_peer, copy.row_words),
                         ctrl_shape=(2, world, 2), put=bool(put))


# ---- EPBuffer (expert-parallel dispatch / combine) ------------------------------------------------

FP8_E4M3_MAX = 448.0
# GPU copy tiles of the EP kernels: 4096 words (16 KB, 32 words per thread at 4 warps) per iteration, so
# that a program has enough loads in flight to stream at HBM speed (1024-word tiles left the combine
# send at ~0.5 TB/s: one program per SM, 28 dependent round trips per row).
GPU_EP_COPY_WORDS = 4096
GPU_ROUTE_SLOTS = 512  # slots (token, k) per histogram pass of the routing scans
# World 1 dispatch (one kernel): 2 KB column blocks, one per program, so that a decode-sized batch spreads
# each row over several SMs (1024 bf16 columns, the same as an fp8 quantization block of 8 groups).
GPU_LOCAL_COPY_WORDS = 512
# nvfp4 columns per warp of a dispatch send program: 512 bytes of values stored as 16-byte vectors by 32
# threads (Triton gives each thread its share of a tile, so wider tiles take more warps, never fewer bytes)
GPU_NVFP4_WARP_COLS = 1024
GPU_FP8_WARP_COLS = 512    # e4m3 columns per warp of a loop over fp8 rows: 16 bytes per thread


@dataclass(frozen=True)
class EPPlan:
    """Buffers and launch shapes of one EPBuffer, from its static sizes only (nothing is allocated here).

    Memory (bytes, per rank; W world, M max_tokens_per_rank, K topk, L experts per rank, H hidden,
    b element size of ``dtype``, p = payload bytes of one token: H*b, or H + 4*H/128 with fp8 (H + H/128 with
    packed UE8M0 scales), H/2 + H/16 with nvfp4; c = bytes of one combine row: H*b, or H + 4*H/128 rounded
    up to 16 with combine_fp8):

      symmetric  dispatch landing  2 * W * M * (p + 4*K)      token-major: one row per (source, token),
                                                            rounded up to 16 bytes
                 combine landing   2 * M * K * c              one row per (token, k) on the token's rank
                 (both 8 bytes at world 1, where the ops are one kernel each and use no landing zone)
                 control words     2 * W * (L + 2) * 8  +  2 * W * 2 * 8
                 with puts (``with_put``): one more routing word per dispatch row (the token index), one
                 more control word (the combine's run base), a second half of the combine landing zone
                 (M*K rows), and each channel's staging, two zones (call % 2: reused only once a receive
                 proves the NIC read it, never quieted; ``triton_kernels/transport.py``):
        staging  dispatch          2 * W * M * (p + 4*K + 4)  as its landing zone, + 2 * W * (L + 3) * 8
                 combine           2 * W * M * K * c          a run per destination, + 2 * W * 2 * 8
      local      d.x (+ d.scales)  L * W*M * p                one set, reused by every call
                 routing metadata  2 * (L*W*M*4 + L*4 + W*M*K*4 + W*4 + M*K*4 + W*(L+1)*4 + W*8) + 2*L*8
                                   (the last two in the sets: rows per (source, local expert) and the arrival
                                   words; then the expert row counts and the combine's ready words)
                 counters, scratch 2 * (16 + 4*(W+3)) + 8 + 4*max(H, K)

    The DeepSeek-V3 decode shape (W=8, M=128, K=8, L=32, H=7168, bf16) needs 0.49 GiB per GPU (0.28 GiB
    with fp8 dispatch), d.x included; DeepEP's low-latency buffer for the same shape is 1.78 GiB, before
    the per-call receive tensors it allocates on top (see ``deepep_low_latency_bytes``).
    """

    world: int
    num_experts: int
    experts_per_rank: int     # L: experts owned by each rank
    hidden: int
    max_tokens: int           # M: max_tokens_per_rank
    topk: int
    dtype: torch.dtype        # token / expert-output dtype
    fp8: bool                 # dispatch payload quantized to float8_e4m3fn + one scale per 128 columns
    nvfp4: bool               # dispatch payload quantized to NVFP4: e2m1 pairs + e4m3 scale per 16 columns
    combine_fp8: bool         # combine payload quantized to float8_e4m3fn + float32 scale per 128 columns
    capacity: int             # rows per local expert in d.x: W * M (every token of every rank, once)
    x_words: int              # 32-bit words of one dispatched payload row (dtype row, fp8 bytes / 4, or nvfp4
    #                           H / 2 bytes / 4)
    scale_words: int          # 4-byte scale words per dispatched row (H / 128 float32, H / 512 packed UE8M0
    #                           int32 with "e4m3-ue8m0", four e4m3 per word H / 64 with nvfp4, else 0)
    row_words: int            # dispatch landing row: payload, scales, K int32 routing words, padded to
    #                           whole 16-byte vectors (every row starts 16-byte aligned)
    dispatch_ctrl_words: int  # per (zone, source) int64: [tokens, L per-expert counts, (put: run base,)
    #                           (nvfp4: the global scale's float32 bits, checked by every receiver,) flag]
    out_words: int            # 32-bit words of one expert-output row (H * b / 4)
    combine_words: int        # 32-bit words of one combine landing row: out_words, or with combine_fp8 the
    #                           fp8 bytes and float32 scales padded to 16 bytes (``formats.fp8_row_words``)
    # Launch shapes (1-D grids, but for the combine reduction and the world-1 dispatch). The interpreter
    # (CPU) pays per program and per op, not per element, so there every kernel is one wide program; a GPU
    # gets many narrow ones.
    block_tokens: int         # BT: tokens per iteration of the dispatch send and the combine reduction
    #                           (the combine's grid is reduce_programs x hidden / block_hidden)
    block_slots: int          # BS: (landing row, k) slots per iteration of dispatch recv / combine send
    # Copy tiles are [rows, BW] words (``triton_kernels/copy.py``), stored to each destination in turn; on a
    # GPU BW shrinks with the rows of a tile so that a tile stays at 4096 words (16 KB) in registers.
    send_block_words: int     # BW of the dispatch send
    recv_block_words: int     # BW of the dispatch receive
    out_block_words: int      # BW of the combine send
    block_hidden: int         # BH: elements per iteration of the combine reduction
    fp8_block_groups: int     # 128-column groups of one fp8 column block (divides H / 128): one program's
    #                           share of a row in the dispatch send and the world-1 dispatch
    nvfp4_block_groups: int   # the same for nvfp4: 16-column groups of one column block (a multiple of 4
    #                           dividing H / 16; 0 without nvfp4)
    route_tokens: int         # tokens per pass of the routing scans (histograms of expert ids)
    send_programs: int        # token blocks of the dispatch send's grid (send_grid)
    send_warps: int           # warps per dispatch send (and world-1 dispatch) program: fp8 tiles of 1024
    #                           bytes need 2 warps for 16 bytes per thread (one 16-byte store, not two 8-byte),
    #                           nvfp4 tiles of 512 bytes (1024 columns) one
    recv_programs: int        # grid of the combine send; the dispatch receive's, split over sources (recv_grid)
    reduce_programs: int      # token blocks of the combine reduction's grid
    reduce_warps: int         # warps per combine reduction program: 4, or 2 with combine_fp8 (the e4m3 bytes of
    #                           a 1024-column tile are 16 bytes per thread at 64 threads: 16-byte loads)
    # Put transport (``with_put``): the dispatch row carries one more routing word, the token index (a
    # put peer gets only the rows routed to it, packed; the index places them), the control words one
    # more, the run base of the combine (below), and the combine landing zone a second half where the
    # rows put by put peers land as one run per peer, sorted by (expert, token, k).
    put: bool = False
    dispatch_format: str | None = None   # the dispatch format (``moe_comm.formats``), None: the dtype

    @property
    def scale_mode(self) -> int:
        """The quantizer's SCALE constexpr (``triton_kernels/quant.py``)."""
        return formats.scale_mode(self.dispatch_format)

    @property
    def scale_dtype(self) -> torch.dtype:
        """dtype of d.scales with fp8: float32, or int32 (packed UE8M0)."""
        return formats.scale_dtype(self.dispatch_format)

    @property
    def scale_block_words(self) -> int:
        """Scale words of one fp8 column block (``fp8_block_groups`` groups): one per group, or one per four
        with packed UE8M0."""
        return self.fp8_block_groups * self.scale_words // max(1, self.hidden // FP8_GROUP)

    def buffer_layout(self) -> dict:
        """What sizes the buffers allocated from this plan: the fields above the launch shapes, ``put`` and
        ``dispatch_format`` (the scales' dtype)."""
        return {f: getattr(self, f) for f in EP_LAYOUT_FIELDS}

    def with_put(self) -> "EPPlan":
        """This plan for a group that reaches some peer by puts (``group.uses_put``)."""
        return replace(self, put=True, row_words=route_row_words(self.x_words + self.scale_words, self.topk, True),
                       dispatch_ctrl_words=self.experts_per_rank + 3 + self.nvfp4)

    @property
    def combine_zone_slots(self) -> int:
        """Rows of one combine landing zone: M*K (slot (t, k) at t*K + k, written by stores), and with
        puts M*K more (slot of sorted index i at M*K + i, written by the put peers' runs)."""
        return self.max_tokens * self.topk * (2 if self.put else 1)

    @property
    def reduce_grid(self) -> tuple:
        """Combine reduction grid: token blocks x column blocks (one column block per program, so that a
        single token's row is read by several SMs at once)."""
        return (self.reduce_programs, -(-self.hidden // self.block_hidden))

    @property
    def recv_grid(self) -> tuple:
        """Dispatch receive grid: programs per source x sources. A program unpacks one source's rows and
        waits only for the sources up to its own (their counts place its rows)."""
        return (max(1, self.recv_programs // self.world), self.world)

    @property
    def recv_block_slots(self) -> int:
        """BS of the dispatch receive: (token, k) slots of one source per iteration (at most a source's)."""
        return min(self.block_slots, next_pow2(self.max_tokens) * next_pow2(self.topk))

    @property
    def send_grid(self) -> tuple:
        """Dispatch send grid (world > 1): token blocks x column blocks. With fp8 each program quantizes
        one block of ``fp8_block_groups`` groups of its tokens' rows (no program walks a whole row);
        otherwise one column block (the copy loop walks the row)."""
        return (self.send_programs, self.quant_column_blocks or 1)

    @property
    def quant_column_blocks(self) -> int:
        """Column blocks of a quantized dispatch row (fp8 or nvfp4), one per program of a send grid column;
        0 without quantization."""
        if self.fp8:
            return self.hidden // (FP8_GROUP * self.fp8_block_groups)
        if self.nvfp4:
            return self.hidden // (NVFP4_GROUP * self.nvfp4_block_groups)
        return 0

    @property
    def local_grid(self) -> tuple:
        """World-1 dispatch grid: (token blocks + one bookkeeping program) x column blocks (the fp8
        quantization block, or send_block_words of the row)."""
        return (self.send_programs + 1, self.quant_column_blocks or -(-self.x_words // self.send_block_words))

    @property
    def elem_size(self) -> int:
        return elem_size(self.dtype)

    @property
    def dispatch_data_shape(self) -> tuple:
        """int32 words [2 zones, W sources, M tokens, row_words] (zone = call % 2); at world 1 one word per
        zone: the one-kernel path writes d.x directly and never touches a landing zone."""
        if self.world == 1:
            return (2, 1, 1, 1)
        return (2, self.world, self.max_tokens, self.row_words)

    @property
    def combine_data_shape(self) -> tuple:
        """int32 words [2 zones, combine_zone_slots, combine_words]: each (token, k) has exactly one writer; at
        world 1 one word per zone (every row is read in place)."""
        if self.world == 1:
            return (2, 1, 1, 1)
        return (2, self.combine_zone_slots, self.combine_words)

    @property
    def combine_stage_shape(self) -> tuple:
        """int32 words [2 zones, W destinations, M*K, combine_words] with puts: the run staged for each
        destination (``combine.py``); one word per zone at world 1."""
        if self.world == 1:
            return (2, 1, 1, 1)
        return (2, self.world, self.max_tokens * self.topk, self.combine_words)

    @property
    def stage_bytes(self) -> int:
        """Symmetric bytes of both channels' put staging (0 without puts): the dispatch's as large as its
        landing zone, the combine's a run per destination, two zones each, and their staged control words."""
        if not self.put:
            return 0
        w = self.world
        return 4 * (numel(self.dispatch_data_shape) + numel(self.combine_stage_shape)) + stage_ctrl_bytes(
            w, self.dispatch_ctrl_words) + stage_ctrl_bytes(w, 2)

    @property
    def symmetric_bytes(self) -> int:
        w = self.world
        return 4 * (numel(self.dispatch_data_shape) + numel(self.combine_data_shape)) + 8 * (
            2 * w * self.dispatch_ctrl_words + 2 * w * 2) + self.stage_bytes

    @property
    def local_bytes(self) -> int:
        L, cap, w, m, k = self.experts_per_rank, self.capacity, self.world, self.max_tokens, self.topk
        outputs = L * cap * 4 * (self.x_words + self.scale_words)
        metadata = 2 * (L * cap * 4 + L * 4 + w * m * k * 4 + w * 4 + m * k * 4 + w * (L + 1) * 4 + w * 8) + 2 * L * 8
        if self.put:   # per set: slot keys (m * k), the id histogram (bins)
            metadata += 2 * 4 * (m * k + max(32, next_pow2(self.num_experts)))
        # two channels of (send count, receive count, arrival counters); excluded-slot count; launch scratch
        counters = 2 * channel_counter_bytes(w) + 8 + 4 * self.scratch_words
        return outputs + metadata + counters

    @property
    def scratch_words(self) -> int:
        """int32 words of the scratch tensor that stands in for empty inputs (T = 0)."""
        return max(self.hidden, self.topk)

    @property
    def buffer_bytes(self) -> int:
        return self.symmetric_bytes + self.local_bytes


EP_LAYOUT_FIELDS = ("world", "num_experts", "experts_per_rank", "hidden", "max_tokens", "topk", "dtype", "fp8",
                    "nvfp4", "combine_fp8", "capacity", "x_words", "scale_words", "row_words", "dispatch_ctrl_words",
                    "out_words", "combine_words", "put", "dispatch_format")


VEC_WORDS = VEC_BYTES // 4   # int32 words of one 16-byte vector


def vector_words(words: int) -> int:
    """``words`` rounded up to whole 16-byte vectors: what an offset in int32 words must be for the rows
    that start there to take 16-byte stores."""
    return -(-words // VEC_WORDS) * VEC_WORDS


def route_row_words(payload_words: int, topk: int, put: bool) -> int:
    """Words of a dispatch landing row: payload (and scales), K routing words, with puts the token index
    word, padded to whole 16-byte vectors."""
    return vector_words(payload_words + topk + int(put))


def plan_ep(world: int, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype,
            fp8: bool, device, dispatch_format: str | None = None, combine_format: str | None = None) -> EPPlan:
    """Plan an EPBuffer; the caller has validated the sizes and formats (``formats.resolve``). ``device`` only
    picks the launch shapes; ``fp8``, ``dispatch_format`` and ``combine_format`` are the buffer's
    ``fp8_dispatch`` (True = dispatch_format "e4m3"), ``dispatch_format`` and ``combine_format``."""
    device = torch.device(device)
    fmt = formats.dispatch_format_of(fp8, dispatch_format)
    fp8, nvfp4, combine_fp8 = fmt in formats.FP8_FORMATS, fmt == formats.NVFP4, combine_format == formats.E4M3
    L, b = num_experts // world, elem_size(dtype)
    x_words = hidden // 4 if fp8 else hidden // 8 if nvfp4 else hidden * b // 4
    scale_words = formats.scale_columns(fmt, hidden)
    combine_words = fp8_row_words(hidden) if combine_fp8 else hidden * b // 4
    groups = hidden // FP8_GROUP
    pow2_groups = groups & -groups if groups else 1  # largest power of two dividing the group count
    groups16 = hidden // NVFP4_GROUP
    pow2_groups16 = groups16 & -groups16 if groups16 else 1
    slots = next_pow2(topk)
    if gpu_shapes(device):
        block_tokens, block_slots = 1, next_pow2(topk)
        tile = GPU_TILE_ELEMS
        # One register tile stored to each destination in turn (copy.py): the tile no longer grows with
        # the world, so the send copies whole 16 KB blocks at every world size.
        send_block_words = min(next_pow2(x_words), GPU_EP_COPY_WORDS if world > 1 else GPU_LOCAL_COPY_WORDS)
        recv_block_words = min(next_pow2(x_words), max(32, GPU_EP_COPY_WORDS // next_pow2(topk)))
        out_block_words = min(next_pow2(hidden * b // 4), max(32, GPU_EP_COPY_WORDS // next_pow2(topk)))
        block_hidden = min(next_pow2(hidden), tile)
        # A program quantizes 1024 columns (8 groups): a DeepSeek-V3 row is spread over 7 programs.
        fp8_block_groups = min(pow2_groups, max(2, tile // FP8_GROUP))
        # nvfp4: 1024 columns (512 bytes of values) too, which one warp stores as 16-byte vectors.
        nvfp4_block_groups = min(pow2_groups16, tile // NVFP4_GROUP)
        # 64 tokens at K = 8, even when M is smaller: a histogram tile never has fewer slots than a
        # program has threads (a shape some Triton versions' histogram lowering miscounted).
        route_tokens = max(1, GPU_ROUTE_SLOTS // slots)
        send_programs = max(1, min(max_tokens, GPU_TARGET_PROGRAMS))
        send_warps = 2 if fp8 else max(1, min(4, nvfp4_block_groups * NVFP4_GROUP // GPU_NVFP4_WARP_COLS)) \
            if nvfp4 else 4
        recv_programs = max(1, min(world * max_tokens, GPU_TARGET_PROGRAMS))
        reduce_programs = max(1, min(max_tokens, GPU_TARGET_PROGRAMS))
        reduce_warps = max(1, min(4, block_hidden // GPU_FP8_WARP_COLS)) if combine_fp8 else 4
    else:
        send_block_words = recv_block_words = min(next_pow2(x_words), 4096)
        out_block_words = min(next_pow2(hidden * b // 4), 4096)
        block_hidden = min(next_pow2(hidden), 4096)
        # Tokens per chunk: the routing's [chunk*K, chunk*K] comparison tile stays under 2**20 elements,
        # and so do the [chunk, columns] tiles of the send and the reduction.
        block_tokens = min(next_pow2(max_tokens), max(1, 1024 // slots),
                           CPU_MAX_TILE_ELEMS // max(send_block_words, block_hidden))
        # Every slot in one pass, unless a [BS, columns] tile would pass the interpreter's limit (a
        # serving engine's capacity of thousands of tokens per rank): then passes of the largest BS.
        widest = max(recv_block_words, out_block_words, next_pow2(L), next_pow2(world), slots)
        block_slots = min(next_pow2(world * max_tokens) * slots, CPU_MAX_TILE_ELEMS // widest)
        fp8_block_groups = min(pow2_groups, 32)
        nvfp4_block_groups = min(pow2_groups16, 256)
        route_tokens = max(1, min(next_pow2(max_tokens), 8192 // slots))
        send_programs = recv_programs = reduce_programs = 1
        send_warps = reduce_warps = 4
    # A column block holds whole scale words: packed UE8M0 (hidden % 512 == 0, so 4 | pow2_groups) needs
    # blocks of at least four groups.
    if fmt == formats.E4M3_UE8M0:
        fp8_block_groups = max(fp8_block_groups, formats.UE8M0_PER_WORD)
    return EPPlan(world, num_experts, L, hidden, max_tokens, topk, dtype, fp8, nvfp4, combine_fp8, dispatch_format=fmt,
                  capacity=world * max_tokens, x_words=x_words, scale_words=scale_words,
                  row_words=route_row_words(x_words + scale_words, topk, False),
                  dispatch_ctrl_words=L + 2 + nvfp4,
                  out_words=hidden * b // 4, combine_words=combine_words, block_tokens=block_tokens,
                  block_slots=block_slots, send_block_words=send_block_words, recv_block_words=recv_block_words,
                  out_block_words=out_block_words, block_hidden=block_hidden, fp8_block_groups=fp8_block_groups,
                  nvfp4_block_groups=nvfp4_block_groups if nvfp4 else 0,
                  route_tokens=route_tokens, send_programs=send_programs, send_warps=send_warps,
                  recv_programs=recv_programs, reduce_programs=reduce_programs, reduce_warps=reduce_warps)


def deepep_low_latency_bytes(max_tokens: int, hidden: int, world: int, num_experts: int) -> int:
    """Size of DeepEP's low-latency buffer (``Buffer.get_low_latency_rdma_size_hint``), for comparison.

    DeepEP (csrc/config.hpp, LowLatencyLayout) keeps two symmetric sets, each with a send buffer and a
    receive buffer sized for the larger of dispatch and combine, plus signalling words:
      dispatch message = 16 + max(2*H, H + 4*H/128) bytes;  combine message = 4*H/128 + 2*H bytes
      send  = max(M * dispatch message, E * M * combine message)
      recv  = max(E * M * dispatch message, E * M * combine message)
      total = 2 * (send + recv + align128(8*E + 4*E/W)), rounded up to 128 bytes.
    Its dispatch outputs (packed_recv_x, [L, W*M, H]) are allocated per call, outside this figure.
    """
    scales = hidden // FP8_GROUP
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = max(num_experts * max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    signal = -(-(num_experts * 8 + num_experts // world * 4) // 128) * 128
    total = 2 * (send + recv + signal)
    return (total + 128) // 128 * 128


DEEPEP_V2_ALIGN = 2 << 20        # DeepEP V2 rounds its buffer to 2 MB (symmetric::kNumAlignmentBytes)
DEEPEP_V2_TMA_ALIGN = 32         # and every field of a token to 32 bytes (ptx::kNumTMAAlignBytes)
DEEPEP_V2_MAX_CHANNELS = 8 * 160  # ElasticBuffer::kNumMaxChannels (channels per SM x SMs)


def deepep_v2_bytes(world: int, max_tokens: int, hidden: int, topk: int, fp8: bool = False,
                    gpus_per_node: int = 8) -> int:
    """Size of DeepEP V2's ``ElasticBuffer`` for EP (``ElasticBuffer.get_buffer_size_hint``; csrc/elastic/
    buffer.hpp ``calculate_buffer_size``, DeepEP commit dd758ca), hybrid mode with multiple reduction
    allowed (its defaults), ``gpus_per_node`` ranks per NVLink domain, for comparison.

    A token of the dispatch layout is hidden * elem bytes, the fp8 scale packs (ceil(hidden / 32) words
    with fp8), and K ids, K weights and (1 + K) ints of metadata, each part rounded up to 32 bytes; of the
    combine layout, hidden bf16 values and K ids and weights. With one node (direct mode) the buffer
    holds a send and a receive layout; across nodes (hybrid) the dispatch holds W x M tokens received over
    NVLink, M to send and N x (M + channels) received over RDMA, the combine min(G, K) x N x M,
    min(N, K) x M and N x (M + channels). The larger of the two, rounded up to 2 MB."""
    def token(hidden_bytes, sf_bytes, meta):
        a = DEEPEP_V2_TMA_ALIGN
        return sum(-(-b // a) * a for b in (hidden_bytes, sf_bytes, meta * 4))

    g = min(world, gpus_per_node)
    n = world // g
    d_tok = token(hidden * (1 if fp8 else 2), -(-hidden // 32) * 4 if fp8 else 0, 2 * topk + 1 + topk)
    c_tok = token(hidden * 2, 0, 2 * topk)
    ch = DEEPEP_V2_MAX_CHANNELS
    if n == 1:
        dispatch = d_tok * (world * max_tokens)                       # NVLink scale-up: no send buffer
        combine = c_tok * (min(world, topk) * max_tokens)
    else:
        dispatch = d_tok * (g * n * max_tokens + max_tokens + n * (max_tokens + ch))
        combine = c_tok * (min(g, topk) * n * max_tokens + min(n, topk) * max_tokens + n * (max_tokens + ch))
    return -(-max(dispatch, combine) // DEEPEP_V2_ALIGN) * DEEPEP_V2_ALIGN


# ---- PrefillBuffer (high-throughput dispatch / combine) -------------------------------------------

@dataclass(frozen=True)
class PrefillPlan:
    """Buffers and launch shapes of one PrefillBuffer, from its static sizes only (nothing is allocated).

    One landing zone per rank (symmetric int32 words) is the dispatch's output and the combine's source
    (R = W * M rows, row s*M + t = token t of source rank s, rank-major):

      words [0, R*K)                        recv_topk_idx      int32 [R, K]: local expert ids, -1 elsewhere
      words [R*K, 2*R*K)                    recv_topk_weights  float32 [R, K]: the slot's weight, 0 elsewhere
      words [x_offset, + R*x_words)         recv_x             [R, H] dtype, or float8_e4m3fn with fp8, or
                                                               uint8 [R, H/2] with nvfp4
      words [.. , + R*scale_words)          recv_scales        float32 [R, H/128] with fp8 (int32 [R, H/512]
                                                               with packed UE8M0), float8_e4m3fn [R, H/16]
                                                               with nvfp4
      words [x_offset, + R*combine_words)   partial rows of the combine (one per received token; fp8 rows
                                            with combine_fp8), written over recv_x by the combine's send
    x_offset = 2*R*K rounded up to a 16-byte vector. ``zones`` such zones (1 or 2, symmetric int32 words
    [zones, zone_words]): consecutive dispatches alternate between them, so with 2 the dispatch of one
    chunk can run while the previous chunk is in the experts (``PrefillBuffer``, ``prefill_chunks``).
    Whatever the number, a dispatch's send waits (on the device) until every rank's combine has finished
    reading the zones of the calls it answered.

    Memory (bytes, per rank; b element size of ``dtype``, p = payload bytes per row: H*b, or H + H/32 with
    fp8 (H + H/128 with packed UE8M0 scales), H/2 + H/16 with nvfp4; c = bytes of a partial row: H*b, or
    H + H/32 rounded up to 16 with combine_fp8; Z = zones): symmetric  Z*(4*x_offset + R*max(p, c))   (the zones,
                                                                                       each rounded up to 16 bytes)
                     + 2*W*(L + 2)*8 + 2*W*2*8 + 4  (control words; the combine channel's one data word)
              local  Z*(M*K*4 (the combine's mask) + W*4 + L*4) + L*8 + 8 + counters + scratch
    With put peers (``put``; nodes of G = ``ranks_per_node`` ranks, N = W / G, docs/prefill.md "Across
    nodes"): each zone adds the routing plane (R rows of 2K + 2 words: global ids, weights, int64 stamp)
    after the rows; the combine channel's data is the node inbox, Z*N*M*H*b bytes; the dispatch control
    words are G*L + 2 per (parity, source); each channel holds its staged control words (2 parities x W
    rows); the dispatch stages the payload rows it puts to other nodes, 2 parities x M*p (its own zone
    rows are its output: its experts may write them before a rail's NIC has read them), the combine one
    unused word; locally, a stamp per zone.
    DeepSeek-V3 prefill (H=7168, K=8, 256 experts, bf16): EP16 with 4096 tokens per rank needs
    0.88 GiB (DeepEP V2: 1.13 GiB); EP8 with 8192 the same R and so the same 0.88 GiB; two zones of
    half the capacity (M = 2048, 4096 tokens in two overlapped chunks) the same 0.88 GiB again.
    """

    ep: EPPlan            # the decode plan of the same sizes: its launch shapes (blocks, programs, warps)
    rows: int             # R = world * max_tokens
    x_offset: int         # first word of recv_x / the partial rows in the zone
    copy_rows: int        # rows per iteration of the combine's send (its copy into the zone)
    copy_words: int       # words per iteration along a row there
    copy_programs: int    # grid of the combine's send
    zones: int = 1        # landing zones (1, or 2 for overlapped chunks)
    put: bool = False     # some peer is reached by puts: the path across nodes (docs/prefill.md)
    ranks_per_node: int = 0   # G: ranks of one node (the world without puts)
    node_programs: int = 1    # programs per source of the dispatch pull and the combine forward (grid x world)
    pull_tokens: int = 1      # tokens per iteration of the dispatch pull (its copy tiles: pull_tokens x pull_words)
    pull_words: int = 1       # words per iteration along a row there (on a GPU 8 x 512: a 16 KB tile, and the fp8
    #                           scales' 8 x 64 words still 16-byte vectors at 4 warps)

    def buffer_layout(self) -> dict:
        """What sizes the buffers allocated from this plan: the decode plan's, the rows, the zone layout
        and the number of zones (not the copy's launch shapes)."""
        return dict(self.ep.buffer_layout(), rows=self.rows, x_offset=self.x_offset, zones=self.zones)

    @property
    def world(self) -> int:
        return self.ep.world

    @property
    def nodes(self) -> int:
        """N: nodes of ``ranks_per_node`` ranks."""
        return self.world // self.ranks_per_node

    @property
    def scales_offset(self) -> int:
        return self.x_offset + self.rows * self.ep.x_words

    @property
    def route_words(self) -> int:
        """Words of a routing row (with puts): K global expert ids, K weights, an int64 stamp."""
        return 2 * self.ep.topk + 2 if self.put else 0

    @property
    def route_offset(self) -> int:
        """First word of the routing plane: after the rows, on a 16-byte boundary."""
        p = self.ep
        return vector_words(self.x_offset + self.rows * max(p.x_words + p.scale_words, p.combine_words))

    @property
    def zone_words(self) -> int:
        """Words of one landing zone, whole 16-byte vectors: zone z starts at word z * zone_words, and its
        rows take 16-byte stores only if that start is a vector boundary (with W * M odd the routing plane's
        2K + 2 words a row, or an fp8 row's odd scale words, would leave zone 1 eight bytes off)."""
        p = self.ep
        if self.put:
            return vector_words(self.route_offset + self.rows * self.route_words)
        return vector_words(self.x_offset + self.rows * max(p.x_words + p.scale_words, p.combine_words))

    @property
    def count_span(self) -> int:
        """Per-expert counts in one source's control words: a receiving rank's L, or with puts its node's
        G*L (a rank reads its own at 1 + local index * L)."""
        return self.ep.experts_per_rank * (self.ranks_per_node if self.put else 1)

    @property
    def dispatch_ctrl_words(self) -> int:
        """Per (zone, source) int64 control words: [tokens, count_span per-expert slot counts, flag]; with
        puts [tokens, counts, pulled, flag] (``pulled``: the source, a rank of this node, has read every
        row it needs from this rank's zone); with nvfp4 (one node only) [tokens, counts, the global scale's
        float32 bits (every receiver checks it is its own), flag]."""
        return self.count_span + (3 if self.put else 2) + self.ep.nvfp4

    @property
    def inbox_words(self) -> int:
        """int32 words of one zone's node inbox (with puts): N x M output rows."""
        return self.nodes * self.ep.max_tokens * self.ep.out_words if self.put else 0

    @property
    def combine_data_shape(self) -> tuple:
        """The combine channel's data: the node inboxes [zones, inbox_words] with puts, else one word."""
        return (self.zones, self.inbox_words) if self.put else (1,)

    @property
    def combine_ctrl_words(self) -> int:
        """Per (zone, source) int64: [released (the source's combine finished reading every zone), ready
        (the rank's partial rows are in its zone)]; the flag word, which an abort marks, is ``ready``."""
        return 2

    @property
    def scratch_words(self) -> int:
        return self.ep.scratch_words

    @property
    def stage_words(self) -> int:
        """int32 words of one parity of the dispatch's payload staging (with puts): M payload rows, then from
        a 16-byte boundary M scale rows, the whole rounded to 16 bytes (``prefill_dispatch.py``: SX)."""
        p = self.ep
        return round_up(p.max_tokens * p.x_words, 4) + round_up(p.max_tokens * p.scale_words, 4)

    @property
    def dispatch_stage_shape(self) -> tuple:
        """int32 words [2 parities, stage_words] with puts: this rank's payload rows (then their scales) of
        the tokens it puts to other nodes, parity call % 2 (``prefill_dispatch.py``); one word without puts."""
        return (STAGE_ZONES, self.stage_words) if self.put else (1,)

    @property
    def symmetric_bytes(self) -> int:
        w = self.world
        data = 4 * self.zones * self.zone_words + 4 * math.prod(self.combine_data_shape)
        ctrl = 8 * (2 * w * self.dispatch_ctrl_words + 2 * w * self.combine_ctrl_words)
        staged = 0
        if self.put:   # the dispatch's payload staging, the combine's unused word, both staged control words
            staged = 4 * (math.prod(self.dispatch_stage_shape) + 1) + stage_ctrl_bytes(
                w, self.dispatch_ctrl_words) + stage_ctrl_bytes(w, self.combine_ctrl_words)
        return data + ctrl + staged

    @property
    def local_bytes(self) -> int:
        p, w = self.ep, self.world
        per_zone = p.max_tokens * p.topk * 4 + w * 4 + p.experts_per_rank * 4   # mask, src_tokens, counts
        if self.put:
            per_zone += 8                                                       # the zone's stamp
        metadata = self.zones * per_zone + p.experts_per_rank * 8 + 8
        counters = 2 * channel_counter_bytes(w)
        return metadata + counters + 4 * self.scratch_words

    @property
    def buffer_bytes(self) -> int:
        return self.symmetric_bytes + self.local_bytes

    def dispatch_link_bytes(self, routed_pairs: int, num_tokens: int, peers: int) -> int:
        """Bytes one rank's dispatch send stores into other ranks' zones: the payload of each
        (token, remote destination rank) pair once (``routed_pairs``: the floor, see
        ``reference.prefill_pairs``), plus the K ids and K weights of each token to each of ``peers``
        other live ranks, plus the control words."""
        p = self.ep
        payload = 4 * (p.x_words + p.scale_words)
        return routed_pairs * payload + num_tokens * peers * 8 * p.topk + peers * 8 * self.dispatch_ctrl_words

    def combine_link_bytes(self, routed_pairs: int) -> int:
        """Bytes one rank's combine receive loads from other ranks' zones: one partial row per (token,
        remote rank holding one of its experts) pair, the floor (a row of the combine format: with fp8 its
        e4m3 bytes and float32 scales, padded to 16 bytes)."""
        return routed_pairs * 4 * self.ep.combine_words


def check_replaced_plan(owner: str, old, new) -> None:
    """Refuse ``new`` as the plan of an op whose buffers were allocated from plan ``old`` unless both size
    every buffer alike (``buffer_layout``): only launch shapes may change then. Setting a plan is local
    to one rank, and resizing symmetric buffers is collective, so a layout change cannot follow it."""
    if type(new) is not type(old):
        raise TypeError(f"{owner}.plan must be a {type(old).__name__}, got {type(new).__name__}")
    a, b = old.buffer_layout(), new.buffer_layout()
    changed = [f"{k} {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]
    if changed:
        raise ValueError(f"{owner}: the new plan sizes the buffers differently ({'; '.join(changed)}) from the "
                         f"plan they were allocated for. Once an op's buffers exist a new plan may change only "
                         f"launch shapes (reallocating symmetric buffers is collective; setting a plan is not). "
                         f"Set such a plan before the op's first call (EPBuffer, PrefillBuffer allocate then), "
                         f"or close() the op and build a new one with the sizes you want")


PREFILL_ZONES = (1, 2)   # landing zones a PrefillBuffer may hold: in sequence, or overlapped chunks
GPU_PULL_TOKENS = 8      # tokens per iteration of the dispatch pull on a GPU (see PrefillPlan.pull_tokens)


def plan_prefill(world: int, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype,
                 fp8: bool, device, zones: int = 1, ranks_per_node: int | None = None,
                 dispatch_format: str | None = None, combine_format: str | None = None) -> PrefillPlan:
    """Plan a PrefillBuffer; the caller has validated the sizes. ``device`` only picks the launch shapes.
    ``ranks_per_node``: G when some peers are reached by puts (nodes of G consecutive ranks; 1 when
    every peer is a put peer), None when every peer is reached by stores. The formats as ``plan_ep``'s."""
    if zones not in PREFILL_ZONES:
        raise ValueError(f"zones must be one of {PREFILL_ZONES} (2: the next chunk's dispatch overlaps this "
                         f"chunk's experts), got {zones!r}")
    put = ranks_per_node is not None and world > 1
    g = int(ranks_per_node) if put else world
    if put and (g < 1 or world % g):
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world ({world})")
    device = torch.device(device)
    ep = plan_ep(world, num_experts, hidden, max_tokens, topk, dtype, fp8, device, dispatch_format, combine_format)
    rows = world * max_tokens
    x_offset = vector_words(2 * rows * topk)
    if device.type == "cuda":  # one 16 KB row block per iteration, many programs
        words = min(next_pow2(ep.out_words), GPU_EP_COPY_WORDS)
        block_rows, programs = 1, max(1, min(rows, GPU_TARGET_PROGRAMS))
    else:                      # the interpreter: one wide program
        words = min(next_pow2(ep.out_words), 4096)
        block_rows, programs = min(next_pow2(rows), max(1, 8192 // words)), 1
    if gpu_shapes(device):
        node_programs, pull_tokens = max(1, min(max_tokens, GPU_TARGET_PROGRAMS // world)), GPU_PULL_TOKENS
        pull_words = min(next_pow2(ep.x_words), GPU_EP_COPY_WORDS // GPU_PULL_TOKENS)
    else:
        node_programs, pull_tokens, pull_words = 1, ep.block_tokens, ep.send_block_words
    return PrefillPlan(ep, rows, x_offset, block_rows, words, programs, int(zones), put, g, node_programs, pull_tokens,
                       pull_words)


# ---- MoELayer (the fused layer: dispatch -> expert GEMMs -> combine) -------------------------------------

EXPERT_BLOCK_K = 64      # K step of every expert GEMM tile (serving/experts.py's masked kernel uses it too: the
#                          same step gives a row the same bits in the fused and the unfused path)
# fp8 expert weights (MoELayer's w13_scale / w2_scale): one float32 scale per block of FP8_WEIGHT_BLOCK x
# FP8_WEIGHT_BLOCK weights, DeepSeek-V3's weight_block_size [128, 128]. A GEMM tile's K step must lie in one
# block (BK divides it: each step loads one scale per output column); its output columns may span blocks
# (each column's scale is loaded by its own index, so BN and a block boundary inside w13's up half are free).
FP8_WEIGHT_BLOCK = 128
assert FP8_WEIGHT_BLOCK % EXPERT_BLOCK_K == 0, "the fp8 weight tiles need BK to divide the scale block"
GPU_EXPERT_ROWS = 16     # rows of a GEMM tile on a GPU (decode: few rows per expert)
GPU_EXPERT_COLS = 64     # output columns of a GEMM tile on a GPU
GPU_SCAN_SLOTS = 128     # landing slots per step of the gate/up kernel's row search on a GPU


@dataclass(frozen=True)
class MoELayerPlan:
    """Buffers and launch shapes of one ``moe_comm.MoELayer``, from its static sizes only.

    Memory (bytes, per rank; the EPPlan's symbols, I intermediate): the EPBuffer underneath without d.x
    (the fused kernels read the rows where they landed; ``EPPlan.local_bytes`` counts L*W*M*p for it),
    plus the activations h [L, W*M, I] (L*W*M*I*b), the output rows of this rank's own slots [M*K, H]
    (M*K*H*b) and their codes [W, M, K] int32 (4*W*M*K). That is at most the EPBuffer's (dispatch +
    combine) when L*W*M*I*b + M*K*H*b + 4*W*M*K <= L*W*M*p: with I < H and any decode shape (DeepSeek-V3
    EP8, 128 tokens per rank: 0.19 GiB against 0.49 GiB). The weights are the caller's, not counted.
    """

    ep: EPPlan                # the dispatch / combine buffers underneath
    intermediate: int         # I: w13 [L, 2I, H], w2 [L, H, I]
    block_rows: int           # BM: rows of a GEMM tile (both kernels)
    gate_cols: int            # BN of the gate/up kernel: columns of I per program
    down_cols: int            # BN of the down kernel: columns of H per program
    block_k: int              # BK: K step of every GEMM tile (EXPERT_BLOCK_K; divides FP8_WEIGHT_BLOCK)
    scan_slots: int           # landing slots per step of the gate/up kernel's row search
    bookkeeping_slots: int    # slots per step of the down kernel's own-code and dropped-slot loops

    @property
    def gate_grid(self) -> tuple:
        """(column blocks of I, local experts)."""
        return (-(-self.intermediate // self.gate_cols), self.ep.experts_per_rank)

    @property
    def down_grid(self) -> tuple:
        """(column blocks of H, local experts)."""
        return (-(-self.ep.hidden // self.down_cols), self.ep.experts_per_rank)

    @property
    def activation_bytes(self) -> int:
        return self.ep.experts_per_rank * self.ep.capacity * self.intermediate * self.ep.elem_size

    @property
    def own_rows_bytes(self) -> int:
        """The output rows of this rank's own slots and their codes."""
        ep = self.ep
        return ep.max_tokens * ep.topk * ep.hidden * ep.elem_size + 4 * ep.world * ep.max_tokens * ep.topk

    @property
    def buffer_bytes(self) -> int:
        ep = self.ep
        rows = ep.experts_per_rank * ep.capacity * 4 * (ep.x_words + ep.scale_words)   # d.x, not allocated
        return ep.buffer_bytes - rows + self.activation_bytes + self.own_rows_bytes


def plan_moe_layer(ep: EPPlan, intermediate: int, device) -> MoELayerPlan:
    """Plan a MoELayer over the EPBuffer plan ``ep`` (validated by the caller). GPU: decode tiles (16 rows,
    64 columns); the interpreter: wide tiles (fewer programs and loop steps). BK is EXPERT_BLOCK_K on both."""
    cols = next_pow2(intermediate)
    if gpu_shapes(device):
        bm, gate_cols, down_cols, scan = GPU_EXPERT_ROWS, GPU_EXPERT_COLS, GPU_EXPERT_COLS, GPU_SCAN_SLOTS
        bookkeeping = GPU_ROUTE_SLOTS
    else:
        bm = max(16, min(64, next_pow2(ep.capacity)))
        gate_cols, down_cols = max(16, min(128, cols)), max(16, min(256, next_pow2(ep.hidden)))
        scan = max(16, min(4096, next_pow2(ep.max_tokens) * next_pow2(ep.topk)))
        bookkeeping = max(16, min(4096, next_pow2(ep.world * ep.max_tokens) * next_pow2(ep.topk)))
    return MoELayerPlan(ep, int(intermediate), bm, gate_cols, down_cols, EXPERT_BLOCK_K, scan, bookkeeping)
