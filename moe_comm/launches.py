"""An op's kernel launches with what does not change between calls bound once (the host cost of an eager call).

Prefill runs eagerly in most engines, so the Python between an op call and its kernel launches counts.
Most arguments of a launch are the same at every call of an op on a rank: the kernel's launchable form
for the group's device (``interpreter.kernel_for``, which reads the environment), the grid and the
constexprs (from the plan), and the tensors the op owns (its channels' buffers, counters and peer
pointers, the group state, its metadata sets and outputs). A ``Launch`` binds them once; a call adds its
own: the caller's tensors, the sizes they have (T, N) and their alignment (``ALIGNED``).

What a launch may bind, and why it stays right:

- tensors of the op, its channels and its group, whose identity never changes while the op is open. Their
  contents do change, in place: ``group.reset()`` zeroes counters and flags, ``group.exclude()`` repoints
  the excluded ranks' ``peer_ptrs`` entries and writes the new epoch and live mask into ``group.state``,
  which the kernels read on the device. So launches survive ``reset()`` and ``exclude()`` unchanged (the
  one epoch-dependent copy, ``PrefillBuffer``'s per-zone peer pointers, is re-derived in place at a new
  epoch);
- values of the plan: ``EPBuffer``'s and ``AllToAllvDynamic``'s ``LaunchTable`` is rebuilt when the op's
  plan is replaced (tests and tuning set a plan on an op that exists, sometimes after it has run);
  ``PrefillBuffer`` rebuilds its zones' launches then. Once an op's buffers exist, a new plan must size
  them alike (``planner.check_replaced_plan`` refuses one that does not, naming the fix): only launch
  shapes may change, since setting a plan is local to a rank and reallocating is collective;
- values of the group fixed when it is made: rank, world size, the transports (``Channel.put_args``), the
  flight recorder's setting (``group.trace_calls``, ``Channel.trace_args``);
- the kernel's form, from ``MOE_COMM_INTERPRET`` and ``MOE_COMM_INTERPRET_ORDER`` as they are when the
  launches are built (an op's first call, or its first call with a new plan).

Never a caller's tensor or anything derived from one (a view, a pointer, its alignment): a caller's tensor
may die and its memory and Python id be reused by the next call's, so those are derived at every call.
A closed op launches nothing (its calls raise ClosedError first).

What a call still does itself (``bench/NOTES.md`` section 19): the phase state machine, the input checks,
the handle and result, the views of its tensors and their alignment, the output allocation, the launch,
and the end-of-call read of the error word (``CommGroup.finish_op``: the never-silent contract).
"""

from __future__ import annotations

import inspect

from .interpreter import kernel_for
from .planner import vector_aligned


class Launch:
    """One launch of an op: ``kernel`` (an ``@triton.jit`` kernel) on ``grid`` for tensors on ``device``, with
    the arguments ``static`` bound (by parameter name; a name that is not a parameter of the kernel is a
    launch option, e.g. ``num_warps``). ``aligned``: whether the op's own tensors (and plan) let the
    kernel's ``ALIGNED`` be set; a call ands its own tensors in (``aligned_with``).

    ``launch.run(**args)`` launches with ``args``: every parameter not in ``static``, by name, keyword-only
    (TypeError for a missing or unknown one, as for any Python call)."""

    __slots__ = ("aligned", "per_call", "run")

    def __init__(self, kernel, device, grid, aligned: bool = True, **static):
        names = list(inspect.signature(kernel.fn).parameters)
        options = {k: v for k, v in static.items() if k not in names}
        self.per_call = tuple(n for n in names if n not in static)
        self.run = _positional_call(kernel_for(kernel, device), tuple(grid), names, static, options)
        self.aligned = bool(aligned)

    def aligned_with(self, *tensors) -> bool:
        """``ALIGNED`` of a call that also passes ``tensors`` (None entries skipped): 16-byte vectors are
        allowed when the op's side allows them and every one of ``tensors`` starts on a 16-byte boundary."""
        return self.aligned and vector_aligned(*tensors)


def _positional_call(kernel, grid, names, static, options):
    """``run(*, <the parameters of names not in static>)``: ``kernel.run(<every parameter of names, in order>,
    grid=grid, warmup=False, **options)``, the static values bound as closure variables.

    ``kernel.run`` is what ``kernel[grid](...)`` calls (Triton's ``JITFunction.__getitem__`` returns a lambda
    that adds ``grid`` and ``warmup=False``; ``InterpretedFunction`` and ``OrderedKernel`` take the same
    arguments); calling it directly saves that frame, which repacks every argument. It is looked up at each
    call, so a launch follows a replaced ``run`` (``bench/host_cost.py`` stubs it). Generated from source,
    as ``dataclasses`` makes ``__init__``: keyword arguments cost ~2 us per launch for some 40 of them (a
    dict built, then copied by every frame on the way), a generic binder ~1 us more than the launch; a plain
    function with the call's few parameters that passes the rest positionally adds ~0.1 us."""
    bound = [n for n in names if n in static]
    per_call = [n for n in names if n not in static]
    signature = f"*, {', '.join(per_call)}" if per_call else ""
    call = ", ".join(names) + ", grid=_grid, warmup=False" + (", **_options" if options else "")
    source = (f"def _bind(_kernel, _grid, _options, {', '.join(bound)}):\n"
              f"    def run({signature}):\n"
              f"        _kernel.run({call})\n"
              f"    return run\n")
    namespace = {}
    exec(source, namespace)  # noqa: S102  (source made above from the kernel's own parameter names)
    return namespace["_bind"](kernel, grid, options, **{n: static[n] for n in bound})


class LaunchTable:
    """The launches of one op for the plan in force. ``get(plan, build)``: the launches ``build(plan)``
    made, built at first use and again whenever ``plan`` is not the object they were built from (a
    replaced plan; the table holds the plan it was built from, so that object stays alive and the
    identity test cannot match a new plan at a reused address)."""

    __slots__ = ("_launches", "_plan")

    def __init__(self):
        self._plan = self._launches = None

    def get(self, plan, build):
        if plan is not self._plan:
            self._launches = build(plan)
            self._plan = plan
        return self._launches
