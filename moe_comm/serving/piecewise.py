"""Piecewise CUDA graphs for a backend whose exchange reads the host (``sync-graphed``).

An engine that keeps a host-synced all-to-all still graphs everything else: the step is cut at every
exchange, each piece between two cuts is captured as its own CUDA graph, and the exchanges (split read,
collective) run eagerly between the replays. ``PiecewiseEngine`` does that for ``DecodeEngine``: the
models are phased (``MoEDecoder(phased=True)`` yields after every send phase), and at each yield the
backend's pending exchange (``take_pending``) runs eagerly, for every local rank in lockstep.

On the CPU (or ``use_graphs=False``) the same pieces and exchanges run eagerly, in the same order: the
code that is captured on a GPU is the code the CPU tests check against the reference model.

Capture: per bucket combination, after one eager warm-up on a side stream; the pieces share one memory
pool and are replayed in capture order. The exchanges touch only the backend's fixed buffers (allocated
outside the pool), so a replay feeds them and reads them correctly. In a process-per-rank world every
bucket is captured up front in the same order on every rank, since the exchanges are collectives.
"""

from __future__ import annotations

import torch

from .engine import DecodeEngine
from .model import drive_lockstep


class PiecewiseEngine(DecodeEngine):
    """``DecodeEngine`` for phased models over a backend with ``piecewise = True``.

    use_graphs: None = piecewise CUDA graphs on CUDA, eager on the CPU. ``self.use_graphs`` (the base
    engine's whole-step graphs) is always False; ``self.piecewise_graphs`` says whether pieces are
    captured. ``pieces_per_step``: graphs and eager exchanges of the last captured step.
    """

    def __init__(self, models, use_graphs: bool | None = None, buckets=None):
        if not all(m.phased for m in models):
            raise ValueError("PiecewiseEngine needs phased models (MoEDecoder(phased=True))")
        if not all(getattr(m.comm, "piecewise", False) for m in models):
            raise ValueError("PiecewiseEngine needs a backend with piecewise = True (sync-graphed)")
        super().__init__(models, use_graphs=False, buckets=buckets)
        cuda = self.device.type == "cuda"
        self.piecewise_graphs = cuda if use_graphs is None else bool(use_graphs)
        if self.piecewise_graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self._pieces: dict = {}
        self._plan = None  # while capturing: [("graph", CUDAGraph) | ("eager", [exchange fns])]
        self.pieces_per_step = (0, 0)
        if self.piecewise_graphs and len(self.models) == 1:
            for b in [0] + self.buckets:
                self._capture((b,))

    # ---- cutting the step at the exchanges ------------------------------------------------------------
    def _forward(self, tokens, slots, positions, valid, prefill=False):
        gens = [m.forward(*a, prefill=prefill) for m, a in zip(self.models, zip(tokens, slots, positions, valid))]
        return drive_lockstep(gens, between=self._cut)

    def _cut(self) -> None:
        """Every local rank has finished a send phase: run their pending exchanges (eager)."""
        fns = [f for f in (m.comm.take_pending() for m in self.models) if f is not None]
        if self._plan is None:
            _run_exchanges(fns)
            return
        self._end_piece()
        _run_exchanges(fns)  # outside any capture; rewritten by the replays
        self._plan.append(("eager", fns))
        self._begin_piece()

    def _begin_piece(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)

    def _end_piece(self) -> None:
        self._graph.capture_end()
        self._plan.append(("graph", self._graph))
        self._graph = None

    # ---- capture and replay -------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, key):
        metas = self._pad_metas(key)  # warm-up and capture touch only the scratch slot
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._decode_body(metas)
            side.synchronize()
            self._pool, self._plan = torch.cuda.graph_pool_handle(), []
            try:
                self._begin_piece()
                logits = self._decode_body(metas)
                self._end_piece()
                plan = self._plan
            finally:
                self._plan = None
        torch.cuda.current_stream().wait_stream(side)
        self._pieces[key] = (plan, metas, logits)
        self.pieces_per_step = (sum(k == "graph" for k, _ in plan), sum(k == "eager" for k, _ in plan))
        return self._pieces[key]

    def _decode_step(self, host_metas):
        if not self.piecewise_graphs:
            return super()._decode_step(host_metas)
        key = tuple(m.shape[1] for m in host_metas)
        plan, metas, logits = self._pieces.get(key) or self._capture(key)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for dst, src in zip(metas, host_metas):
            dst.copy_(src, non_blocking=True)
        for kind, item in plan:
            if kind == "graph":
                item.replay()
            else:
                _run_exchanges(item)
        end.record()
        self._events.append((start, end))
        self.step_buckets.append(key)
        return logits


def _run_exchanges(fns) -> None:
    """Each fn() is one rank's exchange generator; all ranks post before any fetches."""
    if fns:
        drive_lockstep([f() for f in fns])
