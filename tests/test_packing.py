"""mtrain.cpu.packing: a padded batch's real positions as rows, and the training step on them, which
must equal the step on the padded batch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtrain.cpu.model as cpu_model
from mtrain.config import ModelConfig
from mtrain.loss import Objective
from mtrain.model import Transformer
from mtrain.cpu.packing import Packing

PAD = 0


def padded(lengths: list[int], width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 50, (len(lengths), width), generator=gen)
    for row, n in enumerate(lengths):
        x[row, n:] = PAD
    return x


def test_rows_are_the_real_cells_in_order_then_pads_up_to_the_multiple():
    ids = padded([3, 1, 4, 0], 5, seed=1)  # 8 real cells of 20
    packing = Packing.of(ids, PAD, multiple=6)
    flat = ids.reshape(-1)
    real = [i for i in range(20) if flat[i] != PAD]
    assert packing.real == 8
    assert packing.index[:8].tolist() == real
    assert packing.index.numel() == 12  # 8 rounded up to a multiple of 6
    assert (flat[packing.index[8:]] == PAD).all()
    assert sorted(packing.index.tolist() + packing.gaps.tolist()) == list(range(20))
    assert packing.positions().tolist() == [i % 5 for i in packing.index.tolist()]
    assert packing.take(ids).tolist() == flat[packing.index].tolist()


def test_rounding_stops_at_the_whole_grid():
    ids = padded([2, 2], 3, seed=2)  # 4 real of 6 cells; a multiple of 64 would need 60 more
    packing = Packing.of(ids, PAD)
    assert packing.index.numel() == 6 and packing.gaps.numel() == 0 and packing.real == 4
    assert Packing.of(ids, PAD, multiple=1).index.numel() == 4


def test_grid_and_rows_invert_each_other_and_zero_the_gaps():
    ids = padded([3, 5, 1], 5, seed=3)
    packing = Packing.of(ids, PAD, multiple=4)
    rows = torch.randn(packing.index.numel(), 7)
    grid = packing.to_grid(rows)
    assert grid.shape == (3, 5, 7)
    assert torch.equal(grid.reshape(15, 7)[packing.gaps], torch.zeros(packing.gaps.numel(), 7))
    assert torch.equal(packing.to_rows(grid), rows)
    assert torch.equal(grid.reshape(15, 7)[packing.index], rows)


def test_grid_and_rows_pass_gradients():
    packing = Packing.of(padded([2, 4, 3], 4, seed=4), PAD, multiple=4)
    rows = torch.randn(packing.index.numel(), 3, dtype=torch.float64, requires_grad=True)
    grid = torch.randn(3, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(packing.to_grid, (rows,))
    assert torch.autograd.gradcheck(packing.to_rows, (grid,))


def tiny_objective(**changes) -> tuple[Objective, Transformer]:
    torch.manual_seed(0)
    cfg = ModelConfig(**{**dict(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                                dropout=0.0, vocab_size=50, max_len=64), **changes})
    model = cpu_model.accelerate(Transformer(cfg)).double().train()
    return Objective(model, 0.1), model


def loss_and_gradients(objective: Objective, model: Transformer, batch) -> tuple[torch.Tensor, torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss, nll = objective(*batch)
    loss.backward()
    return loss.detach(), nll, [p.grad.clone() for p in model.parameters()]


def target_batch(lengths: list[int], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tgt_in = BOS + ids, tgt_out = ids + EOS, padded alike, as mtrain.data.collate makes them."""
    tgt_out = padded(lengths, width, seed)
    tgt_in = tgt_out.clone()
    tgt_in[:, 1:] = tgt_out[:, :-1]
    tgt_in[:, 0] = 2
    tgt_in[tgt_out == PAD] = PAD
    return tgt_in, tgt_out


@pytest.mark.parametrize("multiple", [1, 64])
def test_packed_step_equals_the_padded_step(monkeypatch, multiple):
    """Loss, NLL and every parameter's gradient, float64, on a batch with padding on both sides
    (a sentence alone at full length, one with a single token): packing drops only cells that
    no real position reads."""
    of = Packing.of.__func__
    monkeypatch.setattr(Packing, "of", classmethod(lambda cls, ids, pad_id: of(cls, ids, pad_id, multiple)))
    objective, model = tiny_objective()
    src = padded([7, 3, 1, 5], 7, seed=5)
    tgt_in, tgt_out = target_batch([4, 6, 1, 2], 6, seed=6)
    batch = (src, tgt_in, tgt_out)
    packed = loss_and_gradients(objective, model, batch)
    monkeypatch.setattr(cpu_model, "packs", lambda ids: False)
    padded_step = loss_and_gradients(objective, model, batch)
    torch.testing.assert_close(packed[0], padded_step[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(packed[1], padded_step[1], rtol=1e-12, atol=0)
    for a, b in zip(packed[2], padded_step[2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.fast_paths
@pytest.mark.parametrize("precision", ["float64", "bfloat16 autocast"])
def test_packed_attention_goes_from_rows_to_heads_without_a_grid(monkeypatch, precision):
    """In a packed step every attention gathers its Q, K and V from the rows straight into the
    heads' layout (one Packing.to_heads per projection: Q/K/V of each self-attention, Q and K/V of
    each cross-attention) and never builds a grid, under bfloat16 autocast too; the step's values
    and gradients are the padded step's (test_packed_step_equals_the_padded_step and the bfloat16
    test below run this path)."""
    calls = {"to_heads": 0, "to_grid": 0}
    for name in calls:
        real = getattr(Packing, name)
        monkeypatch.setattr(Packing, name, lambda self, *a, _real=real, _name=name: calls.__setitem__(
            _name, calls[_name] + 1) or _real(self, *a))
    objective, model = tiny_objective()  # 2 encoder and 2 decoder layers
    bf16 = precision.startswith("bfloat16")
    if bf16:
        model.float()
    src = padded([7, 3, 1, 5], 7, seed=11)
    tgt_in, tgt_out = target_batch([4, 6, 1, 2], 6, seed=12)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = objective(src, tgt_in, tgt_out)
        loss.backward()
    assert calls == {"to_heads": 2 + 2 * 3, "to_grid": 0}


@pytest.mark.fast_paths
def test_a_cpu_training_step_runs_its_layers_on_the_real_rows():
    objective, model = tiny_objective(dropout=0.1)
    src = padded([7, 3, 1, 5], 7, seed=7)  # 16 real of 28 cells
    tgt_in, tgt_out = target_batch([4, 6, 1, 2], 6, seed=8)  # 13 real of 24
    seen = []
    for layer in (model.encoder[0], model.decoder[0]):
        layer.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    loss, nll = objective(src, tgt_in, tgt_out)
    assert seen == [(28, 32), (24, 32)]  # 16 and 13 rounded up to 64 stop at the whole grids
    assert torch.isfinite(loss) and torch.isfinite(nll)
    seen.clear()
    src = torch.cat([src] * 8)  # 128 real of 224 cells: no rounding needed
    tgt_in, tgt_out = torch.cat([tgt_in] * 8), torch.cat([tgt_out] * 8)
    objective(src, tgt_in, tgt_out)
    assert seen == [(128, 32), (128, 32)]  # 104 real target rows rounded up to 128


@pytest.mark.fast_paths
def test_a_bfloat16_autocast_step_runs_packed_and_equals_the_padded_step_to_bfloat16_rounding(monkeypatch):
    """Under CPU bfloat16 autocast the layers see the real rows too, and attention takes them
    straight to its heads. Each real position's arithmetic is the padded step's, in the same
    bfloat16, but a matmul over fewer rows may sum in another order: the loss and gradients agree
    to a few of bfloat16's 2^-8 steps."""
    objective, model = tiny_objective()
    model.float()
    src = padded([7, 3, 1, 5], 7, seed=9)  # 16 real of 28 cells
    tgt_in, tgt_out = target_batch([4, 6, 1, 2], 6, seed=10)
    seen = []
    model.encoder[0].register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed = loss_and_gradients(objective, model, (src, tgt_in, tgt_out))
        monkeypatch.setattr(cpu_model, "packs", lambda ids: False)
        padded_step = loss_and_gradients(objective, model, (src, tgt_in, tgt_out))
    assert seen == [(28, 32), (4, 7, 32)]  # 16 rows rounded up to 64 stop at the whole grid
    torch.testing.assert_close(packed[0], padded_step[0], rtol=1e-3, atol=0)
    for a, b in zip(packed[2], padded_step[2]):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert (a - b).abs().max() <= 1e-2 * b.abs().max()  # on an AMX Xeon, small shape: 3e-3


def fit(bf16: bool, steps: int = 40) -> list[float]:
    """The losses of Adam steps on one batch of the tiny model, under bfloat16 autocast or not."""
    objective, model = tiny_objective()
    model.float()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    src = padded([7, 3, 1, 5], 7, seed=13)
    tgt_in, tgt_out = target_batch([4, 6, 1, 2], 6, seed=14)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = objective(src, tgt_in, tgt_out)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.fast_paths
def test_a_bfloat16_autocast_packed_step_learns_as_the_float32_step_does(monkeypatch):
    """Under CPU bfloat16 autocast, with attention from the rows to the heads, Adam steps on one
    batch fit it as float32 steps do: the loss falls to a fifth of where it started (label
    smoothing keeps a floor), and ends within 5 % of the float32 run's."""
    calls = {"to_heads": 0}
    real = Packing.to_heads
    monkeypatch.setattr(Packing, "to_heads", lambda self, *a: calls.__setitem__("to_heads", calls["to_heads"] + 1)
                        or real(self, *a))
    bf16 = fit(True)
    assert calls["to_heads"] == 40 * (2 + 2 * 3)
    float32 = fit(False)
    assert all(math.isfinite(x) for x in bf16) and bf16[-1] < 0.2 * bf16[0]
    assert abs(bf16[-1] - float32[-1]) < 0.05 * float32[-1]


def test_the_packing_benchmark_times_both_steps_from_one_parity_check():
    """benchmarks/packing_ab.py end to end at its smallest: the packed and padded steps from the
    same weights give the same loss and gradients (float32: summation order only), and both are
    timed."""
    result = run_benchmark("packing_ab.py")
    loss = result["parity"]["loss"]
    assert loss["packed"] == pytest.approx(loss["padded"], rel=1e-6)
    assert result["parity"]["max_relative_gradient_difference"] < 1e-5
    assert result["tok_s"]["packed"] > 0 and result["tok_s"]["padded"] > 0 and result["packed_speedup_median"] > 0


def run_benchmark(script: str, *extra: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / script), "--batches", "1", "--rounds", "1",
                           "--max-tokens", "256", "--threads", "1", "--json", *extra],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_packing_benchmark_compares_attention_from_the_rows_with_the_grid():
    """packing_ab.py --attention: both steps packed, attention from the rows to the heads against
    through the grid (PyTorch's kernel there). One step of each from the same weights gives the
    same loss to float32 rounding and gradients within a few float32 roundings."""
    result = run_benchmark("packing_ab.py", "--attention")
    assert set(result["tok_s"]) == {"grid", "heads"} and min(result["tok_s"].values()) > 0
    grid, heads = result["parity"]["loss"]["grid"], result["parity"]["loss"]["heads"]
    assert abs(grid - heads) <= 1e-6 * abs(heads)
    assert result["parity"]["max_relative_gradient_difference"] < 1e-5
    assert result["heads_speedup_median"] > 0


@pytest.mark.fast_paths
def test_the_attention_layout_benchmark_profiles_both_paths():
    """attention_layout.py end to end at its smallest: both paths timed, and each one's profile
    names its matmuls and its layout ops."""
    result = run_benchmark("attention_layout.py")
    assert set(result["ms_per_call_median"]) == {"grid", "heads"}
    for path in ("grid", "heads"):
        parts = result["profiled_ms_per_call_by_kind"][path]
        assert parts["matmuls"] > 0 and parts["layout"] > 0
