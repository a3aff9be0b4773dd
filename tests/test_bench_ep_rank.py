"""bench/ep_rank.py: one real rank of EP-N with the other ranks staged and signalled (CPU interpreter).

The real rank's dispatch and combine must equal what the reference computes for the whole world the
staging stands for, bit for bit, on both zones; a wrong staged word must make that check fail.
"""

import pytest
import torch

from bench import ep_rank
from moe_comm.triton_kernels.compile_report import KernelConfig, compile_one

CPU = torch.device("cpu")
E, H, K = 16, 256, 4


def _world(world, rank, tokens, fp8, kind="uniform", seed=0, idxs=None, hidden=H, experts=E, topk=K):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    if idxs is None:
        idxs = ep_rank.routing(kind, world, rank, tokens, experts, topk, gen)
    return ep_rank.EmulatedRank(world, rank, experts, hidden, topk, fp8, xs, idxs, CPU, gen)


@pytest.mark.parametrize("fp8", [False, True])
def test_rank_equals_reference_on_both_zones(fp8):
    em = _world(4, 2, 3, fp8, kind="skewed", seed=int(fp8))
    try:
        for _ in range(2):  # calls alternate zones: both staged copies are read
            d = em.dispatch()
            y = em.combine()
            em.check(d, y)
            em.check(d, y, exact=False)  # the GPU's tolerances accept what is exact
        assert int(d.counts.sum()) == int(em.expected_counts().sum()) > 0
        # The counts-only check of large GPU points: per expert, as the reference dispatch counts them.
        assert torch.equal(em.expected_counts(), em.expected_dispatch()["counts"])
    finally:
        em.close()


def test_a_wrong_staged_word_fails_the_check():
    """Controls: one payload word of a peer's landing row, one peer's count, one returned combine row."""
    em = _world(4, 1, 3, False, seed=5)
    try:
        em.check(em.dispatch(), em.combine())
        p, r = em.p, em.rank
        data = em.dispatch_ch.data.local.view(p.dispatch_data_shape)
        owner, _ = em._owner_and_position(em.idxs[0])
        t = int(torch.nonzero((owner == r).any(dim=1))[0])
        data[:, 0, t, 0] += 1
        with pytest.raises(AssertionError, match="rows of local expert"):
            em.check(em.dispatch(), em.combine())
        data[:, 0, t, 0] -= 1
        em.check(em.dispatch(), em.combine())

        e = int(torch.nonzero(em.dispatch_ctrl[0, 0, 1:1 + p.experts_per_rank])[0])
        em.dispatch_ctrl[:, 0, 1 + e] -= 1
        with pytest.raises(AssertionError, match="counts"):
            em.check(em.dispatch(), em.combine())
        em.dispatch_ctrl[:, 0, 1 + e] += 1

        own, _ = em._owner_and_position(em.idxs[r])
        tk = torch.nonzero((own >= 0) & (own != r))[0].tolist()
        em.combine_ch.data.local.view(p.combine_data_shape)[:, tk[0] * p.topk + tk[1], 0] ^= 1 << 20
        with pytest.raises(AssertionError, match="combine output"):
            em.check(em.dispatch(), em.combine())
    finally:
        em.close()


def test_floor_bytes_of_a_hand_made_routing():
    """EP2, rank 1 (experts 2, 3), hidden 128 bf16 (rows of 256 bytes), top-2, T = 2.
    rank 0: t0 -> (0, 2), t1 -> (1, 3); rank 1: t0 -> (2, 3), t1 -> (0, 2)."""
    idxs = [torch.tensor([[0, 2], [1, 3]]), torch.tensor([[2, 3], [0, 2]])]
    em = _world(2, 1, 2, False, idxs=idxs, hidden=128, experts=4, topk=2)
    try:
        row = 256
        # dispatch: x reads 2 tokens; 3 (token, destination) pairs; 2 tokens x 2 ranks x 2 routing words;
        # 4 landing rows routed here (2 per source); 2 x 2 routing words read per source; 5 slots here
        want = 2 * row + 3 * row + 2 * 2 * 2 * 4 + 4 * row + 2 * 2 * 2 * 4 + 5 * row
        assert em.floor_bytes("dispatch") == want
        # combine: rank 0's 2 slots here read and stored; rank 1's 4 routed slots read; y written
        assert em.floor_bytes("combine") == 2 * 2 * row + 4 * row + 2 * row
        em.check(em.dispatch(), em.combine())
    finally:
        em.close()


def test_skewed_routing_makes_the_measured_rank_the_busiest():
    gen = torch.Generator().manual_seed(1)
    world, rank, L = 4, 2, E // 4
    for kind, least, most in (("skewed", 0.5, 1.0), ("uniform", 0.15, 0.35)):
        idxs = ep_rank.routing(kind, world, rank, 64, E, K, gen)
        ids = torch.cat(idxs)
        assert all(len(set(row)) == K for row in ids.tolist())  # distinct experts per token
        share = float(((ids // L) == rank).float().mean())
        assert least <= share <= most, (kind, share)


@pytest.mark.ptx
def test_signal_peers_kernel_compiles_for_sm90_with_a_barrier_before_its_publish():
    for world, cw in ((8, 34), (64, 6)):
        rep = compile_one(KernelConfig(
            "bench.ep_rank", "signal_peers_kernel", f"EP{world}",
            dict(ctrl_ptr="*i64", staged_ptr="*i64", seq_ptr="*i64", grp="*i64", rank="i32"),
            dict(WORLD=world, WORLD_P2=world, CTRL_WORDS=cw, CW_P2=1 << (cw - 1).bit_length(), FLAG_WORD=cw - 1)), 90)
        assert rep["ordering_problems"] == [] and rep["publishes"] == 1 and rep["barriers"] >= 1
        assert rep["spill_store_bytes"] == 0
