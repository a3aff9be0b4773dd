"""The MoE layer's matrix: worlds 1-4 over shared memory (rank processes) and loopback, the put transport,
2x2 emulated nodes, the GPU launch shapes, and the programs of every launch in reverse and random order.
Every case is checked against reference.moe_layer (tests/moe_layer_cases.py: bit for bit on exact
inputs, within the derived bound on random ones). ``make test`` runs one representative of each; the
rest are marked ``sweep``.

What the emulations show and do not: the interpreter runs one program at a time with sequentially
consistent memory, so a reordered grid shows a result that depends on program order (a tile computed
before its sources' flags were seen, a publish before every program's stores), and rank processes show
waits that really wait; memory-ordering bugs within a GPU are the PTX rules' (test_compile_sm90.py).
Emulated nodes map nothing of another node: rows and flags cross only as puts on the wire."""

import pytest

import moe_comm
from moe_comm.heap.shm import RANKS_PER_NODE_ENV
from moe_comm.interpret_order import ORDER_ENV, SEED_ENV
from moe_comm.planner import SHAPES_ENV

from budget import sweep
from moe_layer_cases import (ROUTINGS, LayerConfig, check_ranks, layer_inputs, make_layer, run_loopback_cases,
                             run_loopback_layers, run_shm_cases)
from shm_files import own_shm_files

# An expert with more rows than a 16-row GPU tile: full tiles computed as their sources arrive, then the
# partial one (only the GPU launch shapes have 16-row tiles; e.g. 3 + 16 tokens of 2 ranks all to expert 0).
DEEP = LayerConfig(2, 64, 32, 2, 16)


def _shm(group, configs, routings):
    return run_shm_cases(group, configs, routings)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [sweep(1), sweep(3), sweep(4)])
def test_shm_worlds(world):
    errs = moe_comm.launch(_shm, world, None, ("random", "one_expert", "none"), backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [sweep(4)])
def test_loopback_world4(world):
    assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=world, device="cpu")) == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,configs", [(2, (0,)), sweep(3, (0, 1)), sweep(2, None), sweep(4, (2, 3))])
def test_put_transport_loopback(monkeypatch, world, configs):
    """Every peer reached by puts (MOE_COMM_TRANSPORT=put, this rank included): the runs of output rows
    staged and put by the down kernel, a put source's packed landing rows found by the gate/up search."""
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
    routings = ("random", "one_expert") if configs == (0,) else ROUTINGS
    assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=world, device="cpu"), configs,
                              routings) == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("configs", [(0,), sweep(None)])
def test_emulated_nodes_2x2(monkeypatch, configs):
    """Two nodes of two rank processes: stores within a node, puts on the wire across."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    routings = ("random",) if configs == (0,) else ("random", "one_expert")
    errs = moe_comm.launch(_shm, 4, configs, routings, backend="shm", timeout_s=180)
    assert [e for r in errs for e in r] == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("order,seed,world,quick", [("reverse", 0, 2, True), sweep("random", 1, 3, False),
                                                    sweep("random", 2, 2, False), sweep("reverse", 0, 3, False)])
def test_program_orders_with_gpu_shapes(monkeypatch, order, seed, world, quick):
    """The GPU launch shapes (16-row tiles, a program per column block and expert, a dispatch send program
    per token) with each launch's programs in reverse or random order, on a config whose expert 0 gets more
    rows than a tile (its full tiles start before the last sources' flags are seen) and on another."""
    monkeypatch.setenv(ORDER_ENV, order)
    monkeypatch.setenv(SEED_ENV, str(seed))
    monkeypatch.setenv(SHAPES_ENV, "gpu")
    import moe_layer_cases
    monkeypatch.setattr(moe_layer_cases, "CONFIGS", (DEEP, moe_layer_cases.CONFIGS[1]))
    pairs = ((0, "one_expert"),) if quick else None
    assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=world, device="cpu"),
                              routings=("one_expert", "random"), pairs=pairs) == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("order", [sweep("reverse"), sweep("random")])
def test_program_orders_in_rank_processes(monkeypatch, order):
    """The same in rank processes, whose waits really wait (a receive may run before its sender)."""
    monkeypatch.setenv(ORDER_ENV, order)
    monkeypatch.setenv(SHAPES_ENV, "gpu")
    errs = moe_comm.launch(_shm, 2, (0,), ("random", "one_expert"), backend="shm", timeout_s=180)
    assert [e for r in errs for e in r] == []


@pytest.mark.timeout(300)
def test_a_tile_straddling_two_sources_finds_the_rows_of_both(monkeypatch):
    """GPU launch shapes (16-row tiles), world 3, tokens 3 / 16 / 16 all to expert 0: its rows are source 0's 3,
    source 1's 16, source 2's 16. Tile 0 (rows 0-15) is computed once source 1 is seen; tile 1 (rows 16-31)
    holds source 1's last 3 rows and source 2's first 13, so once source 2 is seen its landing-row search must
    still cover source 1 (the search starts at the source of the tile's first row, not at the newest one);
    then the partial tile. Exact inputs: bit for bit against the reference, programs in reverse order."""
    monkeypatch.setenv(SHAPES_ENV, "gpu")
    monkeypatch.setenv(ORDER_ENV, "reverse")
    world = 3
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    inputs = layer_inputs(world, [3, 16, 16], DEEP.experts_per_rank, DEEP.hidden, DEEP.inter, DEEP.topk, 5, True,
                          "one_expert")
    layers = [make_layer(g, DEEP, inputs[3][r], inputs[4][r]) for r, g in enumerate(groups)]
    assert layers[0].plan.block_rows == 16 and layers[0].ep.plan.capacity >= 35
    ys = run_loopback_layers(layers, *inputs[:3])
    assert check_ranks(dict(enumerate(ys)), inputs, DEEP, True, "straddle") == []
