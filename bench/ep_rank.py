"""One rank of an EP-N world on one device: its real dispatch and combine kernels at full size, the
other N - 1 ranks emulated.

The world is a loopback world of N ranks (``moe_comm.init(backend="loopback")``): every rank's symmetric
buffers are allocations on this device, but only rank r has an EPBuffer, so only rank r's kernels run.
Per call (one CUDA graph on a GPU):

1. ``signal_peers_kernel`` (one program): for every emulated source j != r, the control words j's send
   would write into rank r's control region for this call (dispatch: tokens, per-local-expert counts),
   then j's flag with a release, as j's last send program does.
2. Rank r's send kernel (real): routing and payload to every destination. The destinations' landing
   zones are the emulated ranks' buffers, in this device's memory, so every store is made.
3. Rank r's receive kernel (real): waits for every source's flag, reads its landing zone, writes d.x
   (dispatch) or y (combine).

What the emulated ranks would have stored into rank r's landing zones is staged once per zone before
timing: dispatch rows (payload, fp8 scales, routing words consistent with the staged counts) and, for
the combine, the expert-output rows answering rank r's slots on their experts. Rows are staged, flags
signalled per call. Not measured: the link, and the emulated ranks' stores into this device's memory
(in a real world they compete with rank r's traffic for its HBM).

Layout: every size comes from the plan (``p.row_words``, ``p.x_words``, ``p.scale_words``,
``p.dispatch_ctrl_words``, ``p.dispatch_data_shape``, ``p.combine_data_shape``, ...) and the channels'
``flag_word``; the order of the words inside a landing row and a control row is the one documented in
``moe_comm/triton_kernels/dispatch.py`` (payload, scales, then TOPK routing words ``local_expert +
L * position``; control ``[tokens, L counts, flag]``).

Memory: every rank's symmetric buffers are full copies (the loopback heap makes them), so the emulation
holds N x symmetric bytes + rank r's local bytes (``rank_bytes``), quadratic in N through the dispatch
landing zones (rank r writes only slice [zone, r] of each peer's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import moe_comm
from moe_comm import reference
from bench import peers
from moe_comm.ep import EPBuffer
from moe_comm.interpreter import kernel_for
from moe_comm.planner import next_pow2, plan_ep
from moe_comm.serving.backends import positions_by_key
from moe_comm.triton_kernels.sync import S_EPOCH, flag_value, publish_many

ROUTINGS = ("uniform", "skewed")
ZIPF_S = 1.0  # skewed routing: expert popularity ~ 1 / (popularity rank + 1) ** ZIPF_S


# ---- routing -------------------------------------------------------------------------------------

def routing(kind: str, world: int, rank: int, tokens: int, num_experts: int, topk: int,
            gen: torch.Generator) -> list[torch.Tensor]:
    """Every rank's topk_idx: ``world`` int64 [tokens, topk] CPU tensors of distinct expert ids.

    uniform: each token's experts uniformly at random. skewed (hot rank): experts drawn without
    replacement with probability ~ 1 / (i + 1) ** ZIPF_S, i = the expert's popularity rank, where rank
    ``rank``'s experts are the most popular (i = 0 .. E_local - 1) and the others follow in a random
    order: the measured rank is the busiest receiver.
    """
    if kind == "uniform":
        return [peers.random_topk(tokens, num_experts, topk, gen) for _ in range(world)]
    if kind != "skewed":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    local = num_experts // world
    mine = torch.arange(rank * local, (rank + 1) * local)
    others = torch.tensor([e for e in torch.randperm(num_experts, generator=gen).tolist()
                           if not rank * local <= e < (rank + 1) * local], dtype=torch.int64)
    order = torch.cat([mine, others])  # popularity rank -> expert id
    weight = torch.empty(num_experts, dtype=torch.float64)
    weight[order] = 1.0 / (torch.arange(num_experts, dtype=torch.float64) + 1.0) ** ZIPF_S
    if tokens == 0:
        return [torch.zeros(0, topk, dtype=torch.int64) for _ in range(world)]
    return [torch.multinomial(weight.expand(tokens, -1), topk, replacement=False, generator=gen)
            for _ in range(world)]


# ---- the peer emulator ---------------------------------------------------------------------------

@triton.jit
def signal_peers_kernel(
    ctrl_ptr,         # int64 [2 zones, WORLD sources, CTRL_WORDS]: rank r's control region of a channel
    staged_ptr,       # int64 [2, WORLD, CTRL_WORDS]: what each source writes there (its flag word unused)
    seq_ptr,          # int64 [1]: the channel's receive count (the receive about to run is call seq + 1)
    grp,              # rank r's group state (its epoch)
    rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, CTRL_WORDS: tl.constexpr, CW_P2: tl.constexpr,
    FLAG_WORD: tl.constexpr,
):
    """The end of every emulated source's send for the coming call: its control words for the call's
    zone, then its flag (CTA barrier + release, ``publish_many``). Source ``rank`` (the real one) is left
    alone. Grid (1,)."""
    call = tl.load(seq_ptr) + 1
    zone = call % 2
    w = tl.arange(0, WORLD_P2)
    c = tl.arange(0, CW_P2)
    peer = (w < WORLD) & (w != rank)
    row = (zone * WORLD + w).to(tl.int64) * CTRL_WORDS
    words = peer[:, None] & (c < CTRL_WORDS)[None, :] & (c != FLAG_WORD)[None, :]
    v = tl.load(staged_ptr + row[:, None] + c[None, :], mask=words, other=0)
    tl.store(ctrl_ptr + row[:, None] + c[None, :], v, mask=words)
    publish_many(ctrl_ptr + row + FLAG_WORD, flag_value(tl.load(grp + S_EPOCH), call), peer)


def channels(ep: EPBuffer):
    """(dispatch channel, combine channel) of ``ep``, allocated if not yet: the emulation writes what
    peers would into them. The bench's only use of EPBuffer internals."""
    ep._ensure_allocated()
    return ep._dispatch_ch, ep._combine_ch


def rank_bytes(world: int, num_experts: int, hidden: int, tokens: int, topk: int, fp8: bool) -> int:
    """Device bytes of the emulation's buffers: every rank's symmetric buffers and rank r's local ones."""
    p = plan_ep(world, num_experts, hidden, tokens, topk, torch.bfloat16, fp8, "cuda")
    return world * p.symmetric_bytes + p.local_bytes


class EmulatedRank:
    """Rank ``rank`` of an EP-``world`` world, real, with the other ranks staged and signalled.

    xs: every rank's x, ``world`` bf16 [T, hidden] CPU tensors; idxs: every rank's topk_idx (``routing``).
    Builds rank r's EPBuffer (max_tokens_per_rank = T) on a loopback world, stages both zones, and
    draws rank r's combine inputs: ``expert_out`` bf16 [E_local, world*T, hidden] (random; only rows
    below the counts are read), ``weights`` float32 [T, topk], and the rows the emulated ranks return
    for rank r's slots on their experts, ``returned`` bf16 [T, topk, hidden] (random; rows of slots
    routed to rank r or not routed are never read).
    """

    def __init__(self, world: int, rank: int, num_experts: int, hidden: int, topk: int, fp8: bool,
                 xs: list[torch.Tensor], idxs: list[torch.Tensor], device: torch.device, gen: torch.Generator):
        self.world, self.rank, self.num_experts, self.fp8 = world, rank, num_experts, fp8
        self.xs, self.idxs, self.device = xs, idxs, device
        self.tokens = xs[rank].shape[0]
        if self.tokens < 1 or any(x.shape[0] != self.tokens for x in xs):
            raise ValueError(f"every rank needs the same T >= 1 tokens, got {[x.shape[0] for x in xs]}")
        self.groups = moe_comm.init(backend="loopback", world_size=world, device=device, timeout_s=30.0)
        self.group = self.groups[rank]
        self.ep = EPBuffer(self.group, num_experts, hidden, self.tokens, topk, dtype=torch.bfloat16,
                           fp8_dispatch=fp8)
        p = self.p = self.ep.plan
        self.dispatch_ch, self.combine_ch = channels(self.ep)
        self.x, self.idx = xs[rank].to(device), idxs[rank].to(device)
        self.weights = torch.rand(self.tokens, topk, generator=gen).to(device)
        self.expert_out = torch.randn(p.experts_per_rank, p.capacity, hidden, generator=gen).to(torch.bfloat16)
        self.expert_out = self.expert_out.to(device)
        self.returned = torch.randn(self.tokens, topk, hidden, generator=gen).to(torch.bfloat16)
        self.dispatch_ctrl = self._stage_dispatch()
        self.combine_ctrl = self._stage_combine()
        self.handle = None

    # ---- staging (once, both zones) ---------------------------------------------------------------
    def _owner_and_position(self, idx: torch.Tensor):
        """For one source's topk_idx [T, K]: owner rank of every slot (-1 unrouted) and its position among
        that source's slots to the same expert, in (t, k) order (what the source's routing computes)."""
        flat = idx.reshape(-1)
        valid = (flat >= 0) & (flat < self.num_experts)
        pos, _ = positions_by_key(torch.where(valid, flat, self.num_experts), self.num_experts)
        owner = torch.where(valid, flat // self.p.experts_per_rank, -1)
        return owner.view(idx.shape), torch.where(valid, pos, 0).view(idx.shape)

    def _stage_dispatch(self) -> torch.Tensor:
        """Landing rows [zone, j, t] of every emulated source j in rank r's dispatch landing zone (both
        zones); returns the staged control words int64 [2, world, dispatch_ctrl_words] on the device."""
        p, r = self.p, self.rank
        L, meta = p.experts_per_rank, p.x_words + p.scale_words
        data = self.dispatch_ch.data.local.view(p.dispatch_data_shape)
        ctrl = torch.zeros(2, self.world, p.dispatch_ctrl_words, dtype=torch.int64)
        for j in range(self.world):
            if j == r:
                continue
            x, idx = self.xs[j], self.idxs[j]
            T = x.shape[0]
            owner, pos = self._owner_and_position(idx)
            here = owner == r
            rows = torch.zeros(T, p.row_words, dtype=torch.int32)
            if self.fp8:
                q, scales = reference.quantize_fp8(x)
                rows[:, :p.x_words] = q.contiguous().view(torch.int32)
                rows[:, p.x_words:meta] = scales.contiguous().view(torch.int32)
            else:
                rows[:, :p.x_words] = x.contiguous().view(torch.int32)
            rows[:, meta:meta + p.topk] = torch.where(here, idx % L + L * pos, -1).to(torch.int32)
            ctrl[:, j, 0] = T
            ctrl[:, j, 1:1 + L] = torch.bincount(torch.where(here, idx % L, L).reshape(-1), minlength=L + 1)[:L]
            for zone in range(2):
                data[zone, j, :T] = rows.to(self.device)
        return ctrl.to(self.device)

    def _stage_combine(self) -> torch.Tensor:
        """Rows the emulated ranks return for rank r's slots on their experts, in rank r's combine
        landing zone (both zones); returns the staged control words (only the flag is used: zeros)."""
        p = self.p
        data = self.combine_ch.data.local.view(p.combine_data_shape)
        owner, _ = self._owner_and_position(self.idxs[self.rank])
        remote = ((owner >= 0) & (owner != self.rank))[:, :, None]
        rows = torch.where(remote, self.returned, torch.zeros((), dtype=torch.bfloat16)).contiguous()
        for zone in range(2):
            data[zone, :self.tokens * p.topk] = rows.view(torch.int32).view(self.tokens * p.topk, p.out_words).to(
                self.device)
        return torch.zeros(2, self.world, self.combine_ch.ctrl_words, dtype=torch.int64, device=self.device)

    # ---- one call --------------------------------------------------------------------------------
    def signal(self, op: str) -> None:
        """Launch the peer emulator for the coming call of ``op`` ("dispatch" or "combine")."""
        ch, staged = ((self.dispatch_ch, self.dispatch_ctrl) if op == "dispatch" else
                      (self.combine_ch, self.combine_ctrl))
        cw = ch.ctrl_words
        kernel_for(signal_peers_kernel, self.device)[(1,)](
            ch.ctrl.local, staged, ch.recv_seq, self.group.state, self.rank, WORLD=self.world,
            WORLD_P2=next_pow2(self.world), CTRL_WORDS=cw, CW_P2=next_pow2(cw), FLAG_WORD=ch.flag_word)

    def dispatch(self, i: int = 0):
        """Emulated peers, then rank r's send and receive: the DispatchResult."""
        self.signal("dispatch")
        self.ep.dispatch(self.x, self.idx, phase="send")
        d = self.ep.dispatch(phase="recv")
        self.handle = d.handle
        return d

    def combine(self, i: int = 0) -> torch.Tensor:
        """Emulated peers, then rank r's combine send and receive (answering the last dispatch): y."""
        self.signal("combine")
        self.ep.combine(self.expert_out, self.weights, self.handle, phase="send")
        return self.ep.combine(phase="recv")

    # ---- what the staged world implies -------------------------------------------------------------
    def expected_dispatch(self) -> dict:
        """reference.dispatch of the whole world (rank r's share): x, scales, counts, src."""
        return reference.dispatch(self.xs, self.idxs, self.num_experts, self.tokens, fp8=self.fp8)[self.rank]

    def expected_counts(self) -> torch.Tensor:
        """int32 [E_local]: slots of every rank routed to each of rank r's experts (capacity is never
        reached: a token names an expert at most once)."""
        L = self.p.experts_per_rank
        ids = torch.cat([idx.reshape(-1) for idx in self.idxs]) - self.rank * L
        return torch.bincount(ids[(ids >= 0) & (ids < L)], minlength=L).to(torch.int32)

    def expected_combine(self) -> torch.Tensor:
        """reference.combine of the whole world (rank r's y): rank r's expert_out, and for every other
        rank an expert_out holding, at the row where its dispatch put rank r's slot, the staged row."""
        L, cap, H = self.expert_out.shape
        rows = reference.ep_rows(self.idxs, self.num_experts, self.tokens)
        outs = [torch.zeros(L, cap, H, dtype=torch.bfloat16) for _ in range(self.world)]
        outs[self.rank] = self.expert_out.cpu()
        for j in range(self.world):
            if j == self.rank:
                continue
            for e in range(L):
                for i, (s, t, k) in enumerate(rows[j][e]):
                    if s == self.rank:
                        outs[j][e, i] = self.returned[t, k]
        ws = [self.weights.cpu() if s == self.rank else torch.zeros(x.shape[0], self.p.topk)
              for s, x in enumerate(self.xs)]
        return reference.combine(outs, ws, self.idxs, self.num_experts, self.tokens)[self.rank]

    def check(self, d, y, exact: bool = True) -> None:
        """Compare a dispatch result and a combine output with what the staged world implies
        (AssertionError naming what differs). ``exact`` (the interpreter): bit for bit. Compiled (GPU),
        as tests/gpu allow: rank r's own fp8 codes may break a rounding tie the other way (at most 1e-3
        of them, by one code), and the combine's float32 sums may differ by FMA contraction."""
        self.group.check()
        exp = self.expected_dispatch()
        counts = d.counts.cpu()
        assert torch.equal(counts, exp["counts"]), f"counts {counts.tolist()} != {exp['counts'].tolist()}"
        for e, n in enumerate(counts.tolist()):
            assert torch.equal(d.src[e, :n].cpu(), exp["src"][e, :n]), f"src of local expert {e} differs"
            got = d.x[e, :n].cpu()
            if self.fp8:
                assert reference.fp8_codes_match(got, exp["x"][e, :n], exact=exact, max_fraction=1e-3), \
                    f"fp8 rows of local expert {e} differ"
                assert torch.equal(d.scales[e, :n].cpu(), exp["scales"][e, :n]), f"scales of local expert {e} differ"
            else:
                assert torch.equal(got, exp["x"][e, :n]), f"rows of local expert {e} differ"
        want = self.expected_combine()
        if exact:
            assert torch.equal(y.cpu(), want), "combine output differs from the reference"
        else:
            torch.testing.assert_close(y.cpu().float(), want.float(), rtol=1e-2, atol=1e-2,
                                       msg="combine output differs from the reference")

    # ---- the byte model (floor) --------------------------------------------------------------------
    def floor_bytes(self, op: str) -> int:
        """Bytes rank r's kernels must move through this device's memory per call (see NOTES, 'one rank
        of EP-N'): payload bytes q = 4 * (x_words + scale_words), expert-output rows o = 4 * out_words.

        dispatch: reads of x (o per token with a routed slot) + stores to every destination (q per
        (token, destination rank) pair, the rank itself included, + 4*K bytes of routing words per
        token and rank) + landing reads (q per landing row routed here + 4*K routing-word bytes per row
        of every source) + d.x writes (q per slot received).
        combine: send reads and stores o per slot of another rank routed here; the receive reads o per
        routed slot of rank r and writes y (o per token).
        """
        p, r, W = self.p, self.rank, self.world
        q, o, K = 4 * (p.x_words + p.scale_words), 4 * p.out_words, p.topk
        owners = [self._owner_and_position(idx)[0] for idx in self.idxs]
        T = self.tokens
        if op == "dispatch":
            mine = owners[r]
            pairs = sum(int((mine == j).any(dim=1).sum()) for j in range(W))
            send = int((mine >= 0).any(dim=1).sum()) * o + pairs * q + T * W * K * 4
            rows_in = sum(int((own == r).any(dim=1).sum()) for own in owners)
            slots_in = sum(int((own == r).sum()) for own in owners)
            recv = rows_in * q + sum(own.shape[0] for own in owners) * K * 4 + slots_in * q
            return send + recv
        from_peers = sum(int((own == r).sum()) for j, own in enumerate(owners) if j != r)
        return 2 * from_peers * o + int((owners[r] >= 0).sum()) * o + T * o

    def close(self) -> None:
        """Close the buffer and the world. The loopback heap frees a buffer once every rank has, which
        only rank r does here: the memory goes with the last reference (drop this object)."""
        self.ep.close()
        for g in self.groups:
            g.close()
