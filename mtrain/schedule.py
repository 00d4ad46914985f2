"""The paper's learning-rate schedule (Vaswani et al. 2017, eq. 3): linear warmup, then
inverse square root decay, optionally ending in a linear cooldown to zero. A pure function of
the step, so resuming needs only the step."""

from __future__ import annotations


def inverse_sqrt_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), for step >= 1.

    The two branches meet at step == warmup_steps, where lr peaks at
    scale * (d_model * warmup_steps)^-0.5."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (optimizer updates are counted from 1), got {step}")
    warmup = max(1, warmup_steps)  # warmup 0 means no ramp: the decay branch from step 1
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cooldown_factor(step: int, max_steps: int, cooldown_steps: int) -> float:
    """1 until the last cooldown_steps updates before max_steps, then a linear fall towards 0.

    A run of known length ends at a small learning rate instead of the inverse square root's
    still-large one, which lowers the loss at the end (the warmup-stable-decay "cooldown",
    Hagele et al. 2024). The first cooldown update gets 1, update max_steps gets 1/cooldown_steps,
    so every update still moves the weights."""
    if cooldown_steps <= 0:
        return 1.0
    return min(1.0, max(0.0, (max_steps + 1 - step) / cooldown_steps))


def lr_at(step: int, d_model: int, warmup_steps: int, scale: float = 1.0,
          max_steps: int = 0, cooldown_steps: int = 0) -> float:
    """The learning rate of update `step`: inverse_sqrt_lr times cooldown_factor."""
    return inverse_sqrt_lr(step, d_model, warmup_steps, scale) * cooldown_factor(step, max_steps, cooldown_steps)


def cooldown_patience_note(max_steps: int, cooldown_steps: int, patience: int) -> str | None:
    """A log line when early stopping may end the run before its cooldown has started (or
    finished), which would leave the still-large inverse-sqrt lr that the cooldown is there to
    remove; None when there is no cooldown or no early stopping."""
    if cooldown_steps <= 0 or patience <= 0:
        return None
    return (f"note: early stopping (train.patience={patience}) can end the run before its lr cooldown "
            f"(updates {max_steps - cooldown_steps + 1}-{max_steps}); --set train.patience=0 always runs it")
