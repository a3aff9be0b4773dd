"""Host control plane of a heap: bounded barrier and all-gather over the live ranks, through the
torch.distributed store (never through a mapping of a peer's memory, so it works across nodes).

Every control operation of a block (barrier or all-gather) takes the block's next ``seq``; rank j posts
key ``<block>/<seq>/<j>`` (its payload, int64 words as text) and waits, bounded, until every live rank's
key of that ``seq`` exists. A rank is at most one operation ahead of a slower one (it waits for everybody
at each), so when it posts ``seq`` every live rank has read its key of ``seq - 2``: that key is deleted
then, and the store holds at most two keys per rank and block.

Waits are bounded by the block's timeout; a rank that does not arrive is named in CommTimeoutError (for a
barrier) or returned as missing (for an all-gather). A ``poll`` callback, called while waiting, may
raise to end the wait (a barrier on a failed group raises the group's error instead of waiting for ranks
that will not come). A heap keeps two blocks with their own sequences:
one for barriers and allocations, one for recovery (``reset``/``exclude``), so that a rank in recovery
never meets a peer's ordinary barrier; ``realign(base)`` restarts a block's sequence at a value every
live rank agrees on (after a reset, whatever barriers were cut short before it).

Recovery meetings (``reset``/``exclude``/``exchange``) are decided, not only gathered (``decide``): who
took part in a meeting is written once, by the first rank to propose it (``compare_set`` on an absent
key, which the store's server applies atomically, as for the failure record), and every rank reads that
decision instead of its own view of who arrived. Views differ (a rank that read the store just before
a late peer's arrival, one that read it just after), and without one decision ranks decided different
memberships: each side excluded the other and went on alone, every one believing it was the survivor.
With it there is one membership per meeting; a rank that arrives after the decision finds it, learns it
was left out (the group raises ExcludedError) and never proposes its own. Decisions are never deleted (a
rank may come very late), so the recovery block keeps two keys per meeting (arrivals and decision): a
handful per fault.

Where the store lives decides what survives a dead rank: ``moe_comm.launch`` hosts it in the launching
process and torchrun in its agent, so a killed rank is named by a timeout like any other peer; a store
hosted by rank 0 (a plain ``init_process_group`` without torchrun) dies with rank 0, and every survivor's
next control operation raises CommTimeoutError naming rank 0.
"""

from __future__ import annotations

import time
from datetime import timedelta

from ..errors import CommTimeoutError
from .base import Heap, all_ranks

PAYLOAD_WORDS = 8   # all-gather and meeting payload: up to 8 int64 words per rank (a kind + an exclusion mask of <= 441 ranks)
POLL_S = 0.0002     # first pause between two checks of the store while waiting; doubles up to POLL_MAX_S
POLL_MAX_S = 0.005  # (a waiting rank costs its peers, which may share its cores, little CPU)
STORE_HOST_RANK = 0  # named when the store itself stops answering (see the module docstring)
NAMESPACE = "moe_comm"
FAILED = "failed/{}"  # key: the first group-wide error the host found in epoch {} (post_failure)
ARRIVED = "arrived"  # key <block>/<seq>/arrived of a decided meeting: every arriving rank appends its entry
DECIDED = "decided"  # key <block>/<seq>/decided: the entries of the ranks that took part (first proposal wins)


def group_store(world: int):
    """The store every rank of this process's torch.distributed world shares, under a prefix of its own
    for this group (the n-th group made in this process: every rank makes its groups in the same order).
    A world of one needs no peer: an in-process store."""
    import torch.distributed as dist  # noqa: PLC0415
    if world == 1 or not dist.is_initialized():
        return dist.HashStore()
    from torch.distributed.distributed_c10d import _get_default_store  # noqa: PLC0415
    base = _get_default_store()
    n = base.add(f"{NAMESPACE}/groups/{dist.get_rank()}", 1)
    return dist.PrefixStore(f"{NAMESPACE}/g{n}", base)


def _entry(rank: int, payload) -> str:
    """One rank's part of a decided meeting as text: ``rank:word,word;``."""
    return f"{rank}:" + ",".join(str(int(v)) for v in payload) + ";"


def _entries(text: str) -> dict[int, list[int]]:
    """{rank: payload} of concatenated ``_entry`` texts."""
    out = {}
    for part in filter(None, text.split(";")):
        j, _, words = part.partition(":")
        out[int(j)] = [int(v) for v in words.split(",")] if words else []
    return out


class ControlBlock:
    """One sequence of control operations of ``rank`` over ``world`` ranks, as keys under ``name``."""

    def __init__(self, store, name: str, rank: int, world: int, timeout_s: float):
        self.store, self.name, self.rank, self.world, self.timeout_s = store, name, rank, world, timeout_s
        self.seq = 0

    def _key(self, seq: int, j: int) -> str:
        return f"{self.name}/{seq}/{j}"

    def _store(self, what, op: str):
        """Run a store call; a store that stopped answering is a timeout of the rank that hosts it."""
        try:
            return what()
        except (RuntimeError, TimeoutError) as e:  # c10d's DistStoreError/DistNetworkError are RuntimeErrors
            raise CommTimeoutError(op, self.rank, STORE_HOST_RANK, self.timeout_s) from e

    def _post(self, payload: list[int], op: str) -> None:
        self.seq += 1
        value = ",".join(str(int(v)) for v in payload).encode()
        self._store(lambda: self.store.set(self._key(self.seq, self.rank), value), op)
        old = self._key(self.seq - 2, self.rank)
        self._store(lambda: self.store.delete_key(old), op)

    def _wait(self, ranks, op: str, poll=None) -> list[int]:
        """Wait for ``ranks``' keys of this seq; returns the ranks still missing at the deadline (one
        store round trip per poll; each rank is looked up alone only to name the missing ones)."""
        keys = [self._key(self.seq, j) for j in ranks]
        deadline, pause = time.monotonic() + self.timeout_s, POLL_S
        while not self._store(lambda: self.store.check(keys), op):
            if time.monotonic() >= deadline:
                return [j for j, k in zip(ranks, keys) if not self._store(lambda k=k: self.store.check([k]), op)]
            if poll is not None:
                poll()
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        return []

    def decide(self, members, payload: list[int], op: str) -> dict[int, list[int]]:
        """The decided membership of this recovery meeting: ``{rank: payload}`` of the ranks that took part,
        the same dict on every rank that reads it: a subset of ``members``, without this rank when it came
        after the decision. Proposed when every member came, else at the timeout with more than half of
        ``members``, else at twice the timeout (a decision that leaves at most half, e.g. one rank alone,
        waits once more for ranks that are late rather than dead). The first proposal wins."""
        if len(payload) > PAYLOAD_WORDS:
            raise ValueError(f"meeting payload of {len(payload)} words, at most {PAYLOAD_WORDS}")
        self.seq += 1
        arrived, decided = (f"{self.name}/{self.seq}/{k}" for k in (ARRIVED, DECIDED))
        check, get = (lambda k: self._store(lambda: self.store.check([k]), op),
                      lambda k: self._store(lambda: self.store.get(k), op).decode())
        if not check(decided):   # not decided yet: take part (else this rank came late and reads it)
            self._store(lambda: self.store.append(arrived, _entry(self.rank, payload).encode()), op)
        members, pause, t0 = sorted(members), POLL_S, time.monotonic()
        while not check(decided):
            seen = _entries(get(arrived))
            here = {j: seen[j] for j in members if j in seen}
            waited = time.monotonic() - t0
            if (len(here) == len(members) or waited >= 2 * self.timeout_s
                    or (waited >= self.timeout_s and 2 * len(here) > len(members))):
                value = "".join(_entry(j, v) for j, v in sorted(here.items()))
                return _entries(self._store(lambda: self.store.compare_set(decided, "", value), op).decode())
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        return _entries(get(decided))

    def realign(self, base: int) -> None:
        """Restart this rank's sequence at ``base`` (larger than any sequence posted before)."""
        self.seq = base

    def barrier(self, live, op: str = "barrier", poll=None) -> None:
        """Every live rank arrives, or CommTimeoutError names the first missing one."""
        self._post([], op)
        missing = self._wait(live, op, poll)
        if missing:
            raise CommTimeoutError(op, self.rank, missing[0], self.timeout_s)

    def allgather(self, live, payload: list[int], op: str = "agree") -> tuple[dict[int, list[int]], list[int]]:
        """Every live rank's payload (``len(payload)`` words), and the live ranks that did not answer."""
        if len(payload) > PAYLOAD_WORDS:
            raise ValueError(f"all-gather payload of {len(payload)} words, at most {PAYLOAD_WORDS}")
        self._post(payload, op)
        missing = self._wait(live, op)
        got = {}
        for j in live:
            if j not in missing:
                raw = self._store(lambda: self.store.get(self._key(self.seq, j)), op).decode()
                got[j] = [int(v) for v in raw.split(",")] if raw else []
        return got, missing


class ControlledHeap(Heap):
    """A heap whose barriers and recovery meetings run over two ControlBlocks in the store (shm and
    nvshmem): a barrier block (barriers, allocations) and a recovery block (``agree``: decided meetings
    whose timeout is twice the group's, ranks reach recovery up to one timeout apart, see
    ``CommGroup._agree``). Subclasses call ``_start_control(store)`` before their first allocation and
    implement ``_release_mappings``; ``_excluded`` holds released peers."""

    _control: ControlBlock | None = None
    _recovery: ControlBlock | None = None

    def _start_control(self, store) -> None:
        self._control = ControlBlock(store, "barrier", self.rank, self.world_size, self.timeout_s)
        self._recovery = ControlBlock(store, "recovery", self.rank, self.world_size, 2 * self.timeout_s)

    def barrier(self, live=None, op: str = "barrier", poll=None) -> None:
        self._control.barrier(all_ranks(self, live), op, poll)

    def agree(self, live, payload):
        members = all_ranks(self, live)
        got = self._recovery.decide(members, payload, "recovery")
        return got, [j for j in members if j not in got]

    def realign_barriers(self, base: int) -> None:
        self._control.realign(base)

    def post_failure(self, epoch: int, record: list[int]) -> None:
        if not all(self.reachable()):   # first record of the epoch wins (compare-and-set on an absent key)
            value = ",".join(str(int(v)) for v in record)
            self._control._store(lambda: self._control.store.compare_set(FAILED.format(epoch), "", value),
                                 "barrier")

    def posted_failure(self, epoch: int) -> list[int] | None:
        if all(self.reachable()):
            return None
        key, block = FAILED.format(epoch), self._control
        if not block._store(lambda: block.store.check([key]), "barrier"):
            return None
        return [int(v) for v in block._store(lambda: block.store.get(key), "barrier").decode().split(",")]

    def release_peer(self, peer: int) -> None:
        self._excluded.add(peer)
        self._release_mappings(peer)

    def _release_mappings(self, peer: int) -> None:
        """Repoint every buffer's ``peer_ptrs[peer]`` at this rank's copy and drop the peer's mappings."""
        raise NotImplementedError


def launcher_store(port: int, world: int):
    """A store server in the launching process (``moe_comm.launch``): it outlives any rank. The ranks
    connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``, torchrun's convention)."""
    from torch.distributed import TCPStore  # noqa: PLC0415
    return TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=60))

