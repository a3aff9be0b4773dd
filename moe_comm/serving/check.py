"""Compare served generations with the single-process reference model."""

from __future__ import annotations

import torch

from .engine import Generation, Request
from .reference_model import ReferenceModel


class ReferenceMismatch(AssertionError):
    """A backend's logits or tokens differ from the reference model's beyond the stated tolerance."""


def check_generation(ref: ReferenceModel, req: Request, gen: Generation, rtol: float, label: str = "") -> float:
    """Check one request's recorded logits against the reference; returns the worst relative error.

    Relative error of a step = max |logits - ref| / max |ref|. Every step must be within ``rtol``. Greedy
    tokens must match; a different token is accepted only where the reference's top two logits are within
    ``rtol`` of each other (a tie that rounding may break either way), and the comparison stops there.
    """
    ref_tokens, ref_logits = ref.generate(req.prompt, req.max_new_tokens)
    worst = 0.0
    for step, (tok, ref_tok) in enumerate(zip(gen.tokens, ref_tokens)):
        got, want = gen.logits[step].to(ref_logits.device), ref_logits[step]
        scale = want.abs().max().clamp_min(1e-30)
        err = ((got - want).abs().max() / scale).item()
        worst = max(worst, err)
        if not err <= rtol:  # also catches NaN
            raise ReferenceMismatch(f"{label} step {step}: logits differ from the reference by {err:.3g} "
                                    f"(relative to max |logit|), tolerance {rtol:g}")
        if tok != ref_tok:
            top2 = want.topk(2).values
            if ((top2[0] - top2[1]) / scale).item() > rtol:
                raise ReferenceMismatch(f"{label} step {step}: token {tok} != reference {ref_tok} "
                                        f"(not a near-tie)")
            break
    if len(gen.tokens) != len(ref_tokens):
        raise ReferenceMismatch(f"{label}: {len(gen.tokens)} tokens, reference has {len(ref_tokens)}")
    return worst


def default_rtol(dtype: torch.dtype) -> float:
    """Stated tolerances: float32 differs from the reference only by summation order; bfloat16 by rounding
    of every intermediate (different matmul shapes round differently)."""
    return 1e-4 if dtype == torch.float32 else 5e-2
