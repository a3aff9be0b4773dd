"""Compile every kernel ahead of time for a GPU target, with no GPU, and report ptxas's resource use.

    python -m moe_comm.triton_kernels.compile_report [--arch 90] [--json]

The interpreter (how CPU tests run kernels) accepts Python that the compiler rejects, so this is the
CPU-side proof that each kernel compiles to PTX and SASS for Hopper (sm_90). For each kernel and launch
configuration it prints registers per thread, spill bytes and shared memory as ptxas reports them
(``ptxas -v``). It needs Triton's interpreter off for the process (``TRITON_INTERPRET`` unset or 0):
moe-comm itself never turns it on.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from . import ptx_rules


@dataclass
class KernelConfig:
    """One kernel compiled with one set of argument types and constexprs."""

    module: str        # module under moe_comm.triton_kernels
    kernel: str        # @triton.jit function name
    label: str         # what configuration this is
    types: dict        # argument name -> Triton type string ("*i32", "i64", ...); constexprs get "constexpr"
    constexprs: dict   # constexpr argument name -> value
    nvshmem: bool = False  # carries NVSHMEM calls (PUT=True): compiled with NVSHMEM's device bitcode linked
    num_warps: int = 4     # as the launch passes it
    divisible: tuple = ()  # integer arguments specialized as multiples of 16, as a launch does (``launch_ints``)


def launch_ints(values: dict) -> tuple[dict, dict, tuple]:
    """(types, constexprs, divisible) of integer arguments with these values, as a Triton launch specializes
    them: a value of 1 becomes the constexpr 1, a multiple of 16 is known divisible by 16, a value past the
    int32 range is i64. A config built from a launch's real values compiles the variant that launch runs."""
    types, constexprs, divisible = {}, {}, []
    for name, v in values.items():
        if v == 1:
            constexprs[name] = 1
            continue
        types[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        if v % 16 == 0:
            divisible.append(name)
    return types, constexprs, tuple(divisible)


SIGNAL = dict(grp="*i64", status_ptr="*i64", rank="i32")   # every multi-rank kernel's group arguments
STAGE = dict(stage_ptr="*i32", stage_ctrl_ptr="*i64")      # every send kernel's put-transport staging


TRACE_TYPES = dict(trace_ptr="*i64", wait_ptr="*i64")   # the flight recorder's ring and wait statistics
TRACE_CALLS = 64                                         # ring size of the traced builds (moe_comm/trace)


def with_trace(cfg: KernelConfig) -> KernelConfig:
    """The same kernel and shapes with the flight recorder compiled in (``triton_kernels/trace.py``)."""
    return KernelConfig(cfg.module, cfg.kernel, cfg.label + " trace", cfg.types,
                        dict(cfg.constexprs, TRACE=True, TRACE_N=TRACE_CALLS), num_warps=cfg.num_warps)


def with_put(cfg: KernelConfig, nvshmem: bool = True) -> KernelConfig:
    """The same kernel and shapes with the put transport compiled in (NVSHMEM calls, bitcode linked: a send
    kernel's puts and signals, a waiting kernel's status broadcast; a receive kernel also reads the put
    layout), at the put plan's sizes
    (``EPPlan.with_put``: the token index word, the run-base control word, the sorted half of the
    combine landing zone)."""
    c = dict(cfg.constexprs, PUT=True)
    if {"S_WORDS", "TOPK", "ROW_WORDS"} <= c.keys():
        from ..planner import route_row_words  # noqa: PLC0415
        c["ROW_WORDS"] = route_row_words(c["X_WORDS"] + c["S_WORDS"], c["TOPK"], True)
    if {"CTRL_WORDS", "EXPERTS_PER_RANK"} <= c.keys():
        c["CTRL_WORDS"] = c["EXPERTS_PER_RANK"] + 3 + int(c.get("NVFP4", False))
    if "ZONE_SLOTS" in c:
        c["ZONE_SLOTS"] = 2 * c["M"] * c["TOPK"]
    return KernelConfig(cfg.module, cfg.kernel, cfg.label + " put", cfg.types, c, nvshmem=nvshmem,
                        num_warps=cfg.num_warps)


def _a2a_configs() -> list[KernelConfig]:
    """AllToAllvDynamic with DeepSeek-V3-sized rows (7168 bf16 = 3584 words), EP8 (and EP1), GPU plan."""
    import torch  # noqa: PLC0415

    from ..planner import plan_copy  # noqa: PLC0415
    ptrs = dict(counts_ptr="*i32", kept_counts_ptr="*i32", kept_offsets_ptr="*i64", seq_ptr="*i64")
    send = dict(src_ptr="*i32", dropped_ptr="*i64", data_ptrs_ptr="*i64", ctrl_ptrs_ptr="*i64", done_ptr="*i32",
                n_rows="i64", max_rows="i32", **SIGNAL, **ptrs, **STAGE)
    recv = dict(dst_ptr="*i32", recv_counts_ptr="*i32", kept_counts_ptr="*i32", kept_offsets_ptr="*i64",
                data_ptr="*i32", ctrl_ptr="*i64", seq_ptr="*i64", done_ptr="*i32", max_rows="i32", **SIGNAL)
    local = dict(src_ptr="*i32", counts_ptr="*i32", kept_counts_ptr="*i32", kept_offsets_ptr="*i64",
                 recv_counts_ptr="*i32", dst_ptr="*i32", dropped_ptr="*i64", n_rows="i64", grp="*i64", rank="i32",
                 max_rows="i32")
    cp = plan_copy(7168 * 2, 128, 8, torch.device("cuda"))
    out = []
    for forward in (True, False):
        c = dict(OP=0 if forward else 1, FORWARD=forward, ROW_WORDS=cp.row_words, BLOCK_R=cp.block_rows,
                 BLOCK_C=cp.block_words, NBLK=cp.blocks_per_peer, ALIGNED=cp.vector_rows)
        label = f"{'fwd' if forward else 'rev'} 7168 bf16"
        out.append(KernelConfig("alltoallv", "a2a_send_kernel", f"{label} EP8", send,
                                dict(c, WORLD=8, WORLD_P2=8, PUT=False)))
        out.append(KernelConfig("alltoallv", "a2a_recv_kernel", f"{label} EP8", recv, dict(c, WORLD=8, WORLD_P2=8)))
        out.append(KernelConfig("alltoallv", "a2a_local_kernel", f"{label} EP1", local, c))
    return out


# The dispatch payload formats compiled (dispatch_format, label): bf16, every fp8 scale format and nvfp4
# (``moe_comm.formats``); labels of fp8 formats contain "fp8", nvfp4's does not.
FORMATS = ((None, "bf16"), ("e4m3", "fp8"), ("e4m3-pow2", "fp8-pow2"), ("e4m3-ue8m0", "fp8-ue8m0"), ("nvfp4", "nvfp4"))


def _dispatch_plan(world: int, fmt: str | None, combine_format: str | None = None):
    """The DeepSeek-V3 decode EP plan (256 experts, hidden 7168, top-8, 128 tokens per rank) of a dispatch
    format (and combine format), with the GPU launch shapes."""
    import torch  # noqa: PLC0415

    from ..planner import plan_ep  # noqa: PLC0415
    return plan_ep(world, 256, 7168, 128, 8, torch.bfloat16, False, "cuda", fmt, combine_format)


def _quant_constexprs(p) -> dict:
    """The dispatch kernels' quantization constexprs of plan ``p``."""
    return dict(FP8=p.fp8, FP8_GROUPS=p.fp8_block_groups, SCALE=p.scale_mode, S_BLOCK=p.scale_block_words,
                NVFP4=p.nvfp4, NVFP4_GROUPS=p.nvfp4_block_groups)


def _ep_configs() -> list[KernelConfig]:
    """Dispatch and combine for DeepSeek-V3 decode (256 experts, hidden 7168, top-8, 128 tokens per rank),
    EP8 and EP1, bf16, every fp8 format and nvfp4 dispatch, bf16 and fp8 combine, with the planner's GPU
    launch shapes; the routing kernel; the abort kernel."""
    import torch  # noqa: PLC0415

    from ..planner import next_pow2  # noqa: PLC0415
    from .routing import histogram_bins  # noqa: PLC0415

    out, bins = [], histogram_bins(256)
    for fmt, name in FORMATS:
        p = _dispatch_plan(8, fmt)
        common = dict(WORLD=8, WORLD_P2=8, M=128, TOPK=8, TOPK_P2=8, EXPERTS_PER_RANK=p.experts_per_rank,
                      X_WORDS=p.x_words, S_WORDS=p.scale_words, ROW_WORDS=p.row_words,
                      CTRL_WORDS=p.dispatch_ctrl_words, OP=2)
        label = f"DSV3 EP8 {name}"
        out.append(KernelConfig("dispatch", "dispatch_send_kernel", label, dict(
            x_ptr="*bf16", idx_ptr="*i64", routed_ptr="*i32", excluded_ptr="*i64",
            slot_key_ptr="*i32", id_base_ptr="*i32", data_ptrs_ptr="*i64", ctrl_ptrs_ptr="*i64", seq_ptr="*i64", done_ptr="*i32", num_tokens="i32",
            num_experts="i32", gscale_ptr="*fp32", **SIGNAL, **STAGE), dict(
            common, HIDDEN=7168, BT=p.block_tokens, BW=p.send_block_words, ROUTE_T=p.route_tokens,
            BINS=bins, **_quant_constexprs(p), NBLK=p.send_programs, ALIGNED=True, PUT=False),
            num_warps=p.send_warps))
        out.append(KernelConfig("dispatch", "dispatch_recv_kernel", label, dict(
            out_x_ptr="*i32", out_scales_ptr="*i32", out_src_ptr="*i32", out_counts_ptr="*i32",
            row_of_ptr="*i32", src_tokens_ptr="*i32", runs_ptr="*i32", stats_ptr="*i64", arrival_ptr="*i64",
            data_ptr="*i32",
            ctrl_ptr="*i64", seq_ptr="*i64", done_ptr="*i32", **SIGNAL), dict(
            common, CAP=p.capacity, EXPERTS_P2=next_pow2(p.experts_per_rank),
            S_WORDS_P2=next_pow2(max(p.scale_words, 1)), BS=p.recv_block_slots, BW=p.recv_block_words,
            ALIGNED=True, NVFP4=p.nvfp4)))
        p1 = _dispatch_plan(1, fmt)
        out.append(KernelConfig("dispatch_local", "dispatch_local_kernel", f"DSV3 EP1 {name}", dict(
            x_ptr="*bf16", idx_ptr="*i64", out_x_ptr="*fp8e4nv" if p1.fp8 else "*i32",
            out_scales_ptr="*fp32" if p1.fp8 and p1.scale_dtype == torch.float32 else "*i32", out_src_ptr="*i32",
            out_counts_ptr="*i32", row_of_ptr="*i32", src_tokens_ptr="*i32", routed_ptr="*i32", stats_ptr="*i64",
            excluded_ptr="*i64",
            grp="*i64", num_tokens="i32", num_experts="i32", gscale_ptr="*fp32"), dict(
            OP=2, CAP=p1.capacity, TOPK=8, TOPK_P2=8, HIDDEN=7168, X_WORDS=p1.x_words, S_WORDS=p1.scale_words,
            BT=p1.block_tokens, BW=p1.send_block_words, ROUTE_T=p1.route_tokens, BINS=bins,
            **_quant_constexprs(p1), NBLK=p1.send_programs, ALIGNED=True),
            num_warps=p1.send_warps))
    for combine_fp8 in (False, True):
        p = _dispatch_plan(8, None, "e4m3" if combine_fp8 else None)
        fmt = "fp8" if combine_fp8 else "bf16"
        quant = dict(SLOT_WORDS=p.combine_words, FP8=combine_fp8)
        for world in (8, 1):
            pw = _dispatch_plan(world, None, "e4m3" if combine_fp8 else None)
            out.append(KernelConfig("combine", "combine_recv_kernel", f"DSV3 EP{world} {fmt}", dict(
                out_ptr="*bf16", weights_ptr="*fp32", routed_ptr="*i32", expert_out_ptr="*bf16", row_of_ptr="*i32",
                slot_key_ptr="*i32", id_base_ptr="*i32", data_ptr="*i32", ctrl_ptr="*i64", seq_ptr="*i64",
                done_ptr="*i32", num_tokens="i32", **SIGNAL), dict(
                OP=3, WORLD=world, WORLD_P2=world, M=128, ROWS=pw.experts_per_rank * pw.capacity, TOPK=8, TOPK_P2=8,
                HIDDEN=7168, BT=pw.block_tokens, BH=pw.block_hidden, NBLK=pw.reduce_programs, ALIGNED=True,
                ZONE_SLOTS=pw.combine_zone_slots, BINS=bins, **quant), num_warps=pw.reduce_warps))
        for world in (8, 1) if not combine_fp8 else (8,):   # with ready words (``ready=``), also at world 1
            pw = _dispatch_plan(world, None, "e4m3" if combine_fp8 else None)
            send = dict(expert_out_ptr="*bf16", row_of_ptr="*i32", src_tokens_ptr="*i32", runs_ptr="*i32",
                        data_ptrs_ptr="*i64", ctrl_ptrs_ptr="*i64", seq_ptr="*i64", done_ptr="*i32", **SIGNAL, **STAGE)
            c = dict(OP=3, WORLD=world, WORLD_P2=world, M=128, ROWS=pw.experts_per_rank * pw.capacity, TOPK=8,
                     TOPK_P2=8, X_WORDS=pw.out_words, BS=pw.block_slots,
                     BW=pw.out_block_words * 4 // pw.elem_size if combine_fp8 else pw.out_block_words,
                     NBLK=pw.recv_programs, ALIGNED=True, PUT=False, ZONE_SLOTS=pw.combine_zone_slots,
                     EXPERTS_PER_RANK=pw.experts_per_rank, EXPERTS_P2=next_pow2(pw.experts_per_rank), CAP=pw.capacity,
                     HIDDEN=7168, **quant)
            if world > 1:
                out.append(KernelConfig("combine", "combine_send_kernel", f"DSV3 EP{world} {fmt}", send,
                                        dict(c, ready_ptr=None)))
            if not combine_fp8:
                out.append(KernelConfig("combine", "combine_send_kernel", f"DSV3 EP{world} {fmt} ready",
                                        dict(send, ready_ptr="*i64"), c))
    for every in (False, True):   # ReadyWords.signal(ids), signal() (every local expert)
        out.append(KernelConfig("ready", "signal_kernel", "DSV3 EP8 32 local experts" + (" all" if every else ""),
                                dict(words_ptr="*i64", experts_ptr="*i64", n="i32", state_ptr="*i64",
                                     call_ptr="*i64"), dict(EXPERTS=32, BLOCK=32, ALL=every), num_warps=1))
    p = _dispatch_plan(8, None)
    out.append(KernelConfig("routing", "routing_kernel", "DSV3 EP8", dict(
        idx_ptr="*i64", expert_counts_ptr="*i32", rank_tokens_ptr="*i32", position_ptr="*i32",
        num_tokens="i32", num_experts="i32"), dict(
        WORLD=8, RANKS_P2=8, TOPK=8, TOPK_P2=8, EXPERTS_PER_RANK=32, BINS=256, CHUNK_T=4)))
    out.append(KernelConfig("sync", "abort_kernel", "EP8 dispatch channel", dict(
        ctrl_ptrs_ptr="*i64", send_seq_ptr="*i64", grp="*i64", rank="i32"), dict(
        CTRL_WORDS=p.dispatch_ctrl_words, FLAG_WORD=p.dispatch_ctrl_words - 1, WORLD=8, WORLD_P2=8)))
    out.append(KernelConfig("sync", "drain_kernel", "EP8 dispatch channel", dict(
        ctrl_ptr="*i64", recv_seq_ptr="*i64", grp="*i64", status_ptr="*i64", op="i64", rank="i32"), dict(
        CTRL_WORDS=p.dispatch_ctrl_words, FLAG_WORD=p.dispatch_ctrl_words - 1, WORLD=8, WORLD_P2=8)))
    out.append(KernelConfig("sync", "fail_group_kernel", "EP8 barrier timeout", dict(
        grp="*i64", code="i64", op="i64", rank="i32", peer="i32", bound="i64"), dict(WORLD=8, WORLD_P2=8)))
    return out


def _prefill_configs() -> list[KernelConfig]:
    """PrefillBuffer at DeepSeek-V3 prefill (256 experts, hidden 7168, top-8, 4096 tokens per rank), EP8 on
    one node, bf16 and every fp8 format quantized on the way, and pre-quantized fp8 input (float32 and packed
    UE8M0 scales), nvfp4, the bf16 and fp8 combine, with the planner's GPU launch shapes; and across nodes
    (the put path, NVSHMEM calls: docs/prefill.md "Across nodes"), EP32 as 4 nodes of 8 GPUs, bf16 and fp8
    dispatch, bf16 combine (PrefillBuffer refuses nvfp4 and the fp8 combine across nodes)."""
    import torch  # noqa: PLC0415

    from ..errors import op_id  # noqa: PLC0415
    from ..planner import next_pow2, plan_prefill  # noqa: PLC0415
    from .routing import histogram_bins  # noqa: PLC0415

    out, m = [], 4096
    ctrl = dict(ctrl_ptr="*i64", ctrl_ptrs_ptr="*i64", seq_ptr="*i64")
    for world, put in ((8, False), (32, True)):
        w = dict(WORLD=world, WORLD_P2=next_pow2(world))
        sends = ([(fmt, name, False) for fmt, name in FORMATS if fmt in (None, "e4m3")] if put else
                 [(fmt, name, False) for fmt, name in FORMATS] + [("e4m3", "fp8 prequantized", True),
                                                                  ("e4m3-ue8m0", "fp8-ue8m0 prequantized", True)])
        for fmt, name, prequant in sends:
            p = plan_prefill(world, 256, 7168, m, 8, torch.bfloat16, False, "cuda", ranks_per_node=8 if put else None,
                             dispatch_format=fmt)
            ep = p.ep
            nodes = dict(PUT=put, G=p.ranks_per_node, G_P2=next_pow2(p.ranks_per_node))
            route = dict(ROUTE_OFFSET=p.route_offset if put else 0, RW=p.route_words)
            label = f"DSV3 EP{world} M{m} {name}" + (" nodes of 8" if put else "")
            out.append(KernelConfig("prefill_dispatch", "prefill_dispatch_send_kernel", label, dict(
                x_ptr="*u8" if prequant else "*bf16", scales_ptr="*i32", idx_ptr="*i64", weights_ptr="*fp32",
                routed_ptr="*i32", excluded_ptr="*i64", data_ptrs_ptr="*i64", ctrl_ptrs_ptr="*i64",
                released_ptr="*i64", combine_seq_ptr="*i64", seq_ptr="*i64", done_ptr="*i32", stamp_ptr="*i64",
                stage_ptr="*i32", stage_ctrl_ptr="*i64", num_tokens="i32", num_experts="i32", gscale_ptr="*fp32",
                **SIGNAL), dict(
                w, OP=op_id("prefill.dispatch"), M=m, TOPK=8, TOPK_P2=8, EXPERTS_PER_RANK=ep.experts_per_rank,
                HIDDEN=7168, X_WORDS=ep.x_words, S_WORDS=ep.scale_words, X_OFFSET=p.x_offset,
                CTRL_WORDS=p.dispatch_ctrl_words, BT=ep.block_tokens, BW=ep.send_block_words,
                ROUTE_T=ep.route_tokens, BINS=histogram_bins(256), **_quant_constexprs(ep), PREQUANT=prequant,
                NBLK=ep.send_programs,
                ALIGNED=True, NODES=p.nodes, NODES_P2=next_pow2(p.nodes), COUNT_SPAN=p.count_span, **route,
                **nodes), nvshmem=put, num_warps=ep.send_warps))
            if put:
                out.append(KernelConfig("prefill_dispatch", "prefill_dispatch_pull_kernel", label, dict(
                    data_ptrs_ptr="*i64", src_tokens_ptr="*i32", stamp_ptr="*i64", done_ptr="*i32", **ctrl,
                    **SIGNAL), dict(
                    w, OP=op_id("prefill.dispatch"), M=m, TOPK=8, TOPK_P2=8, EXPERTS_PER_RANK=ep.experts_per_rank,
                    X_WORDS=ep.x_words, S_WORDS=ep.scale_words, X_OFFSET=p.x_offset, CTRL_WORDS=p.dispatch_ctrl_words,
                    BT=p.pull_tokens, BW=p.pull_words, S_BW=next_pow2(max(1, ep.scale_words)),
                    ALIGNED=True, **route, **nodes), nvshmem=put))
        for fmt in (None,) if put else (None, "nvfp4"):   # nvfp4: the sources' global scales checked (one node)
            p = plan_prefill(world, 256, 7168, m, 8, torch.bfloat16, False, "cuda", ranks_per_node=8 if put else None,
                             dispatch_format=fmt)
            out.append(KernelConfig("prefill_dispatch", "prefill_dispatch_recv_kernel", f"DSV3 EP{world} M{m}" + (
                " nodes of 8" if put else " nvfp4" if fmt else ""), dict(
                src_tokens_ptr="*i32", counts_ptr="*i32", stats_ptr="*i64", **ctrl, **SIGNAL), dict(
                w, OP=op_id("prefill.dispatch"), M=m, TOPK=8, EXPERTS_PER_RANK=p.ep.experts_per_rank,
                EXPERTS_P2=next_pow2(p.ep.experts_per_rank), CTRL_WORDS=p.dispatch_ctrl_words, NVFP4=p.ep.nvfp4,
                **nodes), nvshmem=put))
        for combine in (None,) if put else (None, "e4m3"):   # the fp8 combine is one node only
            p = plan_prefill(world, 256, 7168, m, 8, torch.bfloat16, False, "cuda", ranks_per_node=8 if put else None,
                             combine_format=combine)
            ep, fp8 = p.ep, combine is not None
            label = f"DSV3 EP{world} M{m} {'fp8' if fp8 else 'bf16'}" + (" nodes of 8" if put else "")
            out.append(KernelConfig("prefill_combine", "prefill_combine_send_kernel", label, dict(
                expert_out_ptr="*bf16", zone_ptr="*i32", src_tokens_ptr="*i32", ctrl_ptrs_ptr="*i64", seq_ptr="*i64",
                done_ptr="*i32", **SIGNAL), dict(
                w, M=m, TOPK=8, TOPK_P2=8, OUT_WORDS=ep.out_words, X_OFFSET=p.x_offset, BR=p.copy_rows,
                BW=p.copy_words * 4 // ep.elem_size if fp8 else p.copy_words, NBLK=p.copy_programs, IN_PLACE=False,
                ALIGNED=True, ROW_WORDS=ep.combine_words, HIDDEN=7168, FP8=fp8, **nodes), nvshmem=put))
            if put:
                out.append(KernelConfig("prefill_combine", "prefill_combine_forward_kernel", label, dict(
                    rows_ptr="*bf16", zone_ptr="*i32", data_ptrs_ptr="*i64", inbox_ptr="*bf16", src_tokens_ptr="*i32",
                    stamp_ptr="*i64", done_ptr="*i32", **ctrl, **SIGNAL), dict(
                    w, OP=op_id("prefill.combine"), M=m, TOPK=8, TOPK_P2=8, EXPERTS_PER_RANK=ep.experts_per_rank,
                    HIDDEN=7168, OUT_WORDS=ep.out_words, X_OFFSET=p.x_offset, BT=ep.block_tokens, BH=ep.block_hidden,
                    ALIGNED=True, **route, **nodes), nvshmem=put))
            out.append(KernelConfig("prefill_combine", "prefill_combine_recv_kernel", label, dict(
                out_ptr="*bf16", routed_ptr="*i32", data_ptrs_ptr="*i64", inbox_ptr="*bf16", done_ptr="*i32",
                num_tokens="i32", **ctrl, **SIGNAL), dict(
                w, OP=op_id("prefill.combine"), M=m, TOPK=8, TOPK_P2=8, HIDDEN=7168, ROW_BYTES=ep.combine_words * 4,
                X_OFFSET=p.x_offset, BT=ep.block_tokens, BH=ep.block_hidden, NBLK=ep.reduce_programs, ALIGNED=True,
                FP8=fp8, **nodes), nvshmem=put, num_warps=ep.reduce_warps))
        out.append(KernelConfig("prefill_combine", "prefill_release_kernel", f"EP{world}" + (
            " nodes of 8" if put else ""), dict(ctrl_ptrs_ptr="*i64", send_seq_ptr="*i64", grp="*i64", rank="i32"),
            dict(w, **nodes), nvshmem=put))
    out.append(KernelConfig("capacity", "check_capacity_kernel", "DeepEP num_worst_tokens", dict(
        count_ptr="*i64", grp="*i64", rank="i32", bound="i32"), dict(OP=op_id("deep_ep.dispatch")), num_warps=1))
    return out


PUT_CONFIGS = {  # (kernel, label) of the store-path configs compiled again with the put transport: the send
    # kernels (puts of rows, signals), and every kernel whose failed wait (or host-found error) broadcasts
    # the status record to the peers reached by puts (the receive kernels also read the put layout)
    ("a2a_send_kernel", "fwd 7168 bf16 EP8"), ("dispatch_send_kernel", "DSV3 EP8 bf16"),
    ("combine_send_kernel", "DSV3 EP8 bf16"), ("combine_send_kernel", "DSV3 EP8 fp8"),
    ("combine_send_kernel", "DSV3 EP8 bf16 ready"), ("abort_kernel", "EP8 dispatch channel"),
    ("a2a_recv_kernel", "fwd 7168 bf16 EP8"), ("dispatch_recv_kernel", "DSV3 EP8 bf16"),
    ("dispatch_recv_kernel", "DSV3 EP8 nvfp4"),   # EPBuffer's nvfp4 runs across nodes: the scales' check
    ("combine_recv_kernel", "DSV3 EP8 bf16"), ("drain_kernel", "EP8 dispatch channel"),
    ("fail_group_kernel", "EP8 barrier timeout")}


def put_configs(base: list[KernelConfig]) -> list[KernelConfig]:
    return [with_put(c) for c in base if (c.kernel, c.label) in PUT_CONFIGS]


TRACE_CONFIGS = {  # (kernel, label) of the configs compiled again with the flight recorder on
    ("a2a_send_kernel", "fwd 7168 bf16 EP8"), ("a2a_recv_kernel", "fwd 7168 bf16 EP8"),
    ("dispatch_send_kernel", "DSV3 EP8 bf16"), ("dispatch_recv_kernel", "DSV3 EP8 bf16"),
    ("combine_send_kernel", "DSV3 EP8 bf16"), ("combine_recv_kernel", "DSV3 EP8 bf16")}


def trace_configs(base: list[KernelConfig]) -> list[KernelConfig]:
    return [with_trace(c) for c in base if (c.kernel, c.label) in TRACE_CONFIGS]


def _extra_configs() -> list[KernelConfig]:
    """Kernel configs that the serving modules and the fused MoE layer's kernels declare (``COMPILE_CONFIGS``
    lists of KernelConfig kwargs)."""
    out = []
    for name in ("moe_comm.serving.experts", "moe_comm.serving.attention", "moe_comm.triton_kernels.moe_gate_up",
                 "moe_comm.triton_kernels.moe_down_combine"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for kw in getattr(mod, "COMPILE_CONFIGS", []):
            out.append(KernelConfig(module=name, **kw))
    return out


def _module_path(name: str) -> str:
    """Op modules of this package by short name; anything else (the serving kernels) by full path."""
    return name if "." in name else f"moe_comm.triton_kernels.{name}"


def all_configs(put: bool = True) -> list[KernelConfig]:
    """Every kernel configuration; with ``put``, also the put-transport variants (NVSHMEM calls), which
    need NVSHMEM's device bitcode (``nvshmem_bitcode.py``)."""
    base = _a2a_configs() + _ep_configs() + _prefill_configs() + _copy_configs() + _extra_configs()
    own_put = [c for c in base if c.nvshmem]   # configs that are put variants by themselves (prefill across nodes)
    base = [c for c in base if not c.nvshmem]
    return base + trace_configs(base) + (put_configs(base) + own_put if put else [])


def _copy_configs() -> list[KernelConfig]:
    """The ops path's counts-driven row copy at DeepSeek-V3 EP8 (32 local experts, 1024 rows of capacity):
    bf16 rows (3584 words) and their src indices (1 word)."""
    import torch  # noqa: PLC0415

    from .copy_rows import tile  # noqa: PLC0415

    out, cuda = [], torch.device("cuda")
    for label, words in (("DSV3 EP8 x bf16", 3584), ("DSV3 EP8 src", 1)):
        br, bw = tile(1024, words, cuda)
        out.append(KernelConfig("copy_rows", "copy_valid_rows_kernel", label, dict(
            src_ptr="*i32", dst_ptr="*i32", counts_ptr="*i32"), dict(ROWS=1024, ROW_WORDS=words, BR=br, BW=bw,
                                                                   ALIGNED=words % 4 == 0)))
    return out


_PTXAS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
PTXAS_REPORT_FILE = "ptxas_v.txt"   # the name of a cached ``ptxas -v`` report in its Triton cache entry


def ptxas_report(ptxas: str, arch_flag: str, ptx: str) -> str:
    """What ``ptxas -v`` prints for ``ptx``, kept in Triton's cache like Triton's own compiles (keyed by the
    ptxas binary, its arguments and the PTX): an unchanged kernel is assembled once per machine, not on
    every report (77 kernels: about 20 CPU-seconds)."""
    from triton.runtime.cache import get_cache_manager  # noqa: PLC0415
    st = os.stat(ptxas)
    key = hashlib.sha256(f"{ptxas}|{st.st_size}|{st.st_mtime_ns}|{arch_flag}|-v|".encode() + ptx.encode())
    cache = get_cache_manager(key.hexdigest())
    cached = cache.get_file(PTXAS_REPORT_FILE)
    if cached is not None:
        with open(cached) as f:
            return f.read()
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, arch_flag, "-v", f.name, "-o", os.devnull], capture_output=True, text=True,
                             check=True)
    finally:
        os.unlink(f.name)
    rep = out.stdout + out.stderr
    cache.put(rep, PTXAS_REPORT_FILE, binary=False)
    return rep


def compile_one(cfg: KernelConfig, arch: int) -> dict:
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    fn = getattr(importlib.import_module(_module_path(cfg.module)), cfg.kernel)
    constexprs = dict(cfg.constexprs)
    if "PUT" in fn.arg_names:
        constexprs.setdefault("PUT", False)   # the store-only build unless the config says otherwise
    if "COPY" in fn.arg_names:                # receives that write d.x, unless the config says otherwise
        constexprs.setdefault("COPY", True)
    if "TRACE" in fn.arg_names:               # the untraced build unless the config says otherwise
        constexprs.setdefault("TRACE", False)
        constexprs.setdefault("TRACE_N", TRACE_CALLS)
    types = {a: t for a, t in TRACE_TYPES.items() if a in fn.arg_names}
    types.update(cfg.types)
    types.update({k: "constexpr" for k in constexprs})
    missing = [a for a in fn.arg_names if a not in types]
    if missing:
        raise ValueError(f"{cfg.kernel}: no type given for {missing}")
    options = dict(num_warps=cfg.num_warps)
    if cfg.nvshmem:
        from .nvshmem_bitcode import launch_options  # noqa: PLC0415
        options.update(launch_options(arch))
    # Pointer arguments 16-byte aligned, as Triton specializes them at launch for torch's allocations.
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if types[a].startswith("*") or a in cfg.divisible}
    compiled = triton.compile(ASTSource(fn, types, constexprs, aligned), target=GPUTarget("cuda", arch, 32),
                              options=options)
    rep = ptxas_report(get_ptxas(arch).path, f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}",
                       compiled.asm["ptx"])
    regs, spill, smem = _PTXAS_RE.search(rep), _SPILL_RE.search(rep), _SMEM_RE.search(rep)
    args = [a for a in fn.arg_names if a not in constexprs]
    ptx = compiled.asm["ptx"]
    return dict(kernel=cfg.kernel, label=cfg.label, arch=f"sm_{arch}", num_warps=compiled.metadata.num_warps,
                nvshmem=cfg.nvshmem, nvshmem_linked="nvshmemi_device_state_d" in ptx,
                trace=bool(constexprs.get("TRACE", False)),
                ordering_problems=ptx_rules.check(ptx, cfg.kernel, args),
                divergent_barriers=ptx_rules.divergent_barriers(ptx, cfg.kernel, args), **ptx_rules.counts(ptx),
                registers=int(regs.group(1)) if regs else None,
                spill_store_bytes=int(spill.group(1)) if spill else None,
                spill_load_bytes=int(spill.group(2)) if spill else None,
                static_smem_bytes=int(smem.group(1)) if smem else 0,
                triton_shared_bytes=compiled.metadata.shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    ap.add_argument("--only", action="append", help="compile only this kernel (repeatable)")
    ap.add_argument("--no-put", action="store_true",
                    help="skip the put-transport variants (they need NVSHMEM's device bitcode)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 is set: unset it (or set 0) to compile", file=sys.stderr)
        return 2
    if not a.no_put:
        from .nvshmem_bitcode import NvshmemSetupError, launch_options  # noqa: PLC0415
        try:
            launch_options(a.arch)
        except NvshmemSetupError as e:
            print(f"put-transport variants not compiled: {e} (--no-put to skip them)", file=sys.stderr)
            return 3
    rows = [compile_one(c, a.arch) for c in all_configs(not a.no_put) if not a.only or c.kernel in a.only]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'kernel':<22} {'config':<28} {'warps':>5} {'regs':>5} {'spill st/ld':>12} {'smem':>7} "
          f"{'publish':>7} {'acquire':>7} {'ordering':>8} {'uniform':>8}")
    for r in rows:
        print(f"{r['kernel']:<22} {r['label']:<28} {r['num_warps']:>5} {r['registers']:>5} "
              f"{r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<6} {r['triton_shared_bytes']:>7} "
              f"{r['publishes']:>7} {r['acquires']:>7} {'ok' if not r['ordering_problems'] else 'VIOLATED':>8} "
              f"{'ok' if not r['divergent_barriers'] else 'VIOLATED':>8}")
        for p in r["ordering_problems"] + r["divergent_barriers"]:
            print(f"    {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

