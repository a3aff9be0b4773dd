"""Nodes and rails of a group whose peers are reached by two transports (host side).

A *node* is the set of ranks a rank reaches by stores (``group.transports``, ``moe_comm/transport.py``):
one NVLink domain on GPUs, one emulated node on the CPU (``MOE_COMM_RANKS_PER_NODE``). When every peer,
this rank included, is a put peer (``MOE_COMM_TRANSPORT=put``) each rank is a node of its own. The
hierarchical prefill path (docs/prefill.md "Across nodes") needs nodes of G consecutive ranks, rank =
node * G + local index, as DeepEP and torchrun lay them out.

A source rank s reaches node n through its *rail* there: the rank of n with s's local index, or, if that
rank is excluded, the next live rank of n in cyclic local order (None if every rank of n is excluded).
The device computes the same function from the live mask (``triton_kernels/prefill_dispatch.rails_of``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import TRANSPORT_STORE


@dataclass(frozen=True)
class NodeLayout:
    """Nodes of G consecutive ranks."""

    world: int            # ranks in the group
    ranks_per_node: int   # G: ranks of one node (1 when every peer is reached by puts)

    @property
    def nodes(self) -> int:
        """N = world / G."""
        return self.world // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks(self, node: int) -> range:
        g = self.ranks_per_node
        return range(node * g, node * g + g)

    def rail(self, src: int, node: int, live) -> int | None:
        """The rank of ``node`` that receives source ``src``'s rows for that node (``live``: a bool per
        rank): the one with src's local index, else the next live one in cyclic local order; None if
        no rank of ``node`` is live."""
        g = self.ranks_per_node
        for step in range(g):
            r = node * g + (src % g + step) % g
            if live[r]:
                return r
        return None


def node_layout(transports, rank: int) -> NodeLayout:
    """The node layout seen from ``rank`` whose transport to every rank is ``transports``: G = the ranks it
    reaches by stores (1 if none). Raises NotImplementedError, naming the layout, when those ranks are not
    G consecutive ranks starting at a multiple of G, or G does not divide the world."""
    world = len(transports)
    near = [j for j, t in enumerate(transports) if t == TRANSPORT_STORE]
    g = len(near) or 1
    expected = list(range(rank - rank % g, rank - rank % g + g)) if near else []
    if world % g or near != expected:
        raise NotImplementedError(
            f"rank {rank} reaches ranks {near} by stores and the rest of its {world} ranks by puts: the "
            f"prefill path across nodes needs nodes of equal size made of consecutive ranks (rank = node * "
            f"ranks_per_node + local index), as torchrun lays them out")
    return NodeLayout(world, g)
