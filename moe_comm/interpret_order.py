"""Adversarial program order for interpreted launches: a CPU guard against order-dependent kernels.

Triton's interpreter runs a launch's programs one after another in grid order (x, then y, then z), so a
kernel that is only correct when program 0 runs before program 1, or when a sender publishes before its
receiver looks, passes every CPU test. On a GPU programs run in any order and concurrently. Set

- ``MOE_COMM_INTERPRET_ORDER``: ``asis`` (default: grid order, Triton's own loop untouched),
  ``reverse`` (the last program first), or ``random`` (a permutation per launch);
- ``MOE_COMM_INTERPRET_SEED``: seed of the ``random`` permutations and delays (int, default 0; each
  process draws from its own generator, so a run's launches are reproducible);
- ``MOE_COMM_INTERPRET_DELAY_S``: sleep this long before each program of a send kernel (a kernel whose
  name ends in ``_send_kernel``), so that the receive programs of other rank processes run before some
  senders publish; in ``random`` mode each sleep is uniform in [0, delay], and the delay defaults to
  ``RANDOM_DELAY_S``. Default 0 otherwise.

Only launches made through ``moe_comm.interpreter.kernel_for`` are affected (our kernels; any other
Triton kernel in the process runs as Triton runs it). The settings are read when a launch's kernel is
chosen: when an op builds its launches (its first call, and again after its plan is replaced:
``moe_comm/launches.py``), and at each abort or drain launch. Set them before building the ops. Nothing is
patched: the launch runs Triton's own ``GridExecutor`` over the kernel wrapped so that the first program
the executor starts runs every program of the grid in the chosen order, and the executor's remaining
calls do nothing.

What this can show: a result or error that depends on program order within a launch, or on a receiver
running before its sender (across rank processes). What it cannot: programs of one launch never run at
the same time here (no data race, no memory-ordering bug: the interpreter's memory is sequentially
consistent), nor can a kernel that waits for another program of its own launch be caught, since that
program never runs while it waits (such a kernel would hang on a GPU too, and times out here).
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import time
import types
from dataclasses import dataclass

ORDER_ENV = "MOE_COMM_INTERPRET_ORDER"
SEED_ENV = "MOE_COMM_INTERPRET_SEED"
DELAY_ENV = "MOE_COMM_INTERPRET_DELAY_S"
ORDERS = ("asis", "reverse", "random")
RANDOM_DELAY_S = 0.002          # random mode: each send program sleeps up to this long unless DELAY_ENV says
SEND_KERNEL_SUFFIX = "_send_kernel"

_generators: dict[int, random.Random] = {}   # seed -> this process's generator for that seed


@dataclass(frozen=True)
class OrderSettings:
    order: str        # one of ORDERS
    seed: int
    delay_s: float    # the (maximum, in random mode) sleep before each send program

    @property
    def stock(self) -> bool:
        """True when launches run exactly as Triton runs them (grid order, no delay)."""
        return self.order == "asis" and self.delay_s == 0


def settings() -> OrderSettings:
    """The order settings from the environment; ValueError naming the variable and the fix if bad."""
    order = os.environ.get(ORDER_ENV, "asis").strip().lower() or "asis"
    if order not in ORDERS:
        raise ValueError(f"{ORDER_ENV}={os.environ[ORDER_ENV]!r} is not an order; set it to one of "
                         f"{', '.join(ORDERS)} (or unset it for grid order)")
    seed = _parse(SEED_ENV, "0", int, "an integer, e.g. 0")
    default_delay = str(RANDOM_DELAY_S) if order == "random" else "0"
    delay = _parse(DELAY_ENV, default_delay, float, "a number of seconds >= 0, e.g. 0.001")
    if not delay >= 0:  # also refuses nan
        raise ValueError(f"{DELAY_ENV}={os.environ[DELAY_ENV]!r} must be a number of seconds >= 0, e.g. 0.001")
    return OrderSettings(order, seed, delay)


def _parse(name: str, default: str, kind, what: str):
    raw = os.environ.get(name, default).strip() or default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not valid: set it to {what} (or unset it)") from None


def ordered(kernel, name: str):
    """``kernel`` (an interpreted ``@triton.jit`` kernel, launched as ``kernel[grid](...)``) as the launch
    settings ask: itself when they are stock, else an ``OrderedKernel``. ``name``: the kernel's name
    (picks the send kernels that get the delay)."""
    s = settings()
    return kernel if s.stock else OrderedKernel(kernel, name, s)


class OrderedKernel:
    """An interpreted kernel whose launches run their programs in the order of ``settings``."""

    def __init__(self, kernel, name: str, s: OrderSettings):
        self.kernel, self.settings = kernel, s
        self.delayed = name.endswith(SEND_KERNEL_SUFFIX) and s.delay_s > 0
        self.rng = _generators.setdefault(s.seed, random.Random(s.seed))

    def __getitem__(self, grid):
        return functools.partial(self.run, grid=grid)

    def run(self, *args, grid, warmup=False, **kwargs):
        if warmup:   # as Triton's InterpretedFunction.run: nothing to compile
            return None
        from triton.runtime.interpreter import GridExecutor  # noqa: PLC0415
        k = self.kernel
        return GridExecutor(self._all_programs(k.rewrite()), k.arg_names, grid, k.pre_run_hooks)(*args, **kwargs)

    def program_order(self, grid_dim) -> list[tuple[int, int, int]]:
        """Every program id of a grid of ``grid_dim`` (3 ints), in the order they will run."""
        nx, ny, nz = grid_dim
        ids = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        if self.settings.order == "reverse":
            ids.reverse()
        elif self.settings.order == "random":
            self.rng.shuffle(ids)
        return ids

    def _delay(self) -> float:
        d = self.settings.delay_s
        return self.rng.uniform(0, d) if self.settings.order == "random" else d

    def _all_programs(self, fn):
        """``fn`` (one program of the rewritten kernel) as a function that runs the whole grid in order
        on its first call and nothing on the later ones (the executor calls it once per program). It has
        ``fn``'s signature (the executor binds the launch's arguments by it) and globals (the executor
        patches the language modules it finds there)."""
        from triton.runtime.interpreter import interpreter_builder  # noqa: PLC0415
        started, sleep = [], time.sleep   # closure cells: the body reads none of this module's globals

        def run_grid(**args):
            if started:
                return
            started.append(True)
            for pid in self.program_order(interpreter_builder.grid_dim):
                if self.delayed:
                    sleep(self._delay())
                interpreter_builder.set_grid_idx(*pid)
                fn(**args)

        wrapped = types.FunctionType(run_grid.__code__, fn.__globals__, fn.__name__, None, run_grid.__closure__)
        functools.update_wrapper(wrapped, fn)
        wrapped.__signature__ = inspect.signature(fn)
        return wrapped
