"""DeepEP's normal mode across nodes through ``moe_comm.compat.deep_ep``, in the style of DeepEP's
tests/legacy/test_internode.py (commit dd758ca), on emulated nodes (``MOE_COMM_RANKS_PER_NODE``; every
cross-node byte travels as a message on the wire, docs/prefill.md "Across nodes").

What DeepEP's test checks, as it checks it: the layout (``get_dispatch_layout`` against the counts built
from ``topk_idx``, ``num_tokens_per_rdma_rank`` included), the receive (as many rows as the ranks sent
this rank, grouped by source rank in rank order: with ``x = rank`` each row holds its source's rank; local
ids in [-1, L) with the per-expert counts; weights), the combine (summed unweighted over the ranks
holding the token: divided by that count it gives x back, ``calc_diff`` < 5e-6), with group-limited
routing (each token's experts within ``num_topk_groups`` nodes: 1, and every node), random x synchronous
and x = rank asynchronous (DeepEP's test runs every pair; the interpreter makes each call cost seconds). Not DeepEP's: fp8 input
tuples, cached dispatch, ``num_worst_tokens`` (refused by name: tests/test_compat_deep_ep_normal.py) and
its benchmark. Added: the receive and the combine bitwise against ``moe_comm.reference`` (the combine in
the node order), and ``internode_dispatch`` / ``internode_combine`` called directly.

Run by tests/test_emulated_nodes.py (``internode_rank`` on 2 x 2 emulated nodes).
"""

from __future__ import annotations

import torch

from moe_comm import reference
from moe_comm.compat import deep_ep

NUM_TOKENS, HIDDEN, NUM_TOPK, EXPERTS_PER_RANK = 6, 128, 4, 4


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's deep_ep/utils/math.py ``calc_diff``: 1 - cosine-like similarity in float64."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """DeepEP's: ``scores`` [T, E] with the experts outside each token's selected groups zeroed."""
    num_tokens, num_experts = scores.shape
    scores = scores.view(num_tokens, num_groups, -1)
    mask = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=scores.device)
    mask = mask.scatter_(1, group_idx, True).unsqueeze(-1).expand_as(scores)
    return (scores * mask).view(num_tokens, num_experts)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """DeepEP's: each row's distinct non-negative values, descending, -1 after them."""
    assert x.dim() == 2
    mask = x < 0
    x_padded = x.masked_fill(mask, num_slots)
    bin_count = torch.zeros((x.size(0), num_slots + 1), dtype=x.dtype, device=x.device)
    bin_count.scatter_add_(1, x_padded, torch.ones_like(x_padded))
    bin_count = bin_count[:, :num_slots]
    sorted_bin_count, sorted_bin_idx = torch.sort(bin_count, dim=-1, descending=True)
    sorted_bin_idx.masked_fill_(sorted_bin_count == 0, -1)
    sorted_bin_idx = torch.sort(sorted_bin_idx, descending=True, dim=-1).values
    x[:, :].fill_(-1)
    valid_len = min(num_slots, x.size(1))
    x[:, :valid_len] = sorted_bin_idx[:, :valid_len]


def _routing(rank: int, num_ranks: int, num_nodes: int, num_topk_groups: int, seed: int):
    """Rank ``rank``'s scores and group-limited top-k, as DeepEP's test draws them (seeded per rank)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    num_experts = EXPERTS_PER_RANK * num_ranks
    scores = torch.randn((NUM_TOKENS, num_experts), generator=g, dtype=torch.float32).abs() + 1
    group_scores = scores.view(NUM_TOKENS, num_nodes, -1).amax(dim=-1)
    group_idx = torch.topk(group_scores, k=num_topk_groups, dim=-1, sorted=False).indices
    masked_scores = create_grouped_scores(scores, group_idx, num_nodes)
    topk_idx = torch.topk(masked_scores, NUM_TOPK, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    x_pure_rand = torch.randn((NUM_TOKENS, HIDDEN), generator=g, dtype=torch.float32).to(torch.bfloat16)
    w_pure_rand = torch.randn((NUM_TOKENS, NUM_TOPK), generator=g, dtype=torch.float32)
    return topk_idx, x_pure_rand, w_pure_rand


def internode_rank(group) -> list[str]:
    """One rank of DeepEP's internode test (module docstring) over a torch.distributed ProcessGroup (the
    door makes its CommGroup from it); returns the mismatches."""
    import torch.distributed as dist
    from moe_comm.topology import node_layout
    rank, num_ranks = group.rank, group.world_size
    num_local_ranks = node_layout(group.transports, rank).ranks_per_node
    num_nodes = num_ranks // num_local_ranks
    num_experts = EXPERTS_PER_RANK * num_ranks
    budget = deep_ep.Buffer.get_normal_size_hint(NUM_TOKENS, HIDDEN, num_ranks, num_experts, NUM_TOPK,
                                                 ranks_per_node=num_local_ranks)
    buffer = deep_ep.Buffer(dist.group.WORLD, budget, 0, low_latency_mode=False, explicitly_destroy=True)
    errs = []
    for round_, num_topk_groups in enumerate(sorted({1, min(num_nodes, 4)})):
        topk_idx, x_pure_rand, w_pure_rand = _routing(rank, num_ranks, num_nodes, num_topk_groups, round_)
        x = torch.ones((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16) * rank
        topk_weights = torch.ones((NUM_TOKENS, NUM_TOPK), dtype=torch.float32) * rank
        rank_idx = topk_idx // (num_experts // num_ranks)
        rank_idx.masked_fill_(topk_idx == -1, -1)
        inplace_unique(rank_idx, num_ranks)
        rdma_rank_idx = rank_idx // num_local_ranks
        rdma_rank_idx.masked_fill_(rank_idx == -1, -1)
        inplace_unique(rdma_rank_idx, num_nodes)

        # Expert meta
        num_tokens_per_expert = torch.zeros((num_experts, ), dtype=torch.int)
        for i in range(num_experts):
            num_tokens_per_expert[i] = (topk_idx == i).sum()
        gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
        dist.all_reduce(gbl_num_tokens_per_expert)

        # Rank layout meta
        num_tokens_per_rank = torch.empty((num_ranks, ), dtype=torch.int)
        num_tokens_per_rdma_rank = torch.empty((num_nodes, ), dtype=torch.int)
        token_idx_in_rank = torch.full((num_ranks, NUM_TOKENS), -1, dtype=torch.long)
        for i in range(num_ranks):
            num_tokens_per_rank[i] = (rank_idx == i).sum()
            token_sel = (rank_idx == i).max(dim=-1)[0]
            count = token_sel.sum().item()
            tokens = torch.sort(token_sel.to(torch.int), descending=True)[1]
            tokens[:count] = torch.sort(tokens[:count])[0]
            token_idx_in_rank[i][tokens[:count]] = torch.arange(count, dtype=torch.long)
        for i in range(num_nodes):
            num_tokens_per_rdma_rank[i] = (rdma_rank_idx == i).sum()
        token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
        is_token_in_rank = token_idx_in_rank >= 0
        gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
        dist.all_reduce(gbl_num_tokens_per_rank)
        sent = [torch.zeros_like(num_tokens_per_rank) for _ in range(num_ranks)]
        dist.all_gather(sent, num_tokens_per_rank)
        recv_gbl_rank_prefix_sum = torch.stack(sent)[:, rank].cumsum(0)   # DeepEP's handle[-4]

        ref_num_tokens_per_rank, ref_num_tokens_per_rdma_rank, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = \
            buffer.get_dispatch_layout(topk_idx, num_experts)
        if not (torch.equal(ref_num_tokens_per_rank, num_tokens_per_rank)
                and torch.equal(ref_num_tokens_per_rdma_rank, num_tokens_per_rdma_rank)
                and torch.equal(ref_num_tokens_per_expert, num_tokens_per_expert)
                and torch.equal(ref_is_token_in_rank, is_token_in_rank)):
            errs.append(f"rank {rank} groups {num_topk_groups}: layout")

        def check_data(check_x, tag):
            if not torch.equal(check_x.amin(dim=1), check_x.amax(dim=1)):
                errs.append(f"{tag}: a row is not constant")
                return
            check_start = 0
            for i in range(num_ranks):
                check_end = recv_gbl_rank_prefix_sum[i].item()
                if (check_x[check_start:check_end, :].int() - i).sum().item() != 0:
                    errs.append(f"{tag}: rows of source rank {i}")
                check_start = check_end

        for current_x, async_mode in ((x_pure_rand, False), (x, True)):   # (DeepEP's test: every pair)
            is_rand = current_x is x_pure_rand
            tag = f"rank {rank} groups {num_topk_groups} {'rand' if is_rand else 'x=rank'} async={async_mode}"
            weights = w_pure_rand if is_rand else topk_weights
            dispatch_args = dict(x=current_x, num_tokens_per_rank=num_tokens_per_rank,
                                 num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                                 num_tokens_per_expert=num_tokens_per_expert, config=buffer.get_dispatch_config(num_ranks),
                                 async_finish=async_mode, topk_idx=topk_idx, topk_weights=weights)
            dispatch = buffer.internode_dispatch if async_mode else buffer.dispatch
            recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = \
                dispatch(**dispatch_args)
            event.current_stream_wait() if async_mode else ()

            # Checks (DeepEP's)
            if gbl_num_tokens_per_rank[rank].item() != recv_x.size(0):
                errs.append(f"{tag}: {recv_x.size(0)} rows, {gbl_num_tokens_per_rank[rank].item()} sent here")
            if gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() != recv_num_tokens_per_expert_list:
                errs.append(f"{tag}: per-expert counts")
            if not is_rand:
                check_data(recv_x, tag)
            local = num_experts // num_ranks
            if (recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < local))).sum().item() \
                    != recv_topk_idx.numel():
                errs.append(f"{tag}: local ids out of range")
            for i, count in enumerate(recv_num_tokens_per_expert_list):
                if recv_topk_idx.eq(i).sum().item() != count:
                    errs.append(f"{tag}: count of local expert {i}")
            if not is_rand:
                w = recv_topk_weights.clone()
                w[recv_topk_idx.eq(-1)] = w.amax(dim=1, keepdim=True).expand_as(w)[recv_topk_idx.eq(-1)]
                check_data(w, tag + " weights")

            # Added: bitwise against the reference (every rank rebuilds every rank's inputs)
            gathered = [torch.zeros_like(current_x) for _ in range(num_ranks)]
            dist.all_gather(gathered, current_x)
            idxs = [_routing(r, num_ranks, num_nodes, num_topk_groups, round_)[0] for r in range(num_ranks)]
            ws = ([_routing(r, num_ranks, num_nodes, num_topk_groups, round_)[2] for r in range(num_ranks)]
                  if is_rand else [torch.ones_like(topk_weights) * r for r in range(num_ranks)])
            exp = reference.prefill_dispatch(gathered, idxs, ws, num_experts, NUM_TOKENS)
            v = exp[rank]["valid"]
            if not (torch.equal(recv_x, exp[rank]["x"][v]) and torch.equal(recv_topk_weights, exp[rank]["topk_weights"][v])):
                errs.append(f"{tag}: receive differs from moe_comm.reference")

            # Test combine (DeepEP's check; the rows as the experts' output: summed unweighted)
            combine = buffer.internode_combine if async_mode else buffer.combine
            combined_x, combined_topk_weights, event = combine(recv_x, handle, async_finish=async_mode)
            event.current_stream_wait() if async_mode else ()
            check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
            ref_x = x_pure_rand if is_rand else x
            if calc_diff(check_x, ref_x) >= 5e-6:
                errs.append(f"{tag}: combine calc_diff {calc_diff(check_x, ref_x)}")
            parts = [e["x"] for e in exp]   # each rank's rows, in place of its experts' outputs
            want = reference.prefill_combine(parts, idxs, num_experts, NUM_TOKENS, ranks_per_node=num_local_ranks)
            if not torch.equal(combined_x, want[rank]):
                errs.append(f"{tag}: combine differs from moe_comm.reference")
    buffer.destroy()
    return errs
