"""Scale model of EP dispatch / combine for EP8 ... EP256 (moe_comm/scale_model.py): validation against
DeepEP low-latency and pplx-kernels' published numbers, then this project's predicted rows.

    python bench/scale_model.py [--costs KERNELS.jsonl] [--out bench/results/scale-model]

Writes scale_model.json (constants, fitted per-message cost, validation and prediction rows) and
scale_model.png (if matplotlib is installed) under --out, and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from moe_comm import scale_model as sm  # noqa: E402


def plot(validation: list[dict], predictions: list[dict], path: str) -> bool:
    """Left: published vs model per peer row; right: predicted latency vs EP at each T. False if
    matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed (pip install 'moe-comm[bench]'): no PNG")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 5.5))
    for peer, marker in (("DeepEP-LL", "o"), ("pplx-kernels", "s")):
        for op, color in (("dispatch", "tab:blue"), ("combine", "tab:orange")):
            rows = [r for r in validation if r["peer"] == peer and r["op"] == op]
            ax0.plot([r["world"] for r in rows], [r["published_us"] for r in rows], marker, color=color,
                     label=f"{peer} {op}, published")
            ax0.plot([r["world"] for r in rows], [r["model_us"] for r in rows], marker, color=color,
                     mfc="none", markersize=11, label=f"{peer} {op}, model")
    ax0.set_xscale("log", base=2)
    ax0.set_xticks(sm.WORLDS, [f"EP{w}" for w in sm.WORLDS])
    ax0.set_ylabel("µs per op (T = 128 tokens per rank)")
    ax0.set_title("Validation: published (filled) vs model (open)")
    ax0.legend(fontsize=7)
    for t in (1, 32, 128, 256):
        for op, dtype, style in (("dispatch", "fp8", "-"), ("combine", "bf16", "--")):
            rows = [r for r in predictions if r["tokens"] == t and r["op"] == op and r["dtype"] == dtype]
            ax1.plot([r["world"] for r in rows], [r["model_us"] for r in rows], style, marker=".",
                     label=f"T={t} {op} {dtype}")
    ax1.axvline(8.5, color="grey", lw=0.8)
    ax1.text(0.98, 0.03, "right of the line: inter-node, needs an RDMA transport", fontsize=7,
             ha="right", transform=ax1.transAxes)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(sm.WORLDS, [f"EP{w}" for w in sm.WORLDS])
    ax1.set_ylabel("µs per op")
    ax1.set_title("PREDICTION: moe-comm on H100 + CX7 (not measured)")
    ax1.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs", default=sm.LOCAL_COSTS_FILE,
                    help="kernel bench JSON lines with world-1 dispatch/combine times (the local term)")
    ap.add_argument("--out", default="bench/results/scale-model")
    ap.add_argument("--emulated-decode", metavar="JSONL",
                    help="decode_latency JSON lines of an --emulate-ep run (GPU): adds the predicted decode step "
                         "(emulated step + the modelled link of each layer's dispatch and combine)")
    a = ap.parse_args(argv)
    costs = sm.load_local_costs(a.costs)
    o = sm.fit_msg_overhead(costs)
    validation = sm.validation_rows(costs, o)
    predictions = sm.prediction_rows(costs, msg_overhead_us=o)
    print(f"Local per-rank costs: {costs.source} ({costs.device}, commit {costs.commit}; "
          f"empty launch {costs.launch_us:.2f} us)\n")
    print(sm.format_validation(validation, o))
    print()
    print(sm.format_predictions(predictions))
    step_rows = []
    if a.emulated_decode:
        with open(a.emulated_decode) as f:
            step_rows = sm.decode_step_rows([json.loads(x) for x in f if x.strip()], costs, o)
        print("\nPREDICTION (decode step of one rank = emulated step + modelled link):")
        for r in step_rows:
            print(f"  {r['config']} EP{r['world']} batch {r['batch']}: {r['emulated_step_us']:.0f} us emulated "
                  f"+ {r['layers']} x {r['link_per_layer_us']:.1f} us link = {r['step_us']:.0f} us "
                  f"({r['device']}, commit {str(r['commit'])[:7]})")
    else:
        print("\nNo decode step prediction: pass --emulated-decode with the JSON lines of a GPU --emulate-ep run.")
    prefill_validation, prefill_predictions = sm.prefill_validation_rows(o), sm.prefill_prediction_rows(o)
    print()
    print(sm.format_prefill(prefill_validation, prefill_predictions, o))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "scale_model.json"), "w") as f:
        json.dump(dict(constants=sm.constants(), msg_overhead_us=o,
                       local_costs=dict(source=costs.source, device=costs.device, commit=costs.commit,
                                        launch_us=costs.launch_us),
                       validation=validation, predictions=predictions, decode_step=step_rows,
                       prefill_validation=prefill_validation, prefill_predictions=prefill_predictions), f, indent=1)
    plot(validation, predictions, os.path.join(a.out, "scale_model.png"))
    print(f"\nwrote {a.out}/scale_model.json" + (" and scale_model.png" if os.path.exists(
        os.path.join(a.out, "scale_model.png")) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
