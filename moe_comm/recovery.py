"""The recovery policy a serving loop applies after a group-wide error (docs/faults.md).

``recover(groups)``: ``reset()`` every given group (the ranks this process drives: one for a real rank,
several on a loopback world); if the reset's meeting was decided without some ranks (dead, or stuck past
twice the timeout: ``CommTimeoutError.missing``), ``exclude()`` them on every surviving group (the
exclusion is decided once too: a rank another survivor names is excluded as well, and ``exclude`` ends
with a reset). A rank the meeting left out raises ExcludedError from here when it comes, as at every
later call. Returns the ranks excluded by this call. Used by ``DecodeEngine`` and, for serving
frameworks, by ``moe_comm.serving.ep_group.recover``. It is a collective: every live rank calls it after
the same error.
"""

from __future__ import annotations

from .errors import CommTimeoutError


def recover(groups) -> list[int]:
    groups = list(groups)
    try:
        for g in groups:
            g.reset()
        return []
    except CommTimeoutError as missing:
        gone = set(missing.missing or [missing.peer])
        for g in groups:
            if g.rank not in gone:
                gone |= set(g.exclude(sorted(gone)))
        return sorted(gone)
