"""What one EP call launches, and what the GPU would run for it, at any checkout, on the CPU (no GPU).

    python bench/ptx_profile.py [--checkout DIR ...] [--world 1] [--tokens 1,128] [--dtypes bf16,fp8]
                                [--phases both,split] [--no-sass] [--json]

For each checkout (default: this tree; give several to compare them side by side) a child process
imports that checkout's ``moe_comm`` with Triton's interpreter off, builds a loopback world of
``--world`` ranks on the CPU with the planner's CUDA launch shapes (``plan_ep`` called with a CUDA
device) and makes one EPBuffer dispatch call at DeepSeek-V3 sizes (256 experts, hidden 7168, top-8,
``max_tokens_per_rank`` = T), after one warm-up call. Nothing runs on a device: every Triton launch is
recorded and skipped (``JITFunction.run`` / ``InterpretedFunction.run`` stubbed), and every torch op
the call makes is recorded (a ``TorchDispatchMode``; on a GPU each op that is not a view or an empty
allocation is at least one kernel launch). ``--phases``: ``both`` (one call, phase="both": what a
world-1 user and the nvshmem heap run) and ``split`` (phase="send" on every rank, then phase="recv":
what a loopback world is driven with, e.g. ``bench/kernels.py``'s world-1 fallback without nvshmem4py).

Then each recorded Triton launch of rank 0 is compiled for sm_90 exactly as Triton would specialize it
at that launch (its own binder over the recorded arguments: pointer alignment, integers equal to 1 or
divisible by 16), and ptxas and nvdisasm report what the floor analysis needs, per launch:

- launch shape: grid, programs, num_warps, the launch's block-size constexprs;
- ptxas: registers, spill bytes, shared memory;
- SASS: instructions in all; global loads/stores by width (LDG/STG .128 / .64 / 32-bit / .U16 / .U8),
  shared-memory accesses, barriers (BAR), atomics and reductions, shuffles;
- the same counts per top-level branch of the kernel body (``if blk == NBLK: ... elif ...``: in
  dispatch_local the bookkeeping program and the copy programs) and per loop (a backward branch in the
  SASS, named by the source line of its first instruction), from nvdisasm's line information.

These are static counts: a loop's body runs once per trip, so a program's dynamic count is the
straight-line part plus each loop's body times its trips (bench/NOTES.md section 22 does that
arithmetic for the world-1 dispatch). Nothing here is a timing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = dict(num_experts=256, hidden=7168, topk=8)   # DeepSeek-V3's MoE
ARCH = 90
# Constexprs that set a launch's block sizes and program counts (shown in the launch table).
SHAPE_CONSTEXPRS = ("BT", "BW", "BS", "BH", "ROUTE_T", "BINS", "FP8_GROUPS", "NBLK", "CAP", "ALIGNED")


# ---- the child: one checkout -----------------------------------------------------------------------

@contextlib.contextmanager
def launches_stubbed(log: list | None = None):
    """Within: every Triton kernel launch in this process does nothing (``JITFunction.run`` and
    ``InterpretedFunction.run``: argument binding, the compilation-cache lookup and the launch, or the
    interpreter's run of the grid); with ``log``, each appends (kernel name, args, kwargs, grid) to it."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415
    saved = [(cls, cls.__dict__["run"]) for cls in (JITFunction, InterpretedFunction)]

    def run(self, *args, grid, warmup, **kwargs):
        if log is not None:
            log.append((getattr(getattr(self, "fn", None), "__name__", "?"), args, kwargs, tuple(grid)))

    try:
        for cls, _ in saved:
            cls.run = run
        yield
    finally:
        for cls, original in saved:
            cls.run = original


HOST_READ = "_local_scalar_dense"   # .item() of a CPU tensor: the error word (pinned host memory on CUDA)


def device_ops(ops: list[str]) -> list[str]:
    """The recorded torch ops that launch device work on a GPU: all but the host reads of the error word,
    which lives in pinned host memory there (no device work)."""
    return [op for op in ops if op != HOST_READ]


def torch_op_recorder(log: list):
    """A TorchDispatchMode that appends the name of every aten op that would launch device work (not a
    view, not an allocation without a fill, not a metadata query), and of host reads (``HOST_READ``)."""
    import torch  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415
    no_kernel = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "alias", "is_contiguous",
                 "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "set_", "resize_"}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (getattr(func, "is_view", False) or name in no_kernel):
                log.append(name)
            return func(*args, **(kwargs or {}))
    return Recorder()


def find_kernel(name: str):
    """The compiled (``@triton.jit``) kernel ``name`` among the checkout's moe_comm.triton_kernels modules."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    import moe_comm.triton_kernels as tk  # noqa: PLC0415
    for m in pkgutil.iter_modules(tk.__path__):
        mod = importlib.import_module(f"moe_comm.triton_kernels.{m.name}")
        fn = getattr(mod, name, None)
        if isinstance(fn, JITFunction):
            return fn
    raise LookupError(f"kernel {name} not found in moe_comm.triton_kernels")


def record_call(world: int, tokens: int, fp8: bool, phases: str) -> tuple[list, list]:
    """(Triton launches, torch ops) of rank 0 for one dispatch call after a warm-up call."""
    import torch  # noqa: PLC0415

    import moe_comm  # noqa: PLC0415
    import moe_comm.ep as ep_mod  # noqa: PLC0415
    plan_ep = ep_mod.plan_ep
    # the CUDA launch shapes (the last positional argument is the device; the formats come by keyword)
    ep_mod.plan_ep = lambda *a, **formats: plan_ep(*a[:-1], "cuda", **formats)
    try:
        groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
        with launches_stubbed([]):
            bufs = [ep_mod.EPBuffer(g, SIZES["num_experts"], SIZES["hidden"], tokens, SIZES["topk"],
                                    dtype=torch.bfloat16, fp8_dispatch=fp8) for g in groups]
        gen = torch.Generator().manual_seed(0)
        x = [torch.randn(tokens, SIZES["hidden"], generator=gen).to(torch.bfloat16) for _ in groups]
        idx = [torch.stack([torch.randperm(SIZES["num_experts"], generator=gen)[:SIZES["topk"]]
                            for _ in range(tokens)]) for _ in groups]
        launches, ops = [], []

        def call(log_rank0):
            if phases == "both":
                with log_rank0():
                    bufs[0].dispatch(x[0], idx[0], phase="both")
                return
            for r, b in enumerate(bufs):
                with (log_rank0() if r == 0 else contextlib.nullcontext()):
                    b.dispatch(x[r], idx[r], phase="send")
            for r, b in enumerate(bufs):
                with (log_rank0() if r == 0 else contextlib.nullcontext()):
                    b.dispatch(phase="recv")

        sink: list = []
        with launches_stubbed(sink):
            call(contextlib.nullcontext)   # warm-up: allocation, launch tables
            sink.clear()

            @contextlib.contextmanager
            def log_rank0():
                n = len(sink)
                with torch_op_recorder(ops):
                    yield
                launches.extend(sink[n:])
            call(log_rank0)
        for b in bufs:
            if hasattr(b, "close"):
                b.close()
        return launches, ops
    finally:
        ep_mod.plan_ep = plan_ep


def compile_launch(name: str, args: tuple, kwargs: dict):
    """Compile kernel ``name`` for sm_90 as Triton's launcher would for these arguments."""
    import triton  # noqa: PLC0415
    from triton import knobs  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource, make_backend  # noqa: PLC0415
    from triton.runtime.jit import create_function_from_signature  # noqa: PLC0415

    fn = find_kernel(name)
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    for k in ("grid", "warmup"):
        kwargs.pop(k, None)
    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    key = (name, str(specialization), str(options))
    if key not in _COMPILED:
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        _COMPILED[key] = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                        options=options.__dict__)
    return fn, _COMPILED[key], {k: v for k, v in bound.items()}


_COMPILED: dict = {}   # (kernel, specialization, options) -> compiled kernel: the split and both calls share


_PTXAS = (re.compile(r"Used (\d+) registers"), re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads"),
          re.compile(r"(\d+) bytes smem"))


def ptxas_report(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([get_ptxas(ARCH).path, f"-arch=sm_{ARCH}a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    rep = out.stdout + out.stderr
    regs, spill, smem = (r.search(rep) for r in _PTXAS)
    return dict(registers=int(regs.group(1)), spill_store_bytes=int(spill.group(1)),
                spill_load_bytes=int(spill.group(2)), smem_bytes=int(smem.group(1)) if smem else 0)


# One SASS line: "/*0080*/   @!P0 LDG.E.128 R4, desc[UR6][R2.64] ;"
_SASS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def sass_instructions(cubin: bytes) -> list[dict]:
    """Every SASS instruction in order: offset, opcode, predicated?, its source (file, line) from the line
    information (the innermost location: Triton's line tables carry no inlining chain), the labels that
    point at it, and a branch's target label."""
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    nvdisasm = os.path.join(os.path.dirname(get_ptxas(ARCH).path), "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    out, where, labels = [], None, []
    for line in text.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels.append(m.group(1))
            continue
        m = _LINE.match(line)
        if m:
            where = (_this_tree(m.group(1)), int(m.group(2)))
            continue
        m = _SASS.match(line)
        if m:
            t = _TARGET.search(m.group(4))
            out.append(dict(offset=int(m.group(1), 16), pred=bool(m.group(2)), guard=(m.group(2) or "").strip(" @!"),
                            op=m.group(3), operands=m.group(4), where=where, labels=labels,
                            target=t.group(1) if t else None))
            labels = []
    return out


def _this_tree(path: str) -> str:
    """A line-table path as this checkout's file: Triton's cache is keyed by the source, not its path, so a
    kernel compiled first from another tree with the same source carries that tree's paths."""
    import moe_comm  # noqa: PLC0415
    head, sep, rest = path.rpartition("/moe_comm/")
    if sep:
        path = os.path.join(os.path.dirname(os.path.dirname(moe_comm.__file__)), "moe_comm", rest)
    return os.path.realpath(path)


def classify(op: str) -> str | None:
    """The counter a SASS opcode adds to besides the total (None: the total only)."""
    base, *mods = op.split(".")
    if base in ("LDG", "STG"):
        return f"{base}.{next((m for m in mods if m in ('128', '64', 'U8', 'S8', 'U16', 'S16')), '32')}"
    if base in ("LDS", "STS", "LDSM"):
        return "shared"
    if base == "BAR":
        return "BAR"
    if base in ("ATOMG", "ATOM", "RED", "REDG", "ATOMS"):
        return "atomic"
    if base == "MEMBAR":
        return "MEMBAR"
    if base in ("SHFL", "REDUX"):
        return "warp-reduce"
    return None


def counts(instrs: list[dict]) -> dict:
    c = collections.Counter(k for k in (classify(i["op"]) for i in instrs) if k)
    return dict(instructions=len(instrs), **dict(sorted(c.items())))


class Source:
    """Maps (file, line) to the @triton.jit function it lies in, and the kernel's lines to the branches of
    its body's top-level if/elif chains."""

    def __init__(self, fn):
        import inspect  # noqa: PLC0415
        self.kfile = os.path.realpath(fn.fn.__code__.co_filename)
        self._funcs: dict = {}
        src_lines, first = inspect.getsourcelines(fn.fn)
        body = ast.parse("".join(src_lines)).body[0].body
        self.branches = []   # (label, first line, last line) in file lines
        for node in body:
            while isinstance(node, ast.If):
                end = max(n.end_lineno for n in node.body)
                self.branches.append((ast.unparse(node.test), node.body[0].lineno + first - 1, end + first - 1))
                node = node.orelse[0] if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) else None

    def function(self, where) -> str:
        if where is None:
            return "?"
        path, line = where
        if path not in self._funcs:
            try:
                tree = ast.parse(open(path).read())
                self._funcs[path] = [(n.name, n.lineno, n.end_lineno) for n in ast.walk(tree)
                                     if isinstance(n, ast.FunctionDef)]
            except (OSError, SyntaxError):
                self._funcs[path] = []
        inner = [f for f in self._funcs[path] if f[1] <= line <= f[2]]
        name = min(inner, key=lambda f: f[2] - f[1])[0] if inner else "?"
        mod = os.path.splitext(os.path.basename(path))[0]
        return name if path == self.kfile else f"{'tl.' if '/triton/' in path else ''}{mod}.{name}"

    def branch(self, where) -> str | None:
        if where and where[0] == self.kfile:
            for label, lo, hi in self.branches:
                if lo <= where[1] <= hi:
                    return label
            return ""   # the kernel's own lines outside every branch (the prologue)
        return None


# ---- dependent round trips: an in-order issue model over the SASS of one branch ---------------------

NO_DEST = ("ST", "STG", "STS", "STL", "RED", "REDG", "BAR", "BRA", "EXIT", "MEMBAR", "ERRBAR", "CGAERRBAR",
           "WARPSYNC", "NOP", "CCTL", "FENCE", "BSSY", "BSYNC", "YIELD", "CALL", "RET", "DEPBAR")
PRED_SET = ("ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "R2P")    # write predicates only
GLOBAL_RESULT = ("LDG", "LD", "ATOMG", "ATOM")                        # a result one round trip later
_REG = re.compile(r"\b(U?R\d+|U?P[0-6T]|PR|RZ|URZ|PT|UPT)\b(\.64)?")
PREDS = [f"P{i}" for i in range(7)]


def _regs(tok: str, width: int = 1) -> list[str]:
    out = []
    for name, wide in _REG.findall(tok):
        if name in ("RZ", "URZ", "PT", "UPT"):
            continue
        if name == "PR":
            out += PREDS
            continue
        n = 2 if wide else width
        m = re.match(r"(U?R)(\d+)", name)
        out += [f"{m.group(1)}{int(m.group(2)) + j}" for j in range(n)] if m else [name]
    return out


def _operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def round_trips(instrs: list[dict], skip, describe=None) -> dict:
    """Global-memory round trips along ``instrs`` (one program's code in layout order, each loop body
    once; instructions for which ``skip(ins)``, e.g. the error-reporting code, left out), two ways:

    - ``dependent_loads``: the longest chain of global loads, each needing the value (address, mask or
      predicate) of the one before, that a global store waits for: what the code itself requires,
      whatever the schedule;
    - ``round_trips``: when the last global store issues, with in-order issue (a warp issues in program
      order and waits at the first instruction whose operand is not there yet): the schedule ptxas
      chose, where a load placed after an instruction that waits for another load waits too.

    A global load's (or returning atomic's) result arrives one round trip after it issues; everything
    else costs nothing. With ``describe`` (ins -> str), ``walk`` lists each global access with its issue
    time in the second sense."""
    depth, avail, now, last_depth, last_store, walk = {}, {}, 0, 0, 0, []
    for ins in instrs:
        if skip(ins):
            continue
        base = ins["op"].split(".")[0]
        ops = _operands(ins["operands"])
        ndest = 0
        if base not in NO_DEST:
            while ndest < len(ops) and re.fullmatch(r"!?U?P[0-6T]|PR", ops[ndest]):
                ndest += 1   # leading predicate destinations (SHFL, VOTE, LOP3 ... P0, R ...)
            if base not in PRED_SET and ndest < len(ops):
                ndest += 1   # the register destination
                while ndest < len(ops) and re.fullmatch(r"U?P[0-6T]", ops[ndest]):
                    ndest += 1   # carry-out predicates
        mods = ins["op"].split(".")
        width = 4 if "128" in mods else 2 if ("64" in mods or "WIDE" in mods) else 1
        dests = [r for o in ops[:ndest] for r in _regs(o, width if base not in PRED_SET else 1)]
        srcs = [r for o in ops[ndest:] for r in _regs(o)] + _regs(ins.get("guard") or "")
        load = 1 if base in GLOBAL_RESULT else 0
        d = max([0] + [depth.get(r, 0) for r in srcs])
        t = max([now] + [avail.get(r, 0) for r in srcs])
        now = t
        for r in dests:   # a predicated write may leave the old value: the later of the two
            depth[r] = max(depth.get(r, 0), d + load) if ins["pred"] else d + load
            avail[r] = max(avail.get(r, 0), t + load) if ins["pred"] else t + load
        if base in ("STG", "RED", "REDG", "ST", "ATOMG"):
            last_depth, last_store = max(last_depth, d), t
        if describe and base in GLOBAL_RESULT + ("STG", "RED", "REDG", "ST"):
            walk.append(f"{t} {ins['op']} ({describe(ins)})")
    return dict(dependent_loads_at_last_store=last_depth, round_trips_at_last_store=last_store,
                **({"walk": walk} if describe else {}))


_PROFILES: dict = {}
WALK = False   # --walk: keep each branch's global accesses with their issue times


def blocks_by_branch(instrs: list[dict], src: Source) -> list[str]:
    """The top-level branch of the kernel that each instruction belongs to, through the control-flow graph:
    a basic block holding kernel lines of one branch is that branch's; a block holding only inlined helper
    lines takes the branch of its neighbours in the graph (predecessors, then successors) when they agree."""
    leaders = {0}
    for j, ins in enumerate(instrs):
        if ins["labels"]:
            leaders.add(j)
        if ins["op"].startswith(("BRA", "EXIT", "RET")) and j + 1 < len(instrs):
            leaders.add(j + 1)
    starts = sorted(leaders)
    block_of = {}
    spans = [(s, (starts[k + 1] if k + 1 < len(starts) else len(instrs))) for k, s in enumerate(starts)]
    label_block = {}
    for b, (s, e) in enumerate(spans):
        for j in range(s, e):
            block_of[j] = b
        for lab in instrs[s]["labels"]:
            label_block[lab] = b
    succ = collections.defaultdict(set)
    for b, (s, e) in enumerate(spans):
        last = instrs[e - 1]
        if last["target"] in label_block:
            succ[b].add(label_block[last["target"]])
        ends = last["op"].startswith(("BRA", "EXIT", "RET")) and not last["pred"]
        if not ends and b + 1 < len(spans):
            succ[b].add(b + 1)
    pred = collections.defaultdict(set)
    for b, ss in succ.items():
        for t in ss:
            pred[t].add(b)
    label = {}
    for b, (s, e) in enumerate(spans):
        seen = collections.Counter(x for x in (src.branch(instrs[j]["where"]) for j in range(s, e)) if x)
        if seen:
            label[b] = seen.most_common(1)[0][0]
    changed = True
    while changed:
        changed = False
        for b in range(len(spans)):
            if b in label:
                continue
            for nb in (pred[b], succ[b]):
                got = {label[x] for x in nb if x in label}
                if len(got) == 1:
                    label[b] = got.pop()
                    changed = True
                    break
    return [label.get(block_of[j], "") for j in range(len(instrs))]


def profile(fn, compiled, sass: bool) -> dict:
    if id(compiled) in _PROFILES:
        return _PROFILES[id(compiled)]
    res = _PROFILES[id(compiled)] = dict(num_warps=compiled.metadata.num_warps, triton_shared_bytes=compiled.metadata.shared,
               **ptxas_report(compiled.asm["ptx"]))
    if not sass:
        return res
    instrs = sass_instructions(compiled.asm["cubin"])
    src = Source(fn)
    branch_of = blocks_by_branch(instrs, src)
    res["all"] = counts(instrs)
    res["branches"] = {}
    for label in [b[0] for b in src.branches] + [""]:
        mine = [i for i, b in zip(instrs, branch_of) if b == label]
        if not mine:
            continue
        funcs = collections.defaultdict(list)
        for i in mine:
            funcs[src.function(i["where"])].append(i)
        path = [i for i, b in zip(instrs, branch_of) if b in (label, "")]   # the prologue, then the branch
        res["branches"][label or "outside the branches"] = dict(
            counts(mine), **round_trips(path, lambda i: src.function(i["where"]).startswith("sync."),
                                        (lambda i: f"{src.function(i['where'])}:{i['where'][1] if i['where'] else '?'}")
                                        if WALK else None),
            functions={f: counts(v) for f, v in sorted(funcs.items(), key=lambda kv: -len(kv[1]))})
    index = {lab: j for j, i in enumerate(instrs) for lab in i["labels"]}
    loops = []
    for j, ins in enumerate(instrs):   # a backward branch closes a loop: [its target, the branch]
        t = index.get(ins["target"])
        if t is not None and t <= j:
            body = instrs[t:j + 1]
            ktext = open(src.kfile).read().splitlines()
            lines = {i["where"][1] for i in body if i["where"] and i["where"][0] == src.kfile
                     and not ktext[i["where"][1] - 1].lstrip().startswith("def ")}   # (the signature's line)
            head = (src.kfile, min(lines)) if lines else None
            text = ktext[head[1] - 1].strip() if head else ""
            if len(body) > 1:   # (not the trap loop after the last EXIT: a branch to itself)
                loops.append(dict(kernel_line=head[1] if head else None, source=text[:90], branch=branch_of[t],
                                  functions=sorted({src.function(i["where"]) for i in body}), counts=counts(body)))
    res["loops"] = loops
    return res


def child(o) -> None:
    import torch  # noqa: PLC0415
    torch.set_num_threads(1)
    for dtype in o.dtypes:
        for t in o.tokens:
            for phases in o.phases:
                launches, ops = record_call(o.world, t, dtype == "fp8", phases)
                line = dict(checkout=o.label, world=o.world, tokens=t, dtype=dtype, phases=phases,
                            torch_ops=ops, launches=[])
                for name, args, kwargs, grid in launches:
                    fn, compiled, bound = compile_launch(name, args, kwargs)
                    shape = {k: bound[k] for k in SHAPE_CONSTEXPRS if k in bound}
                    programs = 1
                    for g in grid:
                        programs *= g
                    line["launches"].append(dict(kernel=name, grid=list(grid), programs=programs, shape=shape,
                                                 **profile(fn, compiled, not o.no_sass)))
                print(json.dumps(line), flush=True)


# ---- the parent: tables -----------------------------------------------------------------------------

def checkout(arg: str) -> tuple[str, str]:
    """``PATH`` or ``LABEL=PATH`` of a source tree (or just its ``moe_comm`` package, e.g. ``git archive
    <commit> moe_comm | tar -x -C PATH``) -> (label, absolute path). The label defaults to the tree's
    commit (short, "+dirty" when tracked files differ) or, without git metadata, the folder's name."""
    label, sep, path = arg.rpartition("=")
    path = os.path.abspath(path)
    if not sep:
        git = lambda *a: subprocess.run(["git", "-C", path, *a], capture_output=True, text=True)  # noqa: E731
        top = git("rev-parse", "--show-toplevel").stdout.strip()
        if top and os.path.realpath(top) == os.path.realpath(path):
            dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
            label = git("rev-parse", "--short", "HEAD").stdout.strip() + ("+dirty" if dirty else "")
        else:
            label = os.path.basename(path)
    if not os.path.isfile(os.path.join(path, "moe_comm", "__init__.py")):
        raise SystemExit(f"{path}: no moe_comm package there")
    return label, path


def checkout_env(path: str, **extra) -> dict:
    """The environment of a child process that imports ``path``'s moe_comm (and writes no bytecode there)."""
    return dict(os.environ, PYTHONPATH=path, PYTHONDONTWRITEBYTECODE="1", **extra)


def run_checkout(arg: str, o) -> list[dict]:
    """This script's child mode in a process that imports the checkout's moe_comm."""
    label, path = checkout(arg)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--label", label, "--world", str(o.world),
           "--tokens", ",".join(map(str, o.tokens)), "--dtypes", ",".join(o.dtypes),
           "--phases", ",".join(o.phases)] + (["--no-sass"] if o.no_sass else []) + (["--walk"] if o.walk else [])
    out = subprocess.run(cmd, env=checkout_env(path, TRITON_INTERPRET="0"), cwd=path, capture_output=True,
                         text=True)
    if out.returncode:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"{path}: the child failed (exit {out.returncode})")
    return [json.loads(s) for s in out.stdout.splitlines() if s.startswith("{")]


def fmt_counts(c: dict) -> str:
    keys = [k for k in c if k not in ("instructions", "functions", "walk", "round_trips_at_last_store",
                                      "dependent_loads_at_last_store")]
    rt = (f"; stores wait for {c['dependent_loads_at_last_store']} dependent loads, the last store for "
          f"{c['round_trips_at_last_store']} round trips in issue order" if "round_trips_at_last_store" in c else "")
    return f"{c['instructions']:>5} instr  " + " ".join(f"{k} {c[k]}" for k in keys) + rt


def print_table(lines: list[dict]) -> None:
    for ln in lines:
        ops = collections.Counter(device_ops(norm(ln["torch_ops"])))
        reads = len(ln["torch_ops"]) - sum(ops.values())
        print(f"\n== {ln['checkout']}  world {ln['world']}  T {ln['tokens']}  {ln['dtype']}  phases {ln['phases']}: "
              f"{len(ln['launches'])} Triton launch(es) + {sum(ops.values())} torch op(s) of rank 0"
              + (f" ({', '.join(f'{k} x{v}' for k, v in ops.items())})" if ops else "")
              + (f"; {reads} host read(s) of the error word" if reads else ""))
        for la in ln["launches"]:
            print(f"  {la['kernel']}  grid {tuple(la['grid'])} = {la['programs']} programs, {la['num_warps']} warps, "
                  + " ".join(f"{k}={v}" for k, v in la["shape"].items()))
            print(f"    {la['registers']} registers, spill {la['spill_store_bytes']}/{la['spill_load_bytes']} B, "
                  f"shared {la['triton_shared_bytes']} B (ptxas smem {la['smem_bytes']} B)")
            if "all" not in la:
                continue
            print(f"    whole kernel: {fmt_counts(la['all'])}")
            for label, c in la["branches"].items():
                print(f"    branch `{label}`: {fmt_counts(c)}")
                for f, fc in c["functions"].items():
                    print(f"        {f:<34} {fmt_counts(fc)}")
                for w in c.get("walk", []):
                    print(f"          at {w}")
            for lp in la["loops"]:
                print(f"    loop (branch `{lp['branch']}`, kernel line {lp['kernel_line']}: {lp['source']})\n"
                      f"        {fmt_counts(lp['counts'])}; in {', '.join(lp['functions'])}")


def norm(ops: list[str]) -> list[str]:
    return [op.split(" ")[0] for op in ops]   # (lines saved by an earlier version named host reads at length)


def summary_rows(lines: list[dict]) -> list[str]:
    """One row per (checkout, dtype, T) and launched kernel: launches per call (phase="both" / split),
    launch shape, ptxas, and per top-level branch of the kernel: SASS instructions, barriers, dependent
    loads, round trips in issue order (see ``round_trips``)."""
    by = collections.defaultdict(dict)
    for ln in lines:
        by[(ln["checkout"], ln["dtype"], ln["tokens"])][ln["phases"]] = ln
    rows = []
    for (label, dtype, t), ph in by.items():
        calls = " ".join(f"{p} {len(ln['launches'])}+{len(device_ops(norm(ln['torch_ops'])))}" for p, ln in ph.items())
        reads = {len(ln["torch_ops"]) - len(device_ops(norm(ln["torch_ops"]))) for ln in ph.values()}
        calls += f" ({reads.pop()} host reads)" if reads != {0} and len(reads) == 1 else ""
        for la in next(iter(ph.values()))["launches"]:
            br = " | ".join(f"{b}: {c['instructions']} instr, BAR {c.get('BAR', 0)}, "
                            f"{c['dependent_loads_at_last_store']} dep, {c['round_trips_at_last_store']} rt"
                            for b, c in la.get("branches", {}).items() if b != "outside the branches")
            rows.append(f"{label:<14} {dtype:<4} T {t:<4} launches {calls:<17} {la['kernel']} {tuple(la['grid'])} "
                        f"{la['num_warps']}w {la['registers']}r spill {la['spill_store_bytes']} "
                        f"smem {la['triton_shared_bytes']} | {la.get('all', {}).get('instructions', '-')} instr | {br}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append",
                    help="PATH or LABEL=PATH of a source tree (repeatable; default: this one)")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 128])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp8"])
    ap.add_argument("--phases", type=lambda s: s.split(","), default=["both", "split"])
    ap.add_argument("--no-sass", action="store_true", help="launches and ptxas only (no disassembly)")
    ap.add_argument("--json", action="store_true", help="one JSON object per (checkout, point)")
    ap.add_argument("--summary", action="store_true",
                    help="one line per (checkout, dtype, T): launches per call (Triton + torch ops, "
                         "phase both / split), shape, registers, and per branch instructions, barriers, "
                         "dependent loads (dep) and round trips in issue order (rt)")
    ap.add_argument("--from-json", metavar="JSONL", action="append",
                    help="print the table or summary of lines saved by --json (no compile)")
    ap.add_argument("--walk", action="store_true",
                    help="list each branch's global loads and stores with their issue time (round trips)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    o = ap.parse_args(argv)
    if o.child:
        global WALK
        WALK = o.walk
        child(o)
        return 0
    if o.from_json:
        runs = [[json.loads(s) for f in o.from_json for s in open(f) if s.startswith("{")]]
    else:
        runs = (run_checkout(arg, o) for arg in o.checkout or [HERE])
    for lines in runs:
        if o.json:
            for ln in lines:
                print(json.dumps(ln))
        elif o.summary:
            print("\n".join(summary_rows(lines)))
        else:
            print_table(lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
