"""DecodeEngine: vLLM-style batched greedy decoding over data-parallel ranks with expert-parallel MoE.

Each rank holds its own requests. Prompts are prefilled in chunks of up to ``max_batch`` tokens (eager;
through the backend's high-throughput op where it has one: moe_comm.PrefillBuffer for ``fused``),
then every decode step runs one token per live request, padded up to a batch-size bucket (1, 2, 4, ...,
max_batch). All ranks take the same number of steps in lockstep, since every MoE layer is a collective: a
rank whose requests are done (or that has none) runs dummy steps with T = 0 tokens.

On CUDA with a capturable backend every bucket's step is captured once in a CUDA graph and replayed; on the
CPU (and for the ``sync`` backend, which reads counts on the host) steps run eagerly.

Faults (docs/faults.md): after every step the engine checks the moe-comm groups' error
words without a device sync. On CUDA it first waits for the *previous* step to finish (the GPU keeps the
current one queued), so an error is raised at most one step late; on the CPU the ops raise in the step
itself. On a group-wide error the engine recovers: ``reset()`` on every live rank, or, when a rank does
not come to the reset (dead), ``exclude()`` of that rank; then the ranks agree on the oldest step not
known to be good and run again from there (prefill chunks likewise). Steps are deterministic and
rewrite the KV cache positions they own, so a replayed step gives the results it would have given.
The requests of an excluded rank are lost (``lost_ranks``); the others go on with the excluded rank's
experts unrouted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ..errors import CommTimeoutError, GroupError
from ..recovery import recover
from .model import MoEDecoder, drive_lockstep, run_to_end


@dataclass
class Request:
    """prompt: token ids (>= 1 of them); max_new_tokens >= 1 tokens are generated greedily."""

    prompt: list[int]
    max_new_tokens: int


@dataclass
class Generation:
    """tokens: the generated ids; logits [max_new_tokens, vocab] float32 on the CPU (row i chose tokens[i]),
    or None when not recorded. lost: the request's rank was excluded after a fault (tokens are partial)."""

    tokens: list[int]
    logits: torch.Tensor | None = None
    lost: bool = False


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def global_max(values: list[int], device: torch.device) -> list[int]:
    """Element-wise max over every process of the default torch.distributed group (identity without one)."""
    import torch.distributed as dist  # noqa: PLC0415
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    on = torch.device("cpu") if "gloo" in str(dist.get_backend()) else device
    t = torch.tensor(values, dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class DecodeEngine:
    """Drives the ranks this process holds: one ``MoEDecoder`` per process-per-rank world, or every rank of
    a loopback world (phased models, driven in lockstep).

    buckets: decode batch sizes steps are padded to (default 1, 2, 4, ..., max_batch).
    use_graphs: None = CUDA graphs when on CUDA and the backend is capturable. In a process-per-rank world
    every bucket (0 included) is captured up front, in the same order on every rank, because warm-up and
    capture run collectives; in a loopback world a combination of buckets is captured when first seen.
    After ``generate``: ``step_us`` [decode steps] float (this process's wall time per decode step, CUDA
    events on a GPU) and ``step_buckets`` (the bucket of every local rank, per step); ``recoveries``: one
    (where, step, error, step resumed from) per recovered fault; ``lost_ranks``: ranks excluded after they failed.
    max_recoveries: faults one ``generate`` recovers from before it gives up and raises the error.
    trace_dir: on every group-wide error, before recovering, each driven rank's flight recorder is dumped
    (``group.dump_trace``) into ``trace_dir/fault<n>`` (n counts the faults, from 1; the recorder must be on:
    ``MOE_COMM_TRACE``); analyze with ``python -m moe_comm trace trace_dir/fault<n>``.
    """

    max_recoveries = 8

    def __init__(self, models: list[MoEDecoder], use_graphs: bool | None = None, buckets: list[int] | None = None,
                 trace_dir=None):
        self.models = list(models)
        m0 = self.models[0]
        self.cfg, self.device, self.max_batch = m0.cfg, m0.device, m0.max_batch
        self.buckets = bucket_sizes(self.max_batch) if buckets is None else sorted(buckets)
        if self.buckets[-1] != self.max_batch or self.buckets[0] < 1:
            raise ValueError(f"buckets must be >= 1 and end at max_batch={self.max_batch}, got {buckets}")
        capturable = all(m.comm.capturable for m in self.models)
        if use_graphs is None:
            use_graphs = self.device.type == "cuda" and capturable
        if use_graphs and (self.device.type != "cuda" or not capturable):
            raise ValueError("CUDA graphs need a CUDA device and a capturable backend")
        self.use_graphs = use_graphs
        # seq_tokens[slot, p] = token at position p of the sequence in that slot; a step at position p
        # reads column p and writes its greedy choice to column p + 1.
        self.seq_tokens = [torch.zeros(m.max_batch + 1, self.cfg.max_seq + 1, dtype=torch.int64, device=self.device)
                           for m in self.models]
        self._graphs: dict[tuple, tuple] = {}
        self.step_us: list[float] = []
        self.step_buckets: list[tuple] = []
        self.groups = [g for m in self.models for g in m.comm.groups]  # moe-comm groups to check and recover
        self.recoveries: list[tuple] = []
        self.lost_ranks: list[int] = []
        self.trace_dir = trace_dir
        if use_graphs and len(self.models) == 1:
            for b in [0] + self.buckets:
                self._graph_for((b,))

    # ---- one step ------------------------------------------------------------------------------------
    def _forward(self, tokens, slots, positions, valid, prefill=False):
        gens = [m.forward(*a, prefill=prefill) for m, a in zip(self.models, zip(tokens, slots, positions, valid))]
        return drive_lockstep(gens) if self.models[0].phased else [run_to_end(g) for g in gens]

    def _decode_body(self, metas):
        """metas: per local rank int64 [3, B] = (slots, positions, valid) -> logits per rank [B, vocab]."""
        slots = [m[0] for m in metas]
        positions = [m[1] for m in metas]
        tokens = [st[s, p] for st, s, p in zip(self.seq_tokens, slots, positions)]
        logits = self._forward(tokens, slots, positions, [m[2].bool() for m in metas])
        for st, s, p, lg in zip(self.seq_tokens, slots, positions, logits):
            st[s, p + 1] = lg.argmax(-1)  # padding rows write the scratch slot
        return logits

    def _pad_metas(self, key):
        return [torch.tensor([[m.pad_slot] * b, [0] * b, [0] * b], dtype=torch.int64, device=self.device)
                for m, b in zip(self.models, key)]

    @torch.no_grad()
    def _graph_for(self, key):
        if key not in self._graphs:
            metas = self._pad_metas(key)  # warm-up and capture touch only the scratch slot
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode_body(metas)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._decode_body(metas)
            self._graphs[key] = (graph, metas, logits)
        return self._graphs[key]

    def _decode_step(self, host_metas):
        key = tuple(m.shape[1] for m in host_metas)
        if self.use_graphs:
            graph, metas, logits = self._graph_for(key)  # a first-seen combination is captured untimed
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        if self.use_graphs:
            for dst, src in zip(metas, host_metas):
                dst.copy_(src, non_blocking=True)
            graph.replay()
        else:
            logits = self._decode_body([m.to(self.device, non_blocking=True) for m in host_metas])
        if self.device.type == "cuda":
            end.record()
            self._events.append((start, end))
        else:
            self.step_us.append((time.perf_counter() - t0) * 1e6)
        self.step_buckets.append(key)
        return logits

    # ---- generate ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[list[Request]], record_logits: bool = False) -> list[list[Generation]]:
        """requests[i]: the requests of local rank i (may be empty). Returns their Generations, same layout.

        Collective: every process of the world calls it at the same time.
        """
        if len(requests) != len(self.models):
            raise ValueError(f"need one request list per local rank ({len(self.models)}), got {len(requests)}")
        for reqs in requests:
            if len(reqs) > self.max_batch:
                raise ValueError(f"{len(reqs)} requests > max_batch={self.max_batch}")
            for r in reqs:
                if not r.prompt or r.max_new_tokens < 1 or len(r.prompt) + r.max_new_tokens > self.cfg.max_seq:
                    raise ValueError(f"need 1 <= len(prompt), 1 <= max_new_tokens, sum <= max_seq={self.cfg.max_seq}")
        self.step_us, self.step_buckets, self._events = [], [], []
        self._keep = list(range(len(self.models)))   # local ranks still driven (all, unless one is excluded)
        seq_tokens = list(self.seq_tokens)
        self._rows: dict[tuple, dict] = {}           # (local rank, request) -> {step: logits row}; -1 = prefill
        chunks = [self._prefill_chunks(reqs) for reqs in requests]
        steps = [max((r.max_new_tokens for r in reqs), default=1) - 1 for reqs in requests]
        n_chunks, n_steps = global_max([max(map(len, chunks)), max(steps)], self.device)
        self._run_recoverable("prefill", n_chunks, lambda c: self._prefill(
            [chunks[k][c] if c < len(chunks[k]) else [] for k in self._keep], record_logits))
        self._run_recoverable("decode", n_steps, lambda s: self._decode(s, requests, record_logits))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.step_us = [s.elapsed_time(e) * 1e3 for s, e in self._events]
        out = []
        for k, reqs in enumerate(requests):
            table = seq_tokens[k].cpu()
            gens = []
            for i, r in enumerate(reqs):
                p = len(r.prompt)
                rows = self._rows.get((k, i), {})
                gens.append(Generation(table[i, p:p + r.max_new_tokens].tolist(),
                                       torch.stack([rows[t] for t in sorted(rows)]) if record_logits else None,
                                       lost=k not in self._keep))
            out.append(gens)
        return out

    def _decode(self, s, requests, record_logits):
        """Decode step ``s`` of every local rank driven (logits rows are kept per step: a replay replaces them)."""
        host_metas, live = [], []
        for m, reqs in zip(self.models, [requests[k] for k in self._keep]):
            rows = [i for i, r in enumerate(reqs) if s + 1 < r.max_new_tokens]
            b = next(b for b in [0] + self.buckets if b >= len(rows))
            pad = b - len(rows)
            host_metas.append(torch.tensor(
                [rows + [m.pad_slot] * pad,
                 [len(reqs[i].prompt) + s for i in rows] + [0] * pad,
                 [1] * len(rows) + [0] * pad], dtype=torch.int64).view(3, b))
            live.append(rows)
        logits = self._decode_step(host_metas)
        if record_logits:
            for k, lg, rows in zip(self._keep, logits, live):
                for j, i in enumerate(rows):
                    self._rows.setdefault((k, i), {})[s] = lg[j].cpu()

    # ---- faults ----------------------------------------------------------------------------------
    def _run_recoverable(self, where: str, count: int, run) -> None:
        """run(i) for i in range(count), checking the groups after each; on a group-wide error, recover
        and run again from the oldest i not known to be good on every live rank."""
        i, good, recovered = 0, 0, 0  # good: every i < good is known good here
        while i < count:
            try:
                run(i)
                good = self._check_groups(where, i, good)
                i += 1
            except GroupError as err:
                recovered += 1
                self._dump_traces(err)
                if recovered > self.max_recoveries:
                    raise
                resume = self._recover_and_resume(good)
                self.recoveries.append((where, i, repr(err), resume))
                i = good = resume

    def _recover_and_resume(self, good: int) -> int:
        """``_recover``, then the step every live rank resumes at: the lowest ``good`` of them
        (``exchange``). A rank that comes to the exchange after the others decided it without it raises
        ExcludedError there; the others get CommTimeoutError naming it and recover again (its absence
        from the reset excludes it), then exchange again: once per rank left out, at most."""
        while True:
            self._recover()
            try:
                return min(v[0] for v in self.groups[0].exchange([good]).values())
            except CommTimeoutError:
                continue

    def _dump_traces(self, err: GroupError) -> None:
        """``trace_dir`` given: every driven rank's flight recorder into ``trace_dir/fault<n>``."""
        if self.trace_dir is None:
            return
        where = os.path.join(self.trace_dir, f"fault{len(self.recoveries) + 1}")
        for g in self.groups:
            g.dump_trace(where, err)

    def _check_groups(self, where: str, i: int, good: int) -> int:
        """After step ``i``: raise what the groups recorded; returns the new count of known-good steps.
        A replayed graph step may still run on CUDA: wait for the one before it (the device stays busy
        with step i), so a fault is seen at most one step late. Eager steps have finished (CPU) or are
        waited for."""
        if not self.groups:
            return i + 1
        lag = 0
        if self.device.type == "cuda":
            if where == "decode" and self.use_graphs and len(self._events) >= 2:
                self._events[-2][1].synchronize()
                lag = 1
            else:
                torch.cuda.current_stream().synchronize()
        for g in self.groups:
            g.check()
        return max(good, i + 1 - lag)

    def _recover(self) -> None:
        """Every driven local rank: reset(); a rank that does not come to the reset (dead) is excluded,
        and its requests are lost."""
        gone = recover(self.groups)
        if gone:
            self.lost_ranks += [r for r in gone if r not in self.lost_ranks]
            keep = [n for n, g in enumerate(self.groups) if g.rank not in gone]
            self._keep = [self._keep[n] for n in keep]  # a loopback world stops driving them
            self.models = [self.models[n] for n in keep]
            self.seq_tokens = [self.seq_tokens[n] for n in keep]
            self.groups = [self.groups[n] for n in keep]
            self._graphs.clear()

    def _prefill_chunks(self, reqs):
        """Flatten every prompt token as (slot, position, token, last-of-prompt) and cut into steps of <= max_batch."""
        rows = [(i, p, tok, p == len(r.prompt) - 1) for i, r in enumerate(reqs) for p, tok in enumerate(r.prompt)]
        return [rows[k:k + self.max_batch] for k in range(0, len(rows), self.max_batch)] or [[]]

    def _prefill(self, chunk_per_rank, record_logits):
        """One prefill step: every driven local rank's chunk of prompt tokens (maybe none), eager."""
        dev = self.device
        cols = [list(zip(*ch)) if ch else [[], [], [], []] for ch in chunk_per_rank]
        slots = [torch.tensor(c[0], dtype=torch.int64, device=dev) for c in cols]
        positions = [torch.tensor(c[1], dtype=torch.int64, device=dev) for c in cols]
        tokens = [torch.tensor(c[2], dtype=torch.int64, device=dev) for c in cols]
        for st, s, p, t in zip(self.seq_tokens, slots, positions, tokens):
            st[s, p] = t
        valid = [torch.ones(len(c[0]), dtype=torch.bool, device=dev) for c in cols]
        logits = self._forward(tokens, slots, positions, valid, prefill=True)
        for k, st, c, lg in zip(self._keep, self.seq_tokens, cols, logits):
            last = [j for j, is_last in enumerate(c[3]) if is_last]
            if not last:
                continue
            idx = torch.tensor(last, device=dev)
            s = torch.tensor([c[0][j] for j in last], dtype=torch.int64, device=dev)
            p = torch.tensor([c[1][j] for j in last], dtype=torch.int64, device=dev)
            st[s, p + 1] = lg[idx].argmax(-1)
            if record_logits:
                for j, row in zip(last, lg[idx].cpu()):
                    self._rows.setdefault((k, c[0][j]), {})[-1] = row
