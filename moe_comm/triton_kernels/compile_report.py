"""Compile every kernel ahead of time for a GPU target, with no GPU, and report ptxas's resource use.

    TRITON_INTERPRET=0 python -m moe_comm.triton_kernels.compile_report [--arch 90] [--json]

The interpreter (how CPU tests run kernels) accepts Python that the compiler rejects, so this is the
CPU-side proof that each kernel compiles to PTX and SASS for Hopper (sm_90). For each kernel and launch
configuration it prints registers per thread, spill bytes and shared memory as ptxas reports them
(``ptxas -v``). Run with TRITON_INTERPRET=0 (moe_comm only turns the interpreter on when it is unset).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class KernelConfig:
    """One kernel compiled with one set of argument types and constexprs."""

    module: str        # module under moe_comm.triton_kernels
    kernel: str        # @triton.jit function name
    label: str         # what configuration this is
    types: dict        # argument name -> Triton type string ("*i32", "i64", ...); constexprs get "constexpr"
    constexprs: dict   # constexpr argument name -> value


def _a2a_configs() -> list[KernelConfig]:
    ptrs = dict(counts_ptr="*i32", kept_counts_ptr="*i32", kept_offsets_ptr="*i64", seq_ptr="*i64")
    send = dict(src_ptr="*i32", data_ptrs_ptr="*i64", ctrl_ptrs_ptr="*i64", done_ptr="*i32", n_rows="i64",
                err_addr="i64", rank="i32", max_rows="i32", **ptrs)
    recv = dict(dst_ptr="*i32", recv_counts_ptr="*i32", data_ptr="*i32", ctrl_ptr="*i64", err_addr="i64",
                timeout_ns="i64", rank="i32", max_rows="i32", kept_counts_ptr="*i32", kept_offsets_ptr="*i64",
                seq_ptr="*i64")
    out = []
    # DeepSeek-V3-sized rows (7168 bf16 = 3584 words), EP8, GPU launch shape from the planner.
    import torch  # noqa: PLC0415

    from ..planner import plan_copy  # noqa: PLC0415
    cp = plan_copy(7168 * 2, 128, 8, torch.device("cuda"))
    for forward in (True, False):
        c = dict(OP=0 if forward else 1, FORWARD=forward, WORLD=8, ROW_WORDS=cp.row_words, BLOCK_R=cp.block_rows,
                 BLOCK_C=cp.block_words, NBLK=cp.blocks_per_peer)
        out.append(KernelConfig("alltoallv", "a2a_send_kernel", f"{'fwd' if forward else 'rev'} 7168 bf16 EP8",
                                send, dict(c, WORLD_P2=8)))
        out.append(KernelConfig("alltoallv", "a2a_recv_kernel", f"{'fwd' if forward else 'rev'} 7168 bf16 EP8",
                                recv, c))
        local = dict(src_ptr="*i32", counts_ptr="*i32", kept_counts_ptr="*i32", kept_offsets_ptr="*i64",
                     recv_counts_ptr="*i32", dst_ptr="*i32", n_rows="i64", err_addr="i64", rank="i32",
                     max_rows="i32")
        out.append(KernelConfig("alltoallv", "a2a_local_kernel", f"{'fwd' if forward else 'rev'} 7168 bf16 EP1",
                                local, {k: v for k, v in c.items() if k != "WORLD"}))
    return out


def _extra_configs() -> list[KernelConfig]:
    """Kernel configs that other op modules declare (``COMPILE_CONFIGS`` lists of KernelConfig kwargs)."""
    out = []
    for name in ("routing", "dispatch", "dispatch_local", "combine", "moe_comm.serving.experts",
                 "moe_comm.serving.attention"):
        try:
            mod = importlib.import_module(_module_path(name))
        except ImportError:
            continue
        for kw in getattr(mod, "COMPILE_CONFIGS", []):
            out.append(KernelConfig(module=name, **kw))
    return out


def _module_path(name: str) -> str:
    """Op modules of this package by short name; anything else (the serving kernels) by full path."""
    return name if "." in name else f"moe_comm.triton_kernels.{name}"


def all_configs() -> list[KernelConfig]:
    return _a2a_configs() + _extra_configs()


_PTXAS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def compile_one(cfg: KernelConfig, arch: int) -> dict:
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    fn = getattr(importlib.import_module(_module_path(cfg.module)), cfg.kernel)
    types = dict(cfg.types)
    types.update({k: "constexpr" for k in cfg.constexprs})
    missing = [a for a in fn.arg_names if a not in types]
    if missing:
        raise ValueError(f"{cfg.kernel}: no type given for {missing}")
    compiled = triton.compile(ASTSource(fn, types, cfg.constexprs), target=GPUTarget("cuda", arch, 32))
    ptxas = get_ptxas(arch).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        rep = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch == 90 else f"-arch=sm_{arch}", "-v", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True)
        rep = rep.stdout + rep.stderr
    finally:
        os.unlink(f.name)
    regs, spill, smem = _PTXAS_RE.search(rep), _SPILL_RE.search(rep), _SMEM_RE.search(rep)
    return dict(kernel=cfg.kernel, label=cfg.label, arch=f"sm_{arch}", num_warps=compiled.metadata.num_warps,
                registers=int(regs.group(1)) if regs else None,
                spill_store_bytes=int(spill.group(1)) if spill else None,
                spill_load_bytes=int(spill.group(2)) if spill else None,
                static_smem_bytes=int(smem.group(1)) if smem else 0,
                triton_shared_bytes=compiled.metadata.shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 is set: run with TRITON_INTERPRET=0 to compile", file=sys.stderr)
        return 2
    rows = [compile_one(c, a.arch) for c in all_configs()]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'kernel':<22} {'config':<28} {'warps':>5} {'regs':>5} {'spill st/ld':>12} {'smem':>7}")
    for r in rows:
        print(f"{r['kernel']:<22} {r['label']:<28} {r['num_warps']:>5} {r['registers']:>5} "
              f"{r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<6} {r['triton_shared_bytes']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

