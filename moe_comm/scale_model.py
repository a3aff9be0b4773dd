"""Scale model: latency of one EP dispatch or combine on EP8 ... EP256, from link parameters and
measured per-rank kernel costs.

No GPU and no multi-node machine is needed: the model is arithmetic on named constants. It is first
checked against peers' published low-latency numbers (``validation_rows``), modelling *their* designs
(message granularity, payload format, kernels per op) with the same formula, and only then used to
predict this project's rows (``prediction_rows``), which are labelled as predictions.

The formula, for one rank sending T tokens, top-k K, E experts over N ranks, G GPUs per node:

    t = local + latency + max(t_nvlink, t_rdma) + messages * msg_overhead

- ``local``: the rank's own kernel work (packing, quantizing, reducing, launches). Taken from this
  project's measured world-1 kernel times at the same T and dtype (one kernel per op at world 1), plus
  one measured empty launch per extra kernel the design runs per op. The peers' per-rank costs are not
  published apart from their totals, so every design is charged the same measured local work.
- ``messages``: what the design sends. Per (token, expert) slot (DeepEP low-latency, pplx-kernels:
  T*K messages, a token with two experts on one rank crosses twice) or per (token, destination rank)
  (this project's dispatch: a token crosses to a rank at most once). The expected number of distinct
  ranks among a token's K experts (uniform routing, without replacement) is
  ``N * (1 - C(E - E/N, K) / C(E, K))``. Messages to this rank itself stay local (no link).
- ``t_nvlink`` / ``t_rdma``: bytes to peers in the same node over NVLink, to other nodes over one NIC
  per GPU, each at its effective bandwidth; the two paths run concurrently (the op waits for the
  slower). The receiving side is the bottleneck of a uniform random routing: the busiest of N ranks
  receives ``1 + sqrt(2 ln N) / sqrt(n)`` times the mean of n messages (expected maximum of N
  near-normal counts), applied to both terms.
- ``latency``: one-way latency of the farthest link used (data and its completion flag are pipelined;
  one latency, not two).
- ``msg_overhead``: per message, fitted once (``fit_msg_overhead``) to DeepEP's EP8 rows.

Units: bytes, GB/s (1e9 B/s), microseconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .planner import route_row_words

# ---- link parameters (all named; sources in each comment) --------------------------------------

# NVLink 4 per direction: H100 SXM 900 GB/s bidirectional -> 450 GB/s per direction; H800 SXM is
# capped at 400 GB/s bidirectional -> 200 GB/s per direction (NVIDIA data sheets).
NVLINK_H100_GBPS = 450.0
NVLINK_H800_GBPS = 200.0
# Fraction of NVLink line rate a GPU-initiated all-to-all reaches: DeepEP's intranode normal kernels
# report 153-158 GB/s of NVLink bottleneck bandwidth on H800 (200 GB/s/direction) -> 0.775.
NVLINK_EFFICIENCY = 155.0 / 200.0
# ConnectX-7 400 Gb/s InfiniBand: 50 GB/s per NIC, one NIC per GPU.
RDMA_CX7_GBPS = 50.0
# Fraction reached: 43 GB/s of 50, from DeepEP's EP16 internode normal figure read as RDMA-bound. The
# prefill model below shows that row NVLink-bound (its "RDMA" metric counts the tokens of the own node
# too), so 0.86 is an assumption there; DeepEP's EP32 and EP64 normal rows, RDMA-bound in that model,
# come out within 3-5 % with it (``prefill_validation_rows``).
RDMA_EFFICIENCY = 43.0 / 50.0
# One-way latency of a GPU-initiated put plus its flag becoming visible to the polling receiver.
# Estimates, not fitted: NVLink peer store ~1-2 us; IBGDA put across one IB switch ~3-5 us (wire
# ~1-2 us, the GPU-written doorbell and the NIC's PCIe reads of the payload the rest). Every row
# moves by at most +-3 us if these are halved or doubled.
LATENCY_NVLINK_US = 2.0
LATENCY_RDMA_US = 4.0
# Cost per message on the sending/receiving GPUs (issuing a put or a row copy, writing and polling
# its flag, bookkeeping per received slot), serialized per rank. The one fitted parameter: not a
# constant here but ``fit_msg_overhead``, a least-squares fit (relative error) to DeepEP's EP8
# dispatch and combine only (the rows with the most messages over the fastest link); every other
# validation row is out of sample.
FIT_ROWS = ("DeepEP-LL", 8)
GPUS_PER_NODE = 8

# ---- decode shapes -------------------------------------------------------------------------------

HIDDEN = 7168
TOPK = 8
EXPERTS = 256
BF16_BYTES = 2
FP8_GROUP = 128          # columns per float32 scale (DeepEP / DeepGEMM format)
WORLDS = (8, 16, 32, 64, 128, 256)
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)


@dataclass(frozen=True)
class Fabric:
    name: str
    nvlink_gbps: float       # line rate per direction
    rdma_gbps: float         # per NIC (one per GPU)
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def nvlink_eff(self) -> float:
        return self.nvlink_gbps * NVLINK_EFFICIENCY

    @property
    def rdma_eff(self) -> float:
        return self.rdma_gbps * RDMA_EFFICIENCY


H800_CX7 = Fabric("H800 + CX7 (NVLink 200 GB/s/dir, RDMA 50 GB/s)", NVLINK_H800_GBPS, RDMA_CX7_GBPS)
H100_CX7 = Fabric("H100 + CX7 (NVLink 450 GB/s/dir, RDMA 50 GB/s)", NVLINK_H100_GBPS, RDMA_CX7_GBPS)


@dataclass(frozen=True)
class Design:
    """How one implementation moves a token. ``per_rank``: one message per (token, destination rank)
    (the token is deduplicated per rank); otherwise one per (token, expert) slot. ``kernels``: kernel
    launches per op at world > 1 (the measured local cost already holds one)."""

    name: str
    op: str                  # "dispatch" | "combine"
    dtype: str               # "fp8" | "bf16"
    msg_bytes: int
    per_rank: bool
    kernels: int = 1


def fp8_row_bytes(hidden: int) -> int:
    return hidden + hidden // FP8_GROUP * 4


def deepep_ll(op: str, hidden: int = HIDDEN) -> Design:
    """DeepEP low-latency: one kernel per op (send and receive phases in one launch); a message per
    (token, expert). Dispatch fp8 (row + scales + 16 B of source info), combine bf16."""
    if op == "dispatch":
        return Design("DeepEP-LL", op, "fp8", fp8_row_bytes(hidden) + 16, per_rank=False)
    return Design("DeepEP-LL", op, "bf16", hidden * BF16_BYTES, per_rank=False)


def pplx(op: str, hidden: int = HIDDEN) -> Design:
    """pplx-kernels: a message per (token, expert) both ways; dispatch fp8 with one scale per 128
    columns, combine bf16; send and receive kernels."""
    if op == "dispatch":
        return Design("pplx-kernels", op, "fp8", fp8_row_bytes(hidden), per_rank=False, kernels=2)
    return Design("pplx-kernels", op, "bf16", hidden * BF16_BYTES, per_rank=False, kernels=2)


def moe_comm_design(op: str, dtype: str, hidden: int = HIDDEN, topk: int = TOPK) -> Design:
    """This project (``EPBuffer``): dispatch sends a token to a rank once; combine returns each slot's
    bf16 row (no reduction on the expert side); send and receive kernels at world > 1.

    Bytes per message are those the emulated nodes' wire measured equal to the floor
    (``bench/wire_bytes.py``, ``tests/test_emulated_nodes.py``): a dispatch row of the put layout
    (payload, fp8 scales, K routing words and the token index, padded to 16 bytes: ``EPPlan.with_put``),
    a combine row of ``hidden`` bf16 values. A peer inside the node gets the store layout's row, up to
    16 bytes shorter (no index word); the model charges every message the put row."""
    if op == "dispatch":
        payload_words = hidden // 4 + hidden // FP8_GROUP if dtype == "fp8" else hidden * BF16_BYTES // 4
        return Design("moe-comm", op, dtype, route_row_words(payload_words, topk, put=True) * 4, per_rank=True,
                      kernels=2)
    return Design("moe-comm", op, "bf16", hidden * BF16_BYTES, per_rank=False, kernels=2)


# ---- the model -----------------------------------------------------------------------------------

def distinct_ranks(world: int, experts: int, topk: int) -> float:
    """Expected number of distinct ranks holding a token's top-k experts (uniform routing, distinct
    experts, E/N experts per rank)."""
    if experts % world:
        raise ValueError(f"experts ({experts}) must be a multiple of world ({world})")
    per = experts // world
    miss = math.comb(experts - per, topk) / math.comb(experts, topk)
    return world * (1.0 - miss)


def busiest_receiver(world: int, mean_msgs: float) -> float:
    """Expected max / mean of the messages received per rank over ``world`` ranks (normal
    approximation of the extreme of ``world`` counts with mean = variance = ``mean_msgs``)."""
    if world <= 1 or mean_msgs <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * math.log(world)) / math.sqrt(mean_msgs)


@dataclass
class Breakdown:
    local_us: float
    latency_us: float
    nvlink_us: float
    rdma_us: float
    messages: float
    msg_overhead_us: float
    total_us: float


def op_latency(design: Design, fabric: Fabric, world: int, tokens: int, local_us: float,
               launch_us: float, msg_overhead_us: float, experts: int = EXPERTS,
               topk: int = TOPK) -> Breakdown:
    """Latency of one op on one rank (see the module docstring). ``local_us``: the measured world-1
    kernel time at this T and dtype; ``launch_us``: one empty launch (added per extra kernel);
    ``msg_overhead_us``: per message (``fit_msg_overhead``)."""
    g = min(world, fabric.gpus_per_node)
    per_token = distinct_ranks(world, experts, topk) if design.per_rank else float(topk)
    msgs = tokens * per_token * (world - 1) / world            # self messages stay local
    intra = tokens * per_token * (g - 1) / world
    inter = msgs - intra
    skew = busiest_receiver(world, tokens * per_token)
    nvl = intra * design.msg_bytes * skew / (fabric.nvlink_eff * 1e3)
    rdma = inter * design.msg_bytes * skew / (fabric.rdma_eff * 1e3)
    lat = (LATENCY_RDMA_US if inter > 0 else LATENCY_NVLINK_US) if msgs > 0 else 0.0
    local = local_us + (design.kernels - 1) * launch_us
    over = msgs * msg_overhead_us
    return Breakdown(local, lat, nvl, rdma, msgs, over, local + lat + max(nvl, rdma) + over)


# ---- measured per-rank costs ---------------------------------------------------------------------

# The committed H100 kernel run whose world-1 dispatch/combine times are the local term.
# Relative to the repository root (a checkout; an installed wheel carries no results).
REPO_ROOT = Path(__file__).resolve().parents[1]
LOCAL_COSTS_FILE = "bench/results/h100-20261122-s9/2-214d5ce/kernels-NVIDIA-H100-80GB-HBM3-20261122-221515.jsonl"


@dataclass
class LocalCosts:
    """World-1 p50 kernel times (µs) by (op, dtype) -> {tokens: us}, and the empty launch."""

    source: str
    device: str
    commit: str
    launch_us: float
    times: dict

    def at(self, op: str, dtype: str, tokens: int) -> float:
        """Time at ``tokens``, linear between the measured sizes (no extrapolation)."""
        pts = sorted(self.times[(op, dtype)].items())
        for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
            if t0 <= tokens <= t1:
                return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
        if tokens == pts[0][0]:
            return pts[0][1]
        raise ValueError(f"{op} {dtype}: T={tokens} outside the measured {pts[0][0]}..{pts[-1][0]}")


def load_local_costs(path: str | Path, hidden: int = HIDDEN, experts: int = EXPERTS) -> LocalCosts:
    """Read world-1 ``moe_comm`` dispatch/combine results and the empty-kernel floor from a kernel
    bench JSON-lines file (``bench/kernels.py``). Combine rows of the fp8 section are bf16 combines."""
    times: dict = {}
    launch, device, commit = None, "", ""
    path = Path(path) if Path(path).is_absolute() or Path(path).exists() else REPO_ROOT / path
    for line in path.read_text().splitlines():
        d = json.loads(line)
        env = d.get("env", {})
        device, commit = env.get("device", device), env.get("commit", commit)
        if d.get("kind") == "floor" and d.get("op") == "empty_kernel":
            launch = d["p50_us"]
        if (d.get("kind") == "result" and d.get("impl") == "moe_comm" and d.get("op") in ("dispatch", "combine")
                and d.get("hidden") == hidden and d.get("experts") == experts):
            dtype = d["dtype"] if d["op"] == "dispatch" else "bf16"
            times.setdefault((d["op"], dtype), {}).setdefault(d["tokens"], d["p50_us"])
    if launch is None or not times:
        raise ValueError(f"{path}: no empty-kernel floor or no world-1 moe_comm dispatch/combine rows")
    return LocalCosts(str(path), device, commit, launch, times)


# ---- published numbers and the two tables -------------------------------------------------------

# DeepEP README, low-latency kernels (H800 + CX7 400 Gb/s, 128 tokens per rank, hidden 7168, top-8,
# fp8 dispatch, bf16 combine; the table with NVLink used inside a node): (EP, dispatch us, combine us).
DEEPEP_LL_PUBLISHED = ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314), (128, 192, 369),
                       (256, 194, 360))
# pplx-kernels README, 128 tokens per GPU, NVLink, EP8 on H100.
PPLX_PUBLISHED = ((8, 83.6, 102.3),)
VALIDATION_TOKENS = 128
TARGET_ERROR = 0.25


def _published():
    """(peer, design maker, fabric, world, op, published us) for every published row."""
    for peer, make, fabric, table in (("DeepEP-LL", deepep_ll, H800_CX7, DEEPEP_LL_PUBLISHED),
                                      ("pplx-kernels", pplx, H100_CX7, PPLX_PUBLISHED)):
        for world, *published in table:
            for op, pub in zip(("dispatch", "combine"), published):
                yield peer, make(op), fabric, world, pub


def _model(design, fabric, world, tokens, costs, msg_overhead_us) -> Breakdown:
    return op_latency(design, fabric, world, tokens, costs.at(design.op, design.dtype, tokens),
                      costs.launch_us, msg_overhead_us)


def fit_msg_overhead(costs: LocalCosts) -> float:
    """Per-message cost (µs) minimizing the squared relative error on the ``FIT_ROWS`` rows: the model
    is a + m * o on each row (a: everything else, m: messages), so o = sum(q (1 - a/p)) / sum(q^2)
    with q = m / p. Clamped at 0."""
    num = den = 0.0
    for peer, d, fabric, world, pub in _published():
        if (peer, world) != FIT_ROWS:
            continue
        b = _model(d, fabric, world, VALIDATION_TOKENS, costs, 0.0)
        q = b.messages / pub
        num += q * (1.0 - b.total_us / pub)
        den += q * q
    return max(0.0, num / den)


def validation_rows(costs: LocalCosts, msg_overhead_us: float | None = None) -> list[dict]:
    """Every published row, modelled: peer, EP, op, published, model, error (model/published - 1),
    whether the row was used to fit the per-message cost."""
    o = fit_msg_overhead(costs) if msg_overhead_us is None else msg_overhead_us
    rows = []
    for peer, d, fabric, world, pub in _published():
        b = _model(d, fabric, world, VALIDATION_TOKENS, costs, o)
        rows.append(dict(peer=peer, fabric=fabric.name, world=world, op=d.op, dtype=d.dtype,
                         tokens=VALIDATION_TOKENS, published_us=pub, model_us=b.total_us,
                         error=b.total_us / pub - 1.0, fitted=(peer, world) == FIT_ROWS,
                         within_target=abs(b.total_us / pub - 1.0) <= TARGET_ERROR, parts=asdict(b)))
    return rows


def prediction_rows(costs: LocalCosts, tokens=DECODE_TOKENS, worlds=WORLDS,
                    msg_overhead_us: float | None = None) -> list[dict]:
    """This project's dispatch (fp8 and bf16) and combine on H100 + CX7, labelled ``prediction``.
    EP > 8 needs an inter-node transport (GPU-initiated RDMA) this project does not have yet: those
    rows model what the same kernels would cost with one."""
    o = fit_msg_overhead(costs) if msg_overhead_us is None else msg_overhead_us
    rows = []
    for world in worlds:
        for t in tokens:
            for op, dtype in (("dispatch", "fp8"), ("dispatch", "bf16"), ("combine", "bf16")):
                d = moe_comm_design(op, dtype)
                b = _model(d, H100_CX7, world, t, costs, o)
                rows.append(dict(kind="prediction", design=d.name, fabric=H100_CX7.name, world=world,
                                 tokens=t, op=op, dtype=dtype, model_us=b.total_us, parts=asdict(b),
                                 needs_rdma_transport=world > H100_CX7.gpus_per_node))
    return rows


def constants() -> dict:
    """The model's named constants, for the JSON output."""
    names = ("NVLINK_H100_GBPS", "NVLINK_H800_GBPS", "NVLINK_EFFICIENCY", "RDMA_CX7_GBPS", "RDMA_EFFICIENCY",
             "LATENCY_NVLINK_US", "LATENCY_RDMA_US", "GPUS_PER_NODE", "HIDDEN", "TOPK",
             "EXPERTS")
    return {n: globals()[n] for n in names}


# ---- text tables -------------------------------------------------------------------------------

def format_validation(rows: list[dict], msg_overhead_us: float) -> str:
    """The validation table, one line per published row, error in %, with the misses explained."""
    out = [f"Validation at T = {VALIDATION_TOKENS} tokens per rank, hidden {HIDDEN}, top-{TOPK} "
           f"(per-message cost fitted on {FIT_ROWS[0]} EP{FIT_ROWS[1]}: {msg_overhead_us * 1e3:.1f} ns; "
           f"target +-{TARGET_ERROR:.0%})",
           f"{'peer':<13}{'EP':>4} {'op':<9}{'dtype':<6}{'published':>10}{'model':>8}{'error':>8}  "
           f"{'local':>6}{'nvlink':>7}{'rdma':>7}{'msgs':>6}  note"]
    for r in rows:
        p = r["parts"]
        note = "fitted" if r["fitted"] else ("" if r["within_target"] else "MISS (see below)")
        out.append(f"{r['peer']:<13}{r['world']:>4} {r['op']:<9}{r['dtype']:<6}{r['published_us']:>8.1f}us"
                   f"{r['model_us']:>7.1f}{r['error']:>+8.1%}  {p['local_us']:>6.1f}{p['nvlink_us']:>7.1f}"
                   f"{p['rdma_us']:>7.1f}{p['msg_overhead_us']:>6.1f}  {note}")
    for m in miss_explanations(rows):
        out.append("  " + m)
    return "\n".join(out)


def miss_explanations(rows: list[dict]) -> list[str]:
    """One line per peer with rows outside the target: the gap in µs per op. A gap that is about the
    same for dispatch and combine (which move different bytes) is a fixed per-op cost the model does
    not have for that design, not a bandwidth error."""
    lines = []
    by_peer: dict = {}
    for r in rows:
        if not r["within_target"]:
            by_peer.setdefault(r["peer"], []).append(r)
    for peer, misses in by_peer.items():
        gaps = ", ".join(f"EP{r['world']} {r['op']} {r['published_us'] - r['model_us']:+.1f} us" for r in misses)
        lines.append(f"{peer}: published minus model = {gaps}. {PEER_MISS_NOTES.get(peer, '')}")
    return lines


# Why a peer's rows can miss, for the text table (the numbers come from the rows themselves).
PEER_MISS_NOTES = {
    "pplx-kernels": ("The gap is about the same for dispatch and combine although combine moves twice "
                     "the bytes, so it is a fixed cost per op that pplx-kernels pays and the model does "
                     "not carry (the model's NVLink bytes and per-message costs are the ones that fit "
                     "DeepEP on the same kind of node). Its send/receive halves and its exchange of "
                     "per-expert counts before the tokens are candidates; not verified."),
}


def format_predictions(rows: list[dict]) -> str:
    """This project's predicted rows: one line per (EP, T), dispatch fp8 / bf16 and combine."""
    out = ["PREDICTION (not measured): moe-comm on H100 + CX7, hidden 7168, top-8, 256 experts. "
           "EP > 8 assumes a GPU-initiated RDMA transport this project does not have yet.",
           f"{'EP':>4}{'T':>6}{'dispatch fp8':>14}{'dispatch bf16':>15}{'combine bf16':>14}"]
    table: dict = {}
    for r in rows:
        table.setdefault((r["world"], r["tokens"]), {})[(r["op"], r["dtype"])] = r["model_us"]
    for (world, t), v in sorted(table.items()):
        out.append(f"{world:>4}{t:>6}{v[('dispatch', 'fp8')]:>12.1f}us{v[('dispatch', 'bf16')]:>13.1f}us"
                   f"{v[('combine', 'bf16')]:>12.1f}us")
    return "\n".join(out)


# ---- decode step: emulated per-rank step + the link from the model --------------------------------------

def link_us(b: Breakdown) -> float:
    """The part of an op the emulated rank does not pay: latency, link time, per-message cost (its
    local kernel work is already in the emulated step)."""
    return b.latency_us + max(b.nvlink_us, b.rdma_us) + b.msg_overhead_us


def decode_step_rows(records: list[dict], costs: LocalCosts, msg_overhead_us: float,
                     fabric: Fabric = H100_CX7) -> list[dict]:
    """Predicted decode step of one EP-N rank: the measured p50 of ``--emulate-ep N`` decode records
    (one rank's whole step, link excluded) plus, per MoE layer, the link part of one dispatch and one
    combine from the model (``link_us``) at the record's batch. Labelled ``prediction``. Only ``fused``
    records are used: it is the only backend with the message format of ``moe_comm_design``."""
    rows = []
    for r in records:
        world, t = r.get("emulate_ep"), r["batch_per_rank"]
        if not world or r.get("backend") != "fused":
            continue
        link = 0.0
        for op, dtype in (("dispatch", "bf16"), ("combine", "bf16")):
            d = moe_comm_design(op, dtype, hidden=r["hidden"], topk=r["topk"])
            link += link_us(op_latency(d, fabric, world, t, 0.0, costs.launch_us, msg_overhead_us,
                                       experts=r["experts"], topk=r["topk"]))
        rows.append(dict(kind="prediction", config=r["config"], world=world, batch=t,
                         emulated_step_us=r["us_p50"], link_per_layer_us=link, layers=r["layers"],
                         step_us=r["us_p50"] + r["layers"] * link, device=r.get("device"),
                         commit=r.get("commit")))
    return rows


# ---- prefill (high-throughput) across nodes ------------------------------------------------------
#
# Throughput of one dispatch or combine of T = 4096 tokens per rank, where bandwidth dominates. Per rank,
# with G GPUs per node, N nodes, E experts, top-K, each token's experts drawn uniformly from the experts of
# g nodes chosen uniformly (DeepSeek-V3's group-limited routing; g = N is no limit):
#
#     t = latency + max(rdma_bytes / rdma_eff, nvlink_bytes / nvlink_eff) + messages * msg_overhead
#
# - rdma_bytes: the rows the rank sends to other nodes, one per (token, other node holding one of its
#   experts) for a per-node design (DeepEP normal, this project's PrefillBuffer across nodes): T x
#   nodes_off x the design's network row.
# - nvlink_bytes: the rows every rank receives inside its node, one per (token, rank holding one of its
#   experts) whoever forwarded it: T x ranks x row. DeepEP's own "NVL" figure of its test counts the same
#   (its received rows).
# - messages: the puts the rank issues; DeepEP moves chunks of tokens per RDMA write (none counted), this
#   project one put per row and part (per_row_puts), each at the fitted per-message cost of the
#   low-latency model above.
# The figure reported is DeepEP's "RDMA bottleneck bandwidth": T x nodes (this node included) x its
# payload row / t, with the payload row hidden x (1 + 4/128) bytes for fp8 and 2 x hidden for bf16, as
# its tests/legacy/test_internode.py computes it (``num_rdma_token_sent * hidden * 2 * fp8_factor``).

PREFILL_TOKENS = 4096
PREFILL_WORLDS = (16, 32, 64)
TOPK_GROUPS = 4          # DeepSeek-V3: a token's experts within at most 4 nodes (DeepEP's test: min(N, 4))
# DeepEP docs/legacy.md, normal kernels, H800 + CX7 400 Gb/s, 4096 tokens, hidden 7168, top-4 groups, top-8,
# fp8 dispatch, bf16 combine: (EP, dispatch GB/s, combine GB/s) of "RDMA bottleneck bandwidth".
DEEPEP_NORMAL_PUBLISHED = ((16, 43, 43), (32, 58, 57), (64, 51, 50))


def node_limited_reach(world: int, experts: int, topk: int, gpus_per_node: int, groups: int) -> tuple:
    """(nodes, nodes_off, ranks): expected distinct nodes holding one of a token's experts (the token's
    own node included), those other than its own, and distinct ranks, when its top-k experts are drawn
    uniformly without replacement from the experts of ``groups`` nodes chosen uniformly among N."""
    g = min(world, gpus_per_node)
    nodes_total = world // g
    groups = min(groups, nodes_total)
    pool = experts * groups // nodes_total                       # experts of the chosen nodes
    per_node, per_rank = experts // nodes_total, experts // world
    node_hit = 1.0 - math.comb(pool - per_node, topk) / math.comb(pool, topk)
    rank_hit = 1.0 - math.comb(pool - per_rank, topk) / math.comb(pool, topk)
    nodes = groups * node_hit
    return nodes, nodes * (1.0 - 1.0 / nodes_total), groups * g * rank_hit


@dataclass(frozen=True)
class PrefillDesign:
    """How a high-throughput implementation moves a token across nodes."""

    name: str
    op: str               # "dispatch" | "combine"
    dtype: str            # "fp8" | "bf16"
    row_bytes: int        # bytes of one row over the network (payload, and what travels with it)
    nvlink_row_bytes: int  # bytes of one row received inside the node
    puts_per_row: int     # network messages per row (0: chunked, not counted)


def deepep_normal(op: str, hidden: int = HIDDEN) -> PrefillDesign:
    """DeepEP's normal internode kernels: fp8 dispatch (payload and scales, plus K ids, K weights and its
    source metadata), bf16 combine; chunked RDMA writes."""
    meta = (2 * TOPK + 1 + TOPK) * 4
    if op == "dispatch":
        return PrefillDesign("DeepEP-normal", op, "fp8", fp8_row_bytes(hidden) + meta, fp8_row_bytes(hidden) + meta, 0)
    return PrefillDesign("DeepEP-normal", op, "bf16", hidden * BF16_BYTES, hidden * BF16_BYTES, 0)


def moe_comm_prefill(op: str, dtype: str, hidden: int = HIDDEN, topk: int = TOPK) -> PrefillDesign:
    """This project's PrefillBuffer across nodes (docs/prefill.md "Across nodes"): per (token, other node)
    one put of the payload row (fp8: and one of its scales) and one of its routing row (K ids, K weights,
    an 8-byte stamp); the combine one put of a bf16 row per (token, node). The bytes per row are those the
    emulated nodes' wire measured equal to the floor (bench/wire_bytes.py --prefill)."""
    route = (2 * topk + 2) * 4
    if op == "dispatch":
        payload = fp8_row_bytes(hidden) if dtype == "fp8" else hidden * BF16_BYTES
        return PrefillDesign("moe-comm", op, dtype, payload + route, payload, 3 if dtype == "fp8" else 2)
    return PrefillDesign("moe-comm", op, "bf16", hidden * BF16_BYTES, hidden * BF16_BYTES, 1)


@dataclass
class PrefillBreakdown:
    rdma_us: float
    nvlink_us: float
    messages: float
    msg_overhead_us: float
    total_us: float
    bottleneck_gbps: float   # DeepEP's RDMA bottleneck bandwidth (see above)


def prefill_throughput(design: PrefillDesign, fabric: Fabric, world: int, tokens: int, msg_overhead_us: float,
                       groups: int = TOPK_GROUPS, experts: int = EXPERTS, topk: int = TOPK,
                       hidden: int = HIDDEN) -> PrefillBreakdown:
    """One op of one rank (the model above)."""
    nodes, nodes_off, ranks = node_limited_reach(world, experts, topk, fabric.gpus_per_node, groups)
    rdma = tokens * nodes_off * design.row_bytes / (fabric.rdma_eff * 1e3)
    nvl = tokens * ranks * design.nvlink_row_bytes / (fabric.nvlink_eff * 1e3)
    msgs = tokens * nodes_off * design.puts_per_row
    over = msgs * msg_overhead_us
    total = LATENCY_RDMA_US + max(rdma, nvl) + over
    logical = tokens * nodes * (hidden * (1 + 4 / FP8_GROUP) if design.dtype == "fp8" else hidden * BF16_BYTES)
    return PrefillBreakdown(rdma, nvl, msgs, over, total, logical / (total * 1e3))


def prefill_validation_rows(msg_overhead_us: float) -> list[dict]:
    """DeepEP's published normal internode rows, modelled (error = model / published - 1). Nothing here is
    fitted to them: the efficiencies are the intranode NVLink figure and 86 % of the NIC (the constants
    above), the per-message cost is not charged (DeepEP writes chunks)."""
    rows = []
    for world, *published in DEEPEP_NORMAL_PUBLISHED:
        for op, pub in zip(("dispatch", "combine"), published):
            b = prefill_throughput(deepep_normal(op), H800_CX7, world, PREFILL_TOKENS, msg_overhead_us)
            err = b.bottleneck_gbps / pub - 1.0
            rows.append(dict(peer="DeepEP-normal", fabric=H800_CX7.name, world=world, op=op, tokens=PREFILL_TOKENS,
                             published_gbps=pub, model_gbps=b.bottleneck_gbps, error=err,
                             within_target=abs(err) <= TARGET_ERROR, parts=asdict(b)))
    return rows


def prefill_prediction_rows(msg_overhead_us: float, worlds=PREFILL_WORLDS, groups: int = TOPK_GROUPS) -> list[dict]:
    """This project's PrefillBuffer across nodes on H100 + CX7 (400 Gb/s), DeepEP's metric, labelled
    ``prediction``; DeepEP normal on the same fabric beside it."""
    rows = []
    for world in worlds:
        for op, dtype in (("dispatch", "fp8"), ("dispatch", "bf16"), ("combine", "bf16")):
            for d in (moe_comm_prefill(op, dtype), deepep_normal(op) if dtype == deepep_normal(op).dtype else None):
                if d is None:
                    continue
                b = prefill_throughput(d, H100_CX7, world, PREFILL_TOKENS, msg_overhead_us, groups)
                rows.append(dict(kind="prediction", design=d.name, fabric=H100_CX7.name, world=world,
                                 tokens=PREFILL_TOKENS, op=op, dtype=dtype, groups=groups,
                                 gbps=b.bottleneck_gbps, model_us=b.total_us, parts=asdict(b)))
    return rows


def format_prefill(validation: list[dict], predictions: list[dict], msg_overhead_us: float) -> str:
    """The prefill validation and prediction tables."""
    out = [f"Prefill validation (DeepEP normal internode, H800 + CX7, T = {PREFILL_TOKENS}, top-{TOPK} within "
           f"{TOPK_GROUPS} nodes; GB/s as DeepEP reports it; target +-{TARGET_ERROR:.0%})",
           f"{'EP':>4} {'op':<9}{'published':>10}{'model':>8}{'error':>8}  {'rdma us':>8}{'nvlink us':>10}"]
    for r in validation:
        p = r["parts"]
        out.append(f"{r['world']:>4} {r['op']:<9}{r['published_gbps']:>8.0f}GB{r['model_gbps']:>7.1f}{r['error']:>+8.1%}"
                   f"  {p['rdma_us']:>8.0f}{p['nvlink_us']:>10.0f}" + ("" if r["within_target"] else "  MISS"))
    out.append(f"PREDICTION (not measured): H100 + CX7, T = {PREFILL_TOKENS}, GB/s per rank as DeepEP reports it "
               f"(per-put cost {msg_overhead_us * 1e3:.1f} ns from the low-latency fit)")
    out.append(f"{'EP':>4} {'op':<9}{'dtype':<6}{'moe-comm':>10}{'DeepEP':>9}  {'rdma us':>8}{'nvlink us':>10}"
               f"{'puts':>8}{'put us':>8}")
    deep = {(r["world"], r["op"]): r["gbps"] for r in predictions if r["design"] == "DeepEP-normal"}
    for r in predictions:
        if r["design"] != "moe-comm":
            continue
        p = r["parts"]
        d = deep.get((r["world"], r["op"])) if r["dtype"] == ("fp8" if r["op"] == "dispatch" else "bf16") else None
        out.append(f"{r['world']:>4} {r['op']:<9}{r['dtype']:<6}{r['gbps']:>8.1f}GB" +
                   (f"{d:>7.1f}GB" if d is not None else f"{'':>9}") +
                   f"  {p['rdma_us']:>8.0f}{p['nvlink_us']:>10.0f}{p['messages']:>8.0f}{p['msg_overhead_us']:>8.0f}")
    return "\n".join(out)
