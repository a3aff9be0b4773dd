"""Memory-ordering rules checked on the PTX of every kernel (compiled for sm_90 on the CPU).

Triton's interpreter runs each statement's stores before the next, so it cannot show an ordering bug;
the compiled code can have one. Two rules, checked on the PTX text in program order:

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


def _control_registers(lines: list[str], kernel: str, arg_names: list[str]) -> set[str]:
    """Registers holding an address derived from (or loaded through) the control parameters."""
    params = {f"{kernel}_param_{i}" for i, a in enumerate(arg_names) if a in CONTROL_PARAMS}
    regs = {m.group(1) for m in map(PARAM_LOAD.search, lines) if m and m.group(2) in params}
    changed = True
    while changed:
        changed = False
        for line in lines:
            m = DEST_SRCS.match(line)
            if m and m.group(1) not in regs and any(r in regs for r in REG.findall(m.group(2))):
                regs.add(m.group(1))
                changed = True
    return regs


def check(ptx: str, kernel: str, arg_names: list[str]) -> list[str]:
    """Violations of the two rules in ``ptx`` (the kernel ``kernel`` with non-constexpr arguments
    ``arg_names`` in order), as readable strings; [] if none."""
    lines = ptx.splitlines()
    control = _control_registers(lines, kernel, arg_names)
    problems = []
    for i, line in enumerate(lines):
        if PUBLISH.search(line):
            for j in range(i - 1, -1, -1):
                if BARRIER.search(lines[j]):
                    break
                if GLOBAL_STORE.search(lines[j]):
                    problems.append(f"publish at line {i + 1} ({line.strip()}) follows the store at line "
                                    f"{j + 1} ({lines[j].strip()}) with no CTA barrier between")
                    break
        if ACQUIRE.search(line) and not PUBLISH.search(line):
            for j in range(i + 1, len(lines)):
                if BARRIER.search(lines[j]):
                    break
                if GLOBAL_LOAD.search(lines[j]) and not ACQUIRE.search(lines[j]):
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


def payload_accesses(ptx: str) -> dict:
    """Global loads and stores issued by the payload copy code (``copy.py``), and how many of them are
    16-byte vectors."""
    lines = ptx.splitlines()
    stores = loads = v4_stores = v4_loads = 0
    for line, f in zip(lines, source_files(ptx)):
        if not (f and f.endswith(PAYLOAD_FILE)):
            continue
        if GLOBAL_STORE.search(line):
            stores += 1
            v4_stores += bool(V4_STORE.search(line))
        elif GLOBAL_LOAD.search(line):
            loads += 1
            v4_loads += bool(V4_LOAD.search(line))
    return dict(payload_stores=stores, payload_v4_stores=v4_stores, payload_loads=loads, payload_v4_loads=v4_loads)


def counts(ptx: str) -> dict:
    """How many publishes (release stores and release atomic exchanges among them), acquires, CTA barriers, 16-byte global loads/stores, float64 instructions and
    approximate float32 divisions (Triton's ``/``) the PTX holds, and the payload copy's accesses
    (``payload_accesses``)."""
    lines = ptx.splitlines()
    return dict(**payload_accesses(ptx), publishes=sum(bool(PUBLISH.search(x)) for x in lines),
                release_stores=sum(bool(RELEASE_STORE.search(x)) for x in lines),
                release_exchanges=sum(bool(RELEASE_EXCH.search(x)) for x in lines),
                acquires=sum(bool(ACQUIRE.search(x)) and not bool(PUBLISH.search(x)) for x in lines),
                barriers=sum(bool(BARRIER.search(x)) for x in lines),
                global_stores=sum(bool(GLOBAL_STORE.search(x)) for x in lines),
                v4_stores=sum(bool(V4_STORE.search(x)) for x in lines),
                v4_loads=sum(bool(V4_LOAD.search(x)) for x in lines),
                f64_ops=sum(bool(F64_OP.search(x)) for x in lines),
                approx_divs=sum(bool(APPROX_DIV.search(x)) for x in lines))
