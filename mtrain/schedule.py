"""The paper's learning-rate schedule (Vaswani et al. 2017, eq. 3): linear warmup, then
inverse square root decay. A pure function of the step, so resuming needs only the step."""

from __future__ import annotations


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), for step >= 1.

    The two branches meet at step == warmup_steps, where lr peaks at
    scale * (d_model * warmup_steps)^-0.5."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (optimizer updates are counted from 1), got {step}")
    warmup = max(1, warmup_steps)  # warmup 0 means no ramp: the decay branch from step 1
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
