"""MOE_COMM_INTERPRET_ORDER (moe_comm/interpret_order.py): the programs of an interpreted launch really run
in the order asked for (recorded by a tiny kernel), send kernels get the delay, bad values are refused
with the fix, and launches outside ``kernel_for`` are untouched."""

import time

import pytest
import torch
import triton
import triton.language as tl

from moe_comm import interpret_order, planner
from moe_comm.interpreter import kernel_for

GRID = (3, 2, 2)
NPROG = 12
DELAY_S = 0.02


@triton.jit
def record_kernel(order_ptr, count_ptr):
    """Program (x, y, z) stores its flat id at the next free slot of order_ptr (programs run one at a
    time in the interpreter, so the slots list the order they ran in)."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    slot = tl.atomic_add(count_ptr, 1)
    tl.store(order_ptr + slot, pid)


@triton.jit
def record_send_kernel(order_ptr, count_ptr):
    """``record_kernel`` under a send kernel's name (the delay applies to it)."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    slot = tl.atomic_add(count_ptr, 1)
    tl.store(order_ptr + slot, pid)


def _order(kernel=record_kernel):
    order = torch.full((NPROG,), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    kernel_for(kernel, "cpu")[GRID](order, count)
    assert int(count) == NPROG   # every program ran exactly once
    return order.tolist()


@pytest.fixture
def env(monkeypatch):
    for name in (interpret_order.ORDER_ENV, interpret_order.SEED_ENV, interpret_order.DELAY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(interpret_order, "_generators", {})   # each test starts its seeds afresh
    return monkeypatch


def test_asis_is_grid_order(env):
    assert _order() == list(range(NPROG))
    env.setenv(interpret_order.ORDER_ENV, "asis")
    assert _order() == list(range(NPROG))


def test_reverse(env):
    env.setenv(interpret_order.ORDER_ENV, "reverse")
    assert _order() == list(reversed(range(NPROG)))


def test_random_is_a_seeded_permutation(env):
    env.setenv(interpret_order.ORDER_ENV, "random")
    env.setenv(interpret_order.DELAY_ENV, "0")
    first, second = _order(), _order()
    for o in (first, second):
        assert sorted(o) == list(range(NPROG)) and o != list(range(NPROG))
    assert first != second                        # a new permutation per launch
    env.setattr(interpret_order, "_generators", {})
    assert [_order(), _order()] == [first, second]   # same seed, same sequence
    env.setattr(interpret_order, "_generators", {})
    env.setenv(interpret_order.SEED_ENV, "1")
    assert _order() != first


def test_delay_only_for_send_kernels(env):
    env.setenv(interpret_order.ORDER_ENV, "reverse")
    env.setenv(interpret_order.DELAY_ENV, str(DELAY_S))
    _order(record_send_kernel)  # interpreter warm-up outside the timed launches
    t0 = time.monotonic()
    assert _order(record_send_kernel) == list(reversed(range(NPROG)))
    assert time.monotonic() - t0 >= NPROG * DELAY_S
    t0 = time.monotonic()
    _order(record_kernel)
    assert time.monotonic() - t0 < NPROG * DELAY_S


@pytest.mark.parametrize("name, value, fix", [
    (interpret_order.ORDER_ENV, "backwards", "one of asis, reverse, random"),
    (interpret_order.SEED_ENV, "x", "an integer"),
    (interpret_order.DELAY_ENV, "-1", "seconds >= 0"),
    (interpret_order.DELAY_ENV, "soon", "seconds >= 0"),
])
def test_bad_value_says_the_fix(env, name, value, fix):
    env.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}=.*{fix}"):
        _order()


def test_other_launches_untouched(env):
    """A kernel launched without kernel_for (someone else's) runs as Triton runs it, in grid order."""
    env.setenv(interpret_order.ORDER_ENV, "reverse")
    order = torch.full((NPROG,), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        stock = triton.jit(record_kernel.fn)
    stock[GRID](order, count)
    assert order.tolist() == list(range(NPROG))


def test_gpu_launch_shapes_on_cpu(monkeypatch):
    """MOE_COMM_LAUNCH_SHAPES=gpu plans CPU launches with the CUDA grids; a bad value says the fix."""
    cpu, cuda = (planner.plan_ep(2, 8, 128, 4, 2, torch.bfloat16, False, d) for d in ("cpu", "cuda"))
    assert cpu.reduce_grid != cuda.reduce_grid
    monkeypatch.setenv(planner.SHAPES_ENV, "gpu")
    assert planner.plan_ep(2, 8, 128, 4, 2, torch.bfloat16, False, "cpu") == cuda
    assert planner.plan_copy(4096, 64, 2, torch.device("cpu")) == planner.plan_copy(4096, 64, 2, torch.device("cuda"))
    monkeypatch.setenv(planner.SHAPES_ENV, "GPUs")
    with pytest.raises(ValueError, match="MOE_COMM_LAUNCH_SHAPES='GPUs' is not valid: set it to one of auto, gpu"):
        planner.plan_ep(2, 8, 128, 4, 2, torch.bfloat16, False, "cpu")


_SEEN = {}


def _note_np_dtype_function():
    """Plain Python, called from an interpreted kernel: which ``_get_np_dtype`` the launch runs with."""
    from triton.runtime import interpreter  # noqa: PLC0415
    _SEEN["inside"] = interpreter._get_np_dtype


@triton.jit
def np_dtype_probe_kernel(out_ptr):
    _note_np_dtype_function()
    tl.store(out_ptr, 1)


def test_the_cached_numpy_dtype_answers_as_the_interpreters_and_only_inside_a_launch():
    """moe_comm.interpreter keeps the interpreter's NumPy dtype per Triton element type during a launch
    (it is asked several times per interpreted operation): the same answer for every type, scalar, block
    and pointer; Triton's own function outside the launch."""
    from triton.runtime import interpreter  # noqa: PLC0415
    stock = interpreter._get_np_dtype
    out = torch.zeros(1, dtype=torch.int32)
    kernel_for(np_dtype_probe_kernel, out.device)[(1,)](out)
    inside = _SEEN.pop("inside")
    assert out.item() == 1 and inside is not stock and interpreter._get_np_dtype is stock
    types = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
             tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types += [tl.pointer_type(t) for t in types[:3]]
    for t in types + [tl.block_type(t, [4]) for t in types] + [tl.block_type(t, [2, 8]) for t in types]:
        for _ in range(2):   # the second answer comes from the cache
            assert inside(t) == stock(t), t
