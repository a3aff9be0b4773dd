"""The transformers door's bad inputs and faults: each gets a named error that says the fix, never a hang.

In one process (world 1 or a loopback world): an experts module the door does not know, a world that does
not divide the experts, experts_implementation="moe_comm" without a bound group, a sharded model switched
back to another implementation, MoE layers run out of order. On shm ranks: ranks that stop stepping
together (StepTimeoutError naming the rank that did not come, within the timeout), ranks bound with
different settings (StepMismatchError on every rank), and a rank killed mid-generation (every survivor
raises CommTimeoutError within the timeout, and its next step raises again: the error is sticky).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

import moe_comm
from moe_comm.errors import CommTimeoutError, GroupError, LaunchError, MoECommError

import budget

pytest.importorskip("transformers")

import moe_comm.serving.hf as hf  # noqa: E402
from moe_comm.serving.hf import generate as gen  # noqa: E402
from moe_comm.serving.hf.tiny import tiny_model  # noqa: E402

# The ranks' skew at a step's meeting: at most 0.5 s measured (world 3, load 3 on 2 cores), so about 2.5 s at
# the load of 13 seen under make test; the fork server preloads transformers, so model builds skew them by
# hundredths of a second. The waits the tests provoke last TIMEOUT_S: shorter is a shorter test.
TIMEOUT_S = 6.0
NAMED_WITHIN_S = TIMEOUT_S + 5   # the wait, plus the interpreted send phase and the error's broadcast


def _world1():
    (group,) = moe_comm.init(backend="loopback", world_size=1)
    return group


def test_unknown_experts_module_is_refused_with_the_fix():
    model = tiny_model("qwen3_moe", layers=1)
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    experts.w13 = experts.gate_up_proj          # a checkpoint converter's own name for the same weights
    del experts.gate_up_proj
    with pytest.raises(hf.UnsupportedExpertsError, match="no tensor gate_up_proj.*Fix: run this model with "
                                                         "experts_implementation='eager'"):
        hf.shard_experts(model, _world1())
    assert experts.down_proj.shape[0] == 8, "a refused model must keep its weights"

    class MyExperts(nn.Module):                 # an experts module that transformers' interface never calls
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(8, 64, 64))

    model.model.layers[0].mlp.experts = MyExperts()
    with pytest.raises(hf.UnsupportedExpertsError, match="not decorated by @use_experts_implementation"):
        hf.shard_experts(model, _world1())


def test_a_world_that_does_not_divide_the_experts_is_refused_with_the_fix():
    groups = moe_comm.init(backend="loopback", world_size=3)
    with pytest.raises(ValueError, match=r"8 experts, which 3 ranks cannot share.*divides 8 \(1, 2, 4, 8\)"):
        hf.shard_experts(tiny_model("mixtral", layers=1), groups[0])


def test_a_fused_layer_path_the_kernels_cannot_compute_is_refused_with_the_fix():
    """layer_path="fused" on gpt-oss (biases, its own clamped gate) or with an fp8 dispatch: refused before
    anything is sharded (layer_path="auto" runs such layers unfused: tests/test_hf_door.py); a layer_path
    that does not exist: ValueError listing those that do."""
    model = tiny_model("gpt_oss", layers=1, experts_implementation="moe_comm")
    with pytest.raises(hf.UnsupportedExpertsError, match=r"cannot run GptOssExperts: .*biases.*Fix: layer_path='auto'"):
        hf.shard_experts(model, _world1(), layer_path="fused")
    assert next(m for m in model.modules() if type(m).__name__ == "GptOssExperts").down_proj.shape[0] == 8
    model = tiny_model("qwen3_moe", torch.bfloat16, layers=1, hidden=128, experts_implementation="moe_comm")
    with pytest.raises(hf.UnsupportedExpertsError, match=r"dispatch_format='e4m3' \(the fused layer moves rows"):
        hf.shard_experts(model, _world1(), layer_path="fused", dispatch_format="e4m3")
    with pytest.raises(ValueError, match=r"layer_path must be one of \('unfused', 'fused', 'auto'\)"):
        hf.shard_experts(model, _world1(), layer_path="fast")
    rep = hf.shard_experts(model, _world1(), layer_path="auto", dispatch_format="e4m3")
    assert rep.fused_layers == 0 and "dispatch_format='e4m3'" in rep.unfused_why, rep


def test_moe_comm_without_a_bound_group_says_to_bind_it():
    model = tiny_model("qwen3_moe", layers=1, experts_implementation="moe_comm")
    with pytest.raises(hf.NotBoundError, match=r"shard_experts\(model, group\)"):
        model(torch.tensor([[5, 6, 7]]))


def test_a_sharded_model_refuses_another_experts_implementation():
    model = tiny_model("gpt_oss", layers=1, experts_implementation="moe_comm")
    hf.shard_experts(model, _world1())
    ids = torch.tensor([[5, 6, 7]])
    model(ids)
    model.set_experts_implementation("eager")
    with pytest.raises(hf.NotBoundError, match="holds only this rank's experts"):
        model(ids)
    model.set_experts_implementation("moe_comm")
    model(ids)


def test_moe_layers_out_of_order_are_refused():
    model = tiny_model("qwen3_moe", layers=2)
    hf.shard_experts(model, _world1())
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    x, idx, w = torch.randn(3, 64), torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
    with pytest.raises(hf.StepOrderError, match="MoE layer 1 with 3 tokens, expected MoE layer 0"):
        experts[1](x, idx, w)
    experts[0](x, idx, w)
    with pytest.raises(hf.StepOrderError, match="MoE layer 1 with 2 tokens, expected MoE layer 1 with 3 tokens"):
        experts[1](x[:2], idx[:2], w[:2])


# ---- ranks -----------------------------------------------------------------------------------------

def _timed_steps(model):
    """Record when this rank last began a step (the door's meeting) or an MoE layer."""
    from moe_comm.serving.hf import door as door_mod  # noqa: PLC0415
    marks = {"t": time.monotonic()}
    run_layer, begin = door_mod.run_layer, door_mod.Door.begin_step

    def layer(*a):
        marks["t"] = time.monotonic()
        return run_layer(*a)

    def step(self, *a):
        marks["t"] = time.monotonic()
        return begin(self, *a)

    door_mod.run_layer, door_mod.Door.begin_step = layer, step
    return marks


def _stops_early(group):
    """Rank 1 generates 2 tokens and returns without finish(); rank 0 goes on to 6."""
    model = tiny_model("qwen3_moe", layers=1, experts_implementation="moe_comm")
    hf.shard_experts(model, group, decode_tokens=4, prefill_tokens=8)
    marks = _timed_steps(model)
    prompt = gen.prompts_for(group.rank, 2)[:1]
    if group.rank == 1:
        gen.generate(model, prompt, 2)
        return None
    try:
        gen.generate(model, prompt, 6)
    except MoECommError as e:
        return type(e).__name__, str(e), time.monotonic() - marks["t"], isinstance(e, CommTimeoutError)
    return "no error"


@pytest.mark.timeout(180)
def test_ranks_that_stop_stepping_together_get_a_named_error():
    got = moe_comm.launch(_stops_early, 2, timeout_s=TIMEOUT_S)[0]
    assert got != "no error"
    name, msg, waited, is_timeout = got
    assert name == "StepTimeoutError" and is_timeout, got
    assert "waited" in msg and "for rank 1" in msg and "idle_step(model)" in msg and "finish(model)" in msg, msg
    assert waited <= NAMED_WITHIN_S, f"named after {waited:.1f} s"


def _binds_differently(group, setting):
    model = tiny_model("mixtral", layers=1, experts_implementation="moe_comm")
    differ = dict(decode_tokens=4 + group.rank) if setting == "decode_tokens" else \
        dict(layer_path=("unfused", "fused")[group.rank])   # other kernels on each rank: never in step
    try:
        hf.shard_experts(model, group, **differ)
    except hf.StepMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["decode_tokens", "layer_path"])
def test_ranks_bound_with_different_settings_get_a_named_error(setting):
    for r, msg in enumerate(moe_comm.launch(_binds_differently, 2, setting, timeout_s=TIMEOUT_S)):
        assert f"rank {1 - r} bound a different model or settings than rank {r}" in msg, msg


def _killed_mid_generation(group, where):
    """World 3: rank 1 is killed in its third step: inside its first MoE layer (where="layer": the others
    wait in the dispatch; "layer-fused": in the fused MoELayer's kernels, layer_path="fused") or as it comes
    to the step's meeting (where="meeting": the others wait there)."""
    from moe_comm.serving.hf import door as door_mod  # noqa: PLC0415
    model = tiny_model("deepseek_v3", layers=2, experts=6, experts_implementation="moe_comm")
    hf.shard_experts(model, group, decode_tokens=8, prefill_tokens=8,
                     layer_path="fused" if where == "layer-fused" else "unfused")
    marks = _timed_steps(model)
    if group.rank == 1 and where.startswith("layer"):
        run_layer = door_mod.run_layer

        def dying(layer, *a):
            if layer.door.steps == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return run_layer(layer, *a)

        door_mod.run_layer = dying
    if group.rank == 1 and where == "meeting":
        meet = door_mod.StepMeetings.meet

        def dying_meet(self, kind, tokens, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return meet(self, kind, tokens, step)

        door_mod.StepMeetings.meet = dying_meet
    try:
        gen.generate(model, gen.prompts_for(group.rank, 3), 8)
        return "no error"
    except MoECommError as e:
        first = (type(e).__name__, str(e), time.monotonic() - marks["t"], isinstance(e, CommTimeoutError))
    try:
        hf.idle_step(model)
        again = "no error"
    except GroupError as e:
        again = type(e).__name__
    return first, again


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["meeting", budget.sweep("layer", id="layer"),
                                   budget.sweep("layer-fused", id="layer-fused")])
def test_a_rank_killed_mid_generation_is_named_by_every_survivor(where):
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_killed_mid_generation, 3, where, timeout_s=TIMEOUT_S)
    err = info.value
    assert list(err.failures) == [1] and "died" in err.failures[1], err.failures
    for r in (0, 2):
        (name, msg, waited, is_timeout), again = err.results[r]
        assert is_timeout and "rank 1" in msg, (r, name, msg)
        assert waited <= NAMED_WITHIN_S, f"rank {r} named it after {waited:.1f} s"
        assert again != "no error", f"rank {r}: the step after the fault ran"
