"""The paper's learning-rate schedule (Vaswani et al. 2017, eq. 3): linear warmup, then
inverse square root decay, optionally ending in a linear cooldown to zero. The cooldown is placed
either in updates (train.cooldown_steps before train.max_steps) or in training time (the last
train.cooldown_fraction of a train.max_time budget). A pure function of the step and the training
seconds spent, both of which last.pt keeps, so a resumed run continues the same schedule."""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([hms])")


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


def time_cooldown_factor(seconds: float, budget: float, fraction: float) -> float:
    """cooldown_factor in training time: 1 until `fraction` of the `budget` seconds is left, then a
    linear fall to 0 at the budget. `seconds` is the training time spent before the update."""
    if budget <= 0 or fraction <= 0:
        return 1.0
    return min(1.0, max(0.0, (budget - seconds) / (fraction * budget)))


def time_cooldown_start(budget: float, fraction: float) -> float:
    """The training seconds at which time_cooldown_factor starts to fall below 1."""
    return budget * (1 - fraction)


def lr_at(step: int, d_model: int, warmup_steps: int, scale: float = 1.0,
          max_steps: int = 0, cooldown_steps: int = 0,
          seconds: float = 0.0, max_time: float = 0.0, cooldown_fraction: float = 0.0) -> float:
    """The learning rate of update `step`, `seconds` of training into the run: inverse_sqrt_lr
    times the step cooldown and the time cooldown (each 1 when not set)."""
    return (inverse_sqrt_lr(step, d_model, warmup_steps, scale) * cooldown_factor(step, max_steps, cooldown_steps)
            * time_cooldown_factor(seconds, max_time, cooldown_fraction))


def parse_duration(text: str) -> float:
    """'2h', '45m', '1h30m', '1.5h', '90s' -> seconds; '' -> 0 (no budget). ValueError otherwise."""
    cleaned = str(text).strip().lower()
    if not cleaned:
        return 0.0
    parts = _DURATION.findall(cleaned)
    if not parts or _DURATION.sub("", cleaned).strip():
        raise ValueError(f"{text!r} is not a duration like 2h, 45m, 1h30m or 90s")
    seconds = sum(float(number) * {"h": 3600, "m": 60, "s": 1}[unit] for number, unit in parts)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration")
    return seconds


def format_duration(seconds: float) -> str:
    """Seconds as 1h05m07s, 4m30s or 12s (whole seconds)."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def cooldown_patience_note(max_steps: int, cooldown_steps: int, patience: int,
                           max_time: float = 0.0, cooldown_fraction: float = 0.0) -> str | None:
    """A log line when early stopping may end the run before its cooldown (by step, or over the
    last cooldown_fraction of a max_time budget in seconds) has started (or finished), which would
    leave the still-large inverse-sqrt lr that the cooldown is there to remove; None when there is
    no cooldown or no early stopping."""
    if patience <= 0:
        return None
    if max_time > 0 and cooldown_fraction > 0:
        where = f"from {format_duration(time_cooldown_start(max_time, cooldown_fraction))} of training on"
    elif cooldown_steps > 0:
        where = f"updates {max_steps - cooldown_steps + 1}-{max_steps}"
    else:
        return None
    return (f"note: early stopping (train.patience={patience}) can end the run before its lr cooldown "
            f"({where}); --set train.patience=0 always runs it")
