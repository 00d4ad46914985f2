"""mtrain.cpu as one switch: the paper's model with every CPU stand-in off (MTRAIN_CPU_FAST=0)
trains and decodes as the accelerated one does, to float rounding; the accelerated model is the
same parameters under other classes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mtrain import cpu
from mtrain.config import ModelConfig
from mtrain.cache import PLAIN as PLAIN_CACHES
from mtrain.cpu import reductions as cpu_reductions
from mtrain.cpu.cache import for_decoding
from mtrain.cpu.model import FastTransformer, accelerate
from mtrain.loss import Objective
from mtrain.model import Transformer
from mtrain.reductions import PLAIN
from mtrain.search import beam_search, greedy_search

PAD = 0
CFG = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, vocab_size=60,
                  max_len=64, dropout=0.0)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 60, (6, 9), generator=gen)
    tgt = torch.randint(4, 60, (6, 8), generator=gen)
    for row, (s, t) in enumerate([(9, 8), (5, 3), (7, 8), (2, 1), (9, 6), (4, 4)]):
        src[row, s:] = PAD
        tgt[row, t:] = PAD
    tgt_in = torch.cat([torch.full((6, 1), 1), tgt[:, :-1]], 1).masked_fill(tgt == PAD, PAD)
    tgt_in[:, 0] = 1
    return src, tgt_in, tgt


def step(model: torch.nn.Module, bf16: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = Objective(model, 0.1)(*batch())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.fast_paths
def test_accelerate_changes_classes_not_parameters():
    torch.manual_seed(0)
    model = Transformer(CFG)
    state = {k: v for k, v in model.state_dict().items()}
    fast = accelerate(model)
    assert fast is model and type(model) is FastTransformer
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and state.keys() == model.state_dict().keys()
    assert type(accelerate(Transformer(CFG), "meta")) is Transformer  # other devices keep the paper's model


def test_the_switch_leaves_the_papers_model(monkeypatch):
    monkeypatch.setenv(cpu.FAST_ENV, "0")
    assert type(accelerate(Transformer(CFG))) is Transformer
    assert not cpu.fast()


@pytest.mark.parametrize("variant", [{}, {"activation": "swish", "output_bias": True}], ids=["paper", "marian"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_plain_and_accelerated_training_steps_agree(dtype, variant):
    """Dropout off (the masks are the same only in distribution): the same loss and gradients, to
    the rounding of the dtype (packing, oneDNN's fused linear layers and batched attention on one
    side, PyTorch's ops on the padded batch on the other); also for an imported Marian model's
    swish FFN and output bias."""
    torch.manual_seed(0)
    plain = Transformer(dataclasses.replace(CFG, **variant)).to(dtype).train()
    if plain.proj.bias is not None:
        torch.nn.init.normal_(plain.proj.bias)
    fast = accelerate(copy.deepcopy(plain)).train()
    loss_plain, grads_plain = step(plain)
    loss_fast, grads_fast = step(fast)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(loss_fast, loss_plain, rtol=tolerance, atol=tolerance)
    for a, b in zip(grads_fast, grads_plain):
        torch.testing.assert_close(a, b, rtol=tolerance * 10, atol=tolerance * 10)


def test_with_the_switch_off_decoding_gives_the_same_searches(monkeypatch):
    """Greedy and beam search of one model, as a CPU decoding copy (the CPU's caches and
    reductions) with the stand-ins on and as the paper's model with them off: the same tokens,
    scores to float32 rounding."""
    torch.manual_seed(3)
    model = Transformer(CFG).eval()
    src = batch(1)[0]
    max_len = torch.full((src.size(0),), 12)

    def searches(model):
        with torch.inference_mode():
            return greedy_search(model, src, max_len), beam_search(model, src, beam=3, lenpen=0.6, max_len=max_len, nbest=2)

    greedy_on, beams_on = searches(for_decoding(copy.deepcopy(model)))
    monkeypatch.setenv(cpu.FAST_ENV, "0")
    plain = for_decoding(model)
    assert plain.reductions is PLAIN and plain.cache_layers is PLAIN_CACHES  # the switch leaves the paper's
    greedy_off, beams_off = searches(plain)
    assert greedy_off == greedy_on
    assert [[ids for ids, _ in hyps] for hyps in beams_off] == [[ids for ids, _ in hyps] for hyps in beams_on]
    scores_on = torch.tensor([s for hyps in beams_on for _, s in hyps])
    scores_off = torch.tensor([s for hyps in beams_off for _, s in hyps])
    torch.testing.assert_close(scores_off, scores_on, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [60, 8003])
def test_cpu_reductions_give_pytorchs(dtype, vocab):
    """The CPU's row reductions (chunked top-k and argmax, the C kernel's one pass over bfloat16
    rows where it loads) against PLAIN's torch ops, on logits with ties and -inf: the same ids
    (argmax's first of equal maxima), top values exactly, log-sum-exp to float32 rounding."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(37, vocab, generator=gen) * 3).to(dtype)
    logits[4, 7] = logits[4, vocab - 2] = 40.0  # a tie for the maximum
    logits[6, : vocab // 2] = float("-inf")
    got, want = cpu_reductions.CPU, PLAIN
    assert torch.equal(got.argmax(logits.clone()), want.argmax(logits.clone()))
    top, ids, lse = got.topk_logsumexp(logits.clone(), 5)
    top_plain, ids_plain, lse_plain = want.topk_logsumexp(logits.clone(), 5)
    assert torch.equal(top, top_plain) and top.dtype == torch.float32
    assert torch.equal(logits.float().gather(1, ids), top)  # ids of those values (ties may swap columns)
    torch.testing.assert_close(lse, lse_plain, rtol=2e-6, atol=2e-6)


@pytest.mark.fast_paths
def test_acceleration_record_names_every_fast_path(monkeypatch):
    cpu.prepare()
    record = cpu.acceleration()
    assert set(record) == {"fast", "native", "amx", "mkl_intel_path"}
    assert cpu.describe(record).startswith("cpu: stand-ins on")
    monkeypatch.setenv(cpu.FAST_ENV, "0")
    assert cpu.acceleration()["fast"] is False
    changed = cpu.differences(record, cpu.acceleration())  # the C kernels and AMX go with the switch
    assert changed[0] == "fast True -> False"
    assert changed[1:] == [f"{key} True -> False" for key in ("native", "amx") if record[key]]
    assert cpu.differences(None, record) == []
