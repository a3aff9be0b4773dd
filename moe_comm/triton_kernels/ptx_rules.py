"""Memory-ordering and block-uniformity rules checked on the PTX of every kernel (compiled for sm_90 on
the CPU).

Triton's interpreter runs each statement's stores before the next, and one thread per program, so it
cannot show an ordering bug or threads of a program that disagree; the compiled code can have either.
Three rules, the first two checked on the PTX text in program order, the third on its control flow
(``divergent_barriers``, below):

1. **A CTA barrier before every publish.** A release atomic (``atom``/``red`` with ``.release`` or
   ``.acq_rel``, or ``st.release``) is issued by one thread and orders only what that thread did: the other
   warps' stores reach it through a ``bar.sync``. Walking back from each publish, a ``bar.sync`` must come
   before any global store.
2. **The acquire before the reads it guards.** After each acquire atomic (a wait's poll, or an
   ``arrive``), walking forward, a ``bar.sync`` must come before any global load of data. Loads of the
   signalling state itself (addresses computed from the kernel's ``grp`` / ``status_ptr`` arguments, or
   loaded from them: the group state, status tags, the error word) are the wait's own bookkeeping and do
   not count.

The walk is linear (it crosses branches and labels), which is what the kernels are written for: the
barrier sits right before each publish and right after each wait, in the same block.

3. **Every barrier is reached by every thread alike.** No CTA barrier and no block-wide NVSHMEM call under
   a branch (or guard) whose predicate depends, per thread, on a timer read or a volatile, relaxed or
   acquire load, or on a plain load of a word another channel's kernels write (``OTHER_CHANNEL_PARAMS``:
   those kernels may run on another stream, so the word may change under this one) (``triton_kernels/sync.py``
   says which values are block-uniform and why).
"""

from __future__ import annotations

import re

PUBLISH = re.compile(r"\b(?:atom|red)\.[\w.]*\b(?:release|acq_rel)\b|\bst\.[\w.]*release\b")
ACQUIRE = re.compile(r"\batom\.[\w.]*\b(?:acquire|acq_rel)\b|\bld\.[\w.]*acquire\b")
BARRIER = re.compile(r"\b(?:bar|barrier)\.sync\b")
GLOBAL_STORE = re.compile(r"\bst\.(?:[\w]+\.)*global\b")
GLOBAL_LOAD = re.compile(r"\bld\.(?:[\w]+\.)*global\b")
PARAM_LOAD = re.compile(r"ld\.param\.\w+\s+(%\w+),\s*\[(\w+)\]")
ADDR = re.compile(r"\[\s*(%\w+)")
DEST_SRCS = re.compile(r"^\s*(?:@!?%\w+\s+)?[\w.]+\s+(%\w+),\s*(.*);")
REG = re.compile(r"%\w+")
CONTROL_PARAMS = ("grp", "status_ptr")
# Kernel parameters pointing to words another channel's kernels write, which may run at the same time on
# another stream (``prefill_dispatch_send_kernel`` reads the combine channel's receive count and released
# words: with overlapped zones the combine's receive stores them while the next dispatch's send runs). A
# plain load through them is per thread (rule 3): read them with ``sync.read_once`` or an acquire wait.
OTHER_CHANNEL_PARAMS = ("combine_seq_ptr", "released_ptr")


MATCHERS = []   # (pattern, hint, matcher) of every line test below (tests/test_compile_sm90.py checks the hints)


def _matcher(pattern: re.Pattern, hint: str):
    """``pattern.search(line)`` as a bool, not run on lines without ``hint`` (a substring of every match):
    most PTX lines hold none, and ``in`` costs a fraction of a search."""
    def matches(line: str) -> bool:
        return hint in line and pattern.search(line) is not None
    MATCHERS.append((pattern, hint, matches))
    return matches


is_publish = _matcher(PUBLISH, "rel")        # .release / .acq_rel
is_acquire = _matcher(ACQUIRE, "acq")        # .acquire / .acq_rel
is_barrier = _matcher(BARRIER, ".sync")
is_global_store = _matcher(GLOBAL_STORE, "global")
is_global_load = _matcher(GLOBAL_LOAD, "global")


def _control_registers(lines: list[str], kernel: str, arg_names: list[str], names=CONTROL_PARAMS) -> set[str]:
    """Registers holding an address derived from (or loaded through) the parameters ``names`` (by default
    the control parameters)."""
    params = {f"{kernel}_param_{i}" for i, a in enumerate(arg_names) if a in names}
    regs = {m.group(1) for m in map(PARAM_LOAD.search, lines) if m and m.group(2) in params}
    if not regs:
        return regs
    defs = [(m.group(1), REG.findall(m.group(2))) for m in map(DEST_SRCS.match, lines) if m]   # parsed once
    changed = True
    while changed:
        changed = False
        for dest, srcs in defs:
            if dest not in regs and any(r in regs for r in srcs):
                regs.add(dest)
                changed = True
    return regs


def check(ptx: str, kernel: str, arg_names: list[str]) -> list[str]:
    """Violations of the two rules in ``ptx`` (the kernel ``kernel`` with non-constexpr arguments
    ``arg_names`` in order), as readable strings; [] if none."""
    lines = ptx.splitlines()
    control = _control_registers(lines, kernel, arg_names)
    problems = []
    for i, line in enumerate(lines):
        publish = is_publish(line)
        if publish:
            for j in range(i - 1, -1, -1):
                if is_barrier(lines[j]):
                    break
                if is_global_store(lines[j]):
                    problems.append(f"publish at line {i + 1} ({line.strip()}) follows the store at line "
                                    f"{j + 1} ({lines[j].strip()}) with no CTA barrier between")
                    break
        if not publish and is_acquire(line):
            for j in range(i + 1, len(lines)):
                if is_barrier(lines[j]):
                    break
                if is_global_load(lines[j]) and not is_acquire(lines[j]):
                    addr = ADDR.search(lines[j])
                    if addr and addr.group(1) in control:
                        continue
                    problems.append(f"load at line {j + 1} ({lines[j].strip()}) follows the acquire at line "
                                    f"{i + 1} ({line.strip()}) with no CTA barrier between")
                    break
    return problems


RELEASE_STORE = re.compile(r"\bst\.[\w.]*release\b")                            # a publish by a plain store
RELEASE_EXCH = re.compile(r"\batom\.(?=[\w.]*\b(?:release|acq_rel)\b)[\w.]*\bexch\b")  # ... by an atomic
V4_STORE = re.compile(r"\bst\.global(\.\w+)*\.v4\.b32\b")   # a 16-byte global store
V4_LOAD = re.compile(r"\bld\.global(\.\w+)*\.v4\.b32\b")    # a 16-byte global load
F64_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?[a-z][\w.]*\.f64\b")  # an instruction on float64 (not a .reg line)
APPROX_DIV = re.compile(r"\b(?:div\.(?:full|approx)|rcp\.approx)\.[\w.]*f32\b")  # not correctly rounded


LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+\d+")
FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
PAYLOAD_FILE = "copy.py"   # triton_kernels/copy.py: the one copy loop and tile store every payload moves by


def source_files(ptx: str) -> list[str | None]:
    """For each PTX line, the source file of the ``.loc`` directive in force there (None before the first):
    the line info Triton emits, which names the file of inlined device functions too."""
    lines = ptx.splitlines()
    files = {m.group(1): m.group(2) for m in map(FILE.match, lines) if m}
    out, current = [], None
    for line in lines:
        m = LOC.match(line)
        if m:
            current = files.get(m.group(1))
        out.append(current)
    return out


LINE_COUNTS = dict(   # what ``counts`` counts: the lines each test holds
    publishes=is_publish, release_stores=_matcher(RELEASE_STORE, "release"),
    release_exchanges=_matcher(RELEASE_EXCH, "exch"), acquires=lambda x: is_acquire(x) and not is_publish(x),
    barriers=is_barrier, global_stores=is_global_store, v4_stores=_matcher(V4_STORE, ".v4.b32"),
    v4_loads=_matcher(V4_LOAD, ".v4.b32"), f64_ops=_matcher(F64_OP, ".f64"),
    approx_divs=_matcher(APPROX_DIV, "f32"))


def payload_accesses(ptx: str) -> dict:
    """Global loads and stores issued by the payload copy code (``copy.py``), and how many of them are
    16-byte vectors."""
    lines = ptx.splitlines()
    stores = loads = v4_stores = v4_loads = 0
    for line, f in zip(lines, source_files(ptx)):
        if not (f and f.endswith(PAYLOAD_FILE)):
            continue
        if is_global_store(line):
            stores += 1
            v4_stores += bool(V4_STORE.search(line))
        elif is_global_load(line):
            loads += 1
            v4_loads += bool(V4_LOAD.search(line))
    return dict(payload_stores=stores, payload_v4_stores=v4_stores, payload_loads=loads, payload_v4_loads=v4_loads)


def counts(ptx: str) -> dict:
    """How many publishes (release stores and release atomic exchanges among them), acquires, CTA barriers, 16-byte global loads/stores, float64 instructions and
    approximate float32 divisions (Triton's ``/``) the PTX holds, and the payload copy's accesses
    (``payload_accesses``)."""
    lines = ptx.splitlines()
    return dict(**payload_accesses(ptx), **{name: sum(map(is_a, lines)) for name, is_a in LINE_COUNTS.items()})


# ---- Rule 3: every barrier and block-wide call is reached by every thread of the program alike -------------
#
# Triton computes a "scalar" in every thread separately. A value read from the clock or from memory that
# can change under the kernel (a volatile, relaxed or acquire load; an atomic's own result register) can
# differ between the threads of one program; a branch on it that holds a CTA barrier (or a block-wide
# NVSHMEM call) lets warps meet different barriers. What makes such a value uniform, and so clean here:
# a trip through shared memory after a barrier (Triton's broadcast of an atomic's result and its cross-warp
# reductions: every thread reads the one value written) and ``bar.red`` (a CTA-wide reduction).

TAINT_SOURCE = re.compile(r"%globaltimer|%clock(?:64)?\b|\bld\.[\w.]*\b(?:volatile|relaxed|acquire)\b|\batom\.")
UNIFORM_RESULT = re.compile(r"\bbar(?:rier)?\.red\b")           # its result is the same in every thread
# Lane 0's value to every lane of a full warp: the same in every thread when the program is one warp
# (Triton broadcasts a scalar's value so in one-warp programs, by shared memory in wider ones).
WARP_BROADCAST = re.compile(r"\bshfl\.sync\.idx\.b32\s+%\w+,\s*%\w+,\s*0,\s*31,\s*-1\s*;?\s*$")
WARP_THREADS = 32
CTA_BARRIER = re.compile(r"\b(?:bar|barrier)\.(?:sync|red|arrive)\b")
BLOCK_CALL = re.compile(r"\bcall(?:\.uni)?\b.*?\b(\w+_block)\b")   # NVSHMEM's block-wide calls (nvshmemx_*_block)
LABEL = re.compile(r"^\s*(\$?[\w.$]+):")
GUARD = re.compile(r"^@(!?)(%\w+)\s+")
BRANCH = re.compile(r"^(?:@!?%\w+\s+)?bra(?:\.uni)?\s+(\$?[\w.$]+)")
NO_DEST = re.compile(r"^(?:st|red|bar|barrier|bra|ret|exit|membar|fence|prefetch|call|trap|cp\.async|mbarrier\.arrive)\b")


def _body(ptx: str, kernel: str) -> list[tuple[int, str]]:
    """(line number, statement) of the entry function ``kernel``, one PTX statement each (a line holding
    an inline-asm block ``{ a; b; }`` gives its statements; its local ``.reg`` declarations are dropped).
    The body ends at the brace that closes the function: an inline-asm block may span lines, its ``}``
    alone on a line (Triton's fp8 -> f16 conversion ``{\\n cvt...;\\n}``)."""
    lines = ptx.splitlines()
    start = next(i for i, x in enumerate(lines) if re.search(rf"\.entry\s+{re.escape(kernel)}\s*\(", x))
    i = next(j for j in range(start, len(lines)) if lines[j].strip() == "{")
    out, depth = [], 1
    for n in range(i + 1, len(lines)):
        raw = lines[n]
        code = raw.split("//")[0]
        depth += code.count("{") - code.count("}")
        if depth <= 0:
            break
        text = code.strip()
        if not text or text.startswith("."):
            continue
        m = LABEL.match(text)
        if m and not text.endswith(";"):
            out.append((n + 1, m.group(1) + ":"))
            continue
        for part in text.strip("{} ").split(";"):
            part = part.strip(" {}")
            if part and not part.startswith("."):
                out.append((n + 1, part))
    return out


def _dest_srcs(stmt: str):
    """(guard register or None, destination registers, source registers) of one statement."""
    g = GUARD.match(stmt)
    guard = g.group(2) if g else None
    body = stmt[g.end():] if g else stmt
    op, _, args = body.partition(" ")
    if NO_DEST.match(op) and not UNIFORM_RESULT.search(op):
        return guard, [], REG.findall(args)
    first, _, rest = args.partition(",")
    if first.strip().startswith("{"):   # a vector destination {a, b}: up to the closing brace
        head, _, rest = args.partition("}")
        first = head
    return guard, REG.findall(first), REG.findall(rest)


def _blocks(body):
    """Basic blocks: list of (label, [(line, stmt)]), and the successors of each block index."""
    blocks, cur = [], ("<entry>", [])
    for line, stmt in body:
        if stmt.endswith(":"):
            blocks.append(cur)   # kept even when empty: it falls through to this label
            cur = (stmt[:-1], [])
            continue
        cur[1].append((line, stmt))
        op = GUARD.sub("", stmt)
        if BRANCH.match(stmt) or op.startswith(("ret", "exit")):
            blocks.append(cur)
            cur = (f"<after line {line}>", [])
    blocks.append(cur)
    index = {label: i for i, (label, _) in enumerate(blocks)}
    succ = []
    for i, (_, stmts) in enumerate(blocks):
        s = set()
        last = stmts[-1][1] if stmts else ""
        op = GUARD.sub("", last)
        m = BRANCH.match(last)
        if m:
            s.add(index[m.group(1)])
            if GUARD.match(last) and i + 1 < len(blocks):   # conditional: falls through too
                s.add(i + 1)
        elif op.startswith(("ret", "exit")):
            if GUARD.match(last) and i + 1 < len(blocks):
                s.add(i + 1)
        elif i + 1 < len(blocks):
            s.add(i + 1)
        succ.append(s)
    return blocks, succ


def _post_dominators(succ):
    """Immediate post-dominator of each block (None: the exit), by the iterative set algorithm."""
    n = len(succ)
    exit_ = n   # a virtual exit after every block with no successor
    full = (1 << (n + 1)) - 1
    pdom = [full] * n + [1 << exit_]   # sets of blocks as bit masks: bit c set = block c post-dominates
    changed = True
    while changed:
        changed = False
        for b in reversed(range(n)):
            new = full
            for s in succ[b] or (exit_,):
                new &= pdom[s]
            new |= 1 << b
            if new != pdom[b]:
                pdom[b], changed = new, True
    ipdom = []
    for b in range(n):
        strict = pdom[b] & ~(1 << b)
        # the immediate one: the strict post-dominator that every other strict one post-dominates
        cand = [c for c in _bits(strict) if strict & ~pdom[c] == 0]
        ipdom.append(None if not cand or cand[0] == exit_ else cand[0])
    return ipdom


def _bits(mask: int):
    """The indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _cta_threads(ptx: str, kernel: str) -> int | None:
    """Threads per program of entry ``kernel`` (its ``.reqntid`` or ``.maxntid``), None if not declared."""
    m = re.search(rf"\.entry\s+{re.escape(kernel)}\s*\(.*?\)([^{{]*)\{{", ptx, re.S)
    dims = m and re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", m.group(1))
    if not dims:
        return None
    n = 1
    for d in dims.groups():
        n *= int(d or 1)
    return n


def divergent_barriers(ptx: str, kernel: str, arg_names: list[str] = ()) -> list[str]:
    """Rule 3 on the entry function ``kernel`` (non-constexpr arguments ``arg_names`` in order): every CTA
    barrier (``bar.sync``/``bar.red``/...) and block-wide NVSHMEM call that some thread may reach while
    another thread of the program does not, because a branch (or a guard) on the way depends, per thread,
    on a timer read or a volatile / relaxed / acquire load (or an atomic's own result register), or on a
    plain global load through a parameter of ``OTHER_CHANNEL_PARAMS``; [] if none. Taint follows registers
    (every definition of a register counts); a value that went through shared memory, or a ``bar.red``
    result, is uniform. The region of a conditional branch is what its successors reach before the
    branch's immediate post-dominator (a loop whose exit is tainted: its whole body)."""
    body = _body(ptx, kernel)
    one_warp = _cta_threads(ptx, kernel) == WARP_THREADS
    foreign = _control_registers([stmt + ";" for _, stmt in body], kernel, list(arg_names), OTHER_CHANNEL_PARAMS)

    def taint_source(stmt: str) -> bool:
        if TAINT_SOURCE.search(stmt):
            return True
        addr = ADDR.search(stmt) if foreign and is_global_load(stmt) else None
        return bool(addr and addr.group(1) in foreign)

    defs = []   # (line, statement, destinations, sources and guard, is a taint source): parsed once
    for line, stmt in body:
        if stmt.endswith(":"):
            continue
        guard, dests, srcs = _dest_srcs(stmt)
        if not dests or UNIFORM_RESULT.search(stmt) or (one_warp and WARP_BROADCAST.search(stmt)):
            continue
        defs.append((line, stmt, dests, srcs + ([guard] if guard else []), taint_source(stmt)))
    origin = {}   # tainted register -> (line, statement) of a taint source it depends on
    changed = True
    while changed:
        changed = False
        for line, stmt, dests, uses, source in defs:
            why = (line, stmt) if source else next((origin[r] for r in uses if r in origin), None)
            if why:
                for d in dests:
                    if d not in origin:
                        origin[d], changed = why, True

    blocks, succ = _blocks(body)
    ipdom = _post_dominators(succ)
    problems = []

    def barrier_in(stmt):
        return CTA_BARRIER.search(stmt) or BLOCK_CALL.search(stmt)

    for b, (_, stmts) in enumerate(blocks):
        for line, stmt in stmts:
            g = GUARD.match(stmt)
            if not g or g.group(2) not in origin:
                continue
            src_line, src = origin[g.group(2)]
            if barrier_in(stmt):
                problems.append(f"line {line} ({stmt}) is guarded by {g.group(2)}, which depends per thread "
                                f"on line {src_line} ({src})")
            if not BRANCH.match(stmt):
                continue
            stop = ipdom[b]
            seen, todo = set(), list(succ[b])
            while todo:
                x = todo.pop()
                if x in seen or x == stop:
                    continue
                seen.add(x)
                todo.extend(succ[x])
            under = [(bline, bstmt) for x in sorted(seen) for bline, bstmt in blocks[x][1] if barrier_in(bstmt)]
            if under:
                problems.append(f"branch at line {line} ({stmt}) depends per thread on line {src_line} ({src}); "
                                f"{len(under)} barrier(s) or block-wide call(s) under it, first at line "
                                f"{under[0][0]} ({under[0][1]})")
    return problems
