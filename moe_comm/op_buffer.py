"""The lifetime shared by the EP ops (``EPBuffer``, ``PrefillBuffer``): symmetric buffers allocated by the
first call, one dispatch and one combine (``PhasedOp`` + ``Channel`` each), closed together."""

from __future__ import annotations

import torch

from .errors import ClosedError


class OpBuffer:
    """Subclasses set ``_closed = _allocated = False`` and implement ``_allocate()``, which builds
    ``_dispatch_op``, ``_combine_op``, ``_dispatch_ch`` and ``_combine_ch`` and sets ``_allocated``; a
    static ``_plan(world, num_experts, hidden, max_tokens_per_rank, topk, dtype, fp8_dispatch, device,
    **options)`` (options: the class's own constructor options, with defaults) checks the sizes and returns
    the plan (``self.plan``, with ``buffer_bytes``); ``_stats`` counts the slots received per local expert."""

    @classmethod
    def required_bytes(cls, world_size: int, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                       dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = False, **options) -> int:
        """``buffer_bytes`` of a buffer of this class with these sizes, without a group and without allocating;
        ``options``: the class's own constructor options (PrefillBuffer: ``zones``)."""
        return cls._plan(world_size, num_experts, hidden, max_tokens_per_rank, topk, dtype, fp8_dispatch,
                         "cpu", **options).buffer_bytes

    @property
    def buffer_bytes(self) -> int:
        """Symmetric + local bytes this buffer holds once allocated (its plan, ``moe_comm.planner``)."""
        return self.plan.buffer_bytes

    @property
    def expert_token_counts(self) -> torch.Tensor:
        """int64 [E_local] on the device: slots received per local expert, summed over dispatch calls
        (the live counter: ``.clone()`` it for a snapshot). Reading it on the host syncs, as any read."""
        return self._stats

    def close(self) -> None:
        """Free the symmetric buffers (collective). Any later call raises ClosedError."""
        if self._closed:
            return
        self._closed = True
        if self._allocated:
            self._dispatch_op.mark_closed()
            self._combine_op.mark_closed()
            if not self.group.closed:
                self._combine_ch.free()
                self._dispatch_ch.free()

    def _ensure_allocated(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__}: used after close()")
        self.group.ensure_open()
        if not self._allocated:
            self._allocate()
