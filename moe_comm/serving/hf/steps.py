"""Ranks step together: one bounded host meeting per model step, where the ranks agree on its plan.

Every MoE layer is a collective, so every rank runs every MoE layer of every step, a rank without
sequences with T = 0 tokens. At the first MoE layer of a step each rank posts (what it is doing, its
token count T, the fingerprint of its binding) to the group's control plane (the torch.distributed store,
``heap/control.py``: never a mapping of a peer) and reads everybody's; from the largest T all ranks
derive the same plan (decode-size: EPBuffer; prefill-size: PrefillBuffer in chunks). The meeting is
bounded by the group's timeout: a rank that does not come (dead, stuck, or simply not stepping with the
others) is named in ``StepTimeoutError``, never waited for forever; ranks that meet in different calls
or with different bindings raise ``StepMismatchError``. Both fail the group (sticky until
``group.reset()``), as every group-wide error does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from ...errors import CommTimeoutError, GroupError
from ...heap.control import ControlBlock

# What a rank does at a meeting (the first word it posts).
KIND_BIND = 1     # shard_experts: binding a model (collective)
KIND_STEP = 2     # a step this rank takes part in: a forward of its sequences, or idle_step (T = 0)
KIND_FINISH = 3   # finish(): done; steps with T = 0 while any other rank still steps
KIND_NAMES = {KIND_BIND: "shard_experts", KIND_STEP: "a model step", KIND_FINISH: "finish"}
OP = "hf.step"    # the op named in the errors
BLOCK_NAME = "hf_steps"   # the store keys of the meetings: <group prefix>/hf_steps/<seq>/<rank>
EPOCH_SHIFT = 32          # after group.reset() the meetings restart at sequence epoch << EPOCH_SHIFT


class StepTimeoutError(CommTimeoutError):
    """``peer`` did not come to step ``step`` within the timeout: dead, stuck, or not stepping with the
    others (every rank must run every step; a rank without sequences calls ``idle_step`` or ``finish``)."""

    def __init__(self, rank: int, peer: int, step: int, timeout_s: float):
        super().__init__(OP, rank, peer, timeout_s)
        self.step = step
        self.args = (f"{OP}: rank {rank} waited {timeout_s:g} s for rank {peer} to take part in step {step} of "
                     f"the transformers door: rank {peer} is dead, stuck, or not stepping with the others. Every "
                     f"MoE layer is a collective, so every rank runs every step: a rank with no sequences (or whose "
                     f"generation ended early) calls moe_comm.serving.hf.idle_step(model) per step, or "
                     f"moe_comm.serving.hf.finish(model) once at the end. The group is failed until group.reset() "
                     f"(or group.exclude([{peer}]))",)


class StepMismatchError(GroupError):
    """Ranks met in different calls (e.g. one binds a model while another steps) or with different
    bindings (models, thresholds or formats that differ between ranks)."""


@dataclass(frozen=True)
class StepPlan:
    """What every rank does in one step, the same on every rank."""

    step: int             # steps this binding has taken before this one
    tokens: tuple         # T of every rank (group rank order; 0 for a rank without sequences or not live)
    prefill: bool         # max(tokens) > decode_tokens: every MoE layer goes through the PrefillBuffer
    chunks: int           # PrefillBuffer calls per MoE layer (ceil(max T / prefill_tokens)); 1 when decoding
    finishing: tuple      # ranks that met in finish() (they take part with T = 0)

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)


def fingerprint(*values) -> int:
    """A 31-bit digest of a binding's settings (the same on every rank that binds the same model)."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


class StepMeetings:
    """The bounded meetings of one binding's ranks (world 1 meets nobody)."""

    def __init__(self, group, digest: int):
        self.group, self.digest = group, digest
        self._block = None
        self._epoch = group.epoch
        if group.world_size > 1:
            control = getattr(group.heap, "_control", None)
            if control is None:
                raise ValueError(f"the transformers door needs one process per rank (a CommGroup from "
                                 f"moe_comm.init() or moe_comm.launch); a {group.backend} group of "
                                 f"{group.world_size} ranks in one process cannot run a model per rank")
            self._block = ControlBlock(control.store, BLOCK_NAME, group.rank, group.world_size, group.timeout_s)
            self._block.realign(group.epoch << EPOCH_SHIFT)

    def meet(self, kind: int, tokens: int, step: int) -> dict[int, tuple[int, int]]:
        """Every live rank's (kind, tokens), after checking that they all came, in calls that fit together
        and with this binding. Raises the group's error first if it has one."""
        g = self.group
        g.check()
        mine = {g.rank: (kind, int(tokens))}
        if self._block is None:
            return mine
        if g.epoch != self._epoch:   # after reset()/exclude() every live rank restarts at the same sequence
            self._epoch = g.epoch
            self._block.realign(g.epoch << EPOCH_SHIFT)
        got, missing = self._block.allgather(g.live_ranks, [kind, int(tokens), self.digest], op=OP)
        if missing:
            self._fail(StepTimeoutError(g.rank, missing[0], step, g.timeout_s))
        for j, (k, _, digest) in sorted(got.items()):
            if digest != self.digest:
                self._fail(StepMismatchError(
                    f"{OP}: rank {j} bound a different model or settings than rank {g.rank} (experts, hidden size, "
                    f"top-k, dtype, MoE layers, decode_tokens, prefill_tokens, dispatch_format or layer_path differ): "
                    f"every rank loads the same model and calls shard_experts with the same arguments"))
            if (k == KIND_BIND) != (kind == KIND_BIND):
                self._fail(StepMismatchError(
                    f"{OP}: rank {g.rank} is in {KIND_NAMES[kind]} while rank {j} is in {KIND_NAMES[k]}: every rank "
                    f"binds its model (shard_experts) at the same point, before any rank steps"))
        return {j: (v[0], v[1]) for j, v in got.items()}

    def _fail(self, err: GroupError):
        """Make the error group-wide (the ranks that did come are failed too, at their next call) and raise."""
        g = self.group
        if isinstance(err, CommTimeoutError):
            g._fail_group(err)
        raise err
