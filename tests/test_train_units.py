"""Training building blocks against hand-derived values: the LR schedule, the label-smoothed
loss, the metrics log and the plot."""

import math
import types

import pytest
import torch
import torch.nn.functional as F

from mtrain.loss import label_smoothed_loss, symmetric_kl
from mtrain.plot import MetricsLog, plot_metrics, read_metrics
from mtrain.schedule import (
    cooldown_factor,
    cooldown_patience_note,
    inverse_sqrt_lr,
    lr_at,
)


def test_lr_schedule_hand_computed_paper_values():
    # d_model 512, warmup 4000 (the paper). Step 1: 512^-0.5 * 1 * 4000^-1.5 = 1 / (22.6274 * 252982.2).
    assert inverse_sqrt_lr(1, 512, 4000) == pytest.approx(1.74693e-7, rel=1e-5)
    # Peak at step == warmup: (512 * 4000)^-0.5 = 1 / 1431.084.
    assert inverse_sqrt_lr(4000, 512, 4000) == pytest.approx(6.98771e-4, rel=1e-5)
    # 4x past the peak the inverse-sqrt branch gives half the peak: (512 * 16000)^-0.5.
    assert inverse_sqrt_lr(16000, 512, 4000) == pytest.approx(3.49386e-4, rel=1e-5)
    assert inverse_sqrt_lr(16000, 512, 4000, scale=2.0) == pytest.approx(6.98771e-4, rel=1e-5)


def test_lr_schedule_rises_linearly_then_decays():
    lrs = [inverse_sqrt_lr(s, 256, 100) for s in range(1, 400)]
    peak = max(range(len(lrs)), key=lrs.__getitem__) + 1
    assert peak == 100
    assert lrs[49] == pytest.approx(lrs[0] * 50)  # linear warmup: lr(50) = 50 lr(1)
    assert all(a > b for a, b in zip(lrs[99:], lrs[100:]))


def test_cooldown_falls_linearly_over_the_last_updates():
    # max_steps 100, cooldown 20: updates 1..81 keep the full lr (81 is the cooldown's first, factor 20/20),
    # then each update loses a twentieth: update 90 gets (101 - 90) / 20 = 11/20, the last one 1/20 (not 0).
    factors = [cooldown_factor(s, 100, 20) for s in (1, 80, 81, 82, 90, 100)]
    assert factors == pytest.approx([1, 1, 1, 19 / 20, 11 / 20, 1 / 20])
    assert cooldown_factor(100, 100, 0) == 1  # 0 = no cooldown, the paper's schedule unchanged
    assert lr_at(90, 256, 10, 0.5, 100, 0) == inverse_sqrt_lr(90, 256, 10, 0.5)
    # 0.5 * 256^-0.5 * 90^-0.5 * 11/20, written out.
    assert lr_at(90, 256, 10, 0.5, 100, 20) == pytest.approx(0.5 / 16 / math.sqrt(90) * 0.55, rel=1e-12)
    # Continuous where the cooldown starts, then strictly falling: no jump for Adam to absorb.
    lrs = [lr_at(s, 256, 10, 0.5, 100, 20) for s in range(1, 101)]
    assert lrs[80] == pytest.approx(lrs[79] * math.sqrt(80 / 81))
    assert all(a > b > 0 for a, b in zip(lrs[10:], lrs[11:]))


def test_early_stopping_that_could_skip_the_cooldown_is_logged():
    # max_steps 8000, cooldown 2500: the cooldown is updates 5501..8000 (factor 1 at 5501, as above).
    note = cooldown_patience_note(8000, 2500, 12)
    assert "train.patience=12" in note and "updates 5501-8000" in note and "train.patience=0" in note
    assert cooldown_patience_note(8000, 2500, 0) is None  # no early stopping: the cooldown always runs
    assert cooldown_patience_note(8000, 0, 12) is None  # no cooldown to skip
    # A 1h budget with its last third as the cooldown: from 40 minutes of training on.
    note = cooldown_patience_note(100_000, 0, 3, max_time=3600, cooldown_fraction=1 / 3)
    assert "train.patience=3" in note and "from 40m00s of training on" in note
    assert cooldown_patience_note(100_000, 0, 0, max_time=3600, cooldown_fraction=1 / 3) is None


def test_label_smoothing_hand_computed_v4():
    # p = (1/2, 1/4, 1/8, 1/8), reference class 0, eps 0.1, V = 4.
    # Smoothed target q = (1 - eps) onehot + eps/V = (0.925, 0.025, 0.025, 0.025).
    # -sum q log p = (0.925 * 1 + 0.025 * (2 + 3 + 3)) ln 2 = 1.125 ln 2.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    loss, nll = label_smoothed_loss(logits, torch.tensor([0]), eps=0.1)
    assert loss.item() == pytest.approx(1.125 * math.log(2), rel=1e-6)
    assert nll.item() == pytest.approx(math.log(2), rel=1e-6)


def test_label_smoothing_matches_torch_convention_and_sums():
    torch.manual_seed(0)
    logits, target = torch.randn(7, 11), torch.randint(0, 11, (7,))
    loss, nll = label_smoothed_loss(logits, target, eps=0.2)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, target, label_smoothing=0.2, reduction="sum").item(), rel=1e-5)
    assert nll.item() == pytest.approx(F.cross_entropy(logits, target, reduction="sum").item(), rel=1e-5)
    plain, plain_nll = label_smoothed_loss(logits, target, eps=0.0)
    assert plain.item() == plain_nll.item() == pytest.approx(nll.item())


def test_metrics_log_drops_events_after_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in (1, 2, 3):
        log.write({"event": "train", "step": step, "loss": 1.0 / step, "lr": 0.1})
    with open(path, "a") as handle:
        handle.write('{"event": "train", "st')  # a torn line from a hard kill
    MetricsLog(path, resume_step=2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_plot_writes_png(tmp_path):
    records = [{"event": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3 * s} for s in range(1, 5)]
    records.append({"event": "valid", "step": 4, "loss": 2.0, "bleu": 3.5})
    out = tmp_path / "plot.png"
    plot_metrics(records, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_label_smoothing_gradient_is_softmax_minus_target(eps):
    # The hand-written backward against autograd through the textbook formula (float64), and the
    # closed form d loss / d x = softmax(x) - q at a hand-checkable point.
    torch.manual_seed(1)
    logits = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 8, 3, 3, 1, 5])
    loss, nll = label_smoothed_loss(logits, target, eps)
    assert not nll.requires_grad
    (loss * 0.37).backward()
    reference = logits.detach().clone().requires_grad_(True)
    log_p = torch.log_softmax(reference, dim=-1)
    q = (1 - eps) * F.one_hot(target, 9) + eps / 9
    ((-(q * log_p).sum()) * 0.37).backward()
    assert torch.allclose(logits.grad, reference.grad, atol=1e-12)
    uniform = torch.zeros(1, 4, requires_grad=True)  # softmax = 1/4 each
    label_smoothed_loss(uniform, torch.tensor([2]), eps)[0].backward()
    expected = [0.25 - eps / 4] * 4
    expected[2] -= 1 - eps
    assert uniform.grad[0].tolist() == pytest.approx(expected)


def test_label_smoothing_refuses_a_second_backward():
    logits = torch.randn(3, 5, requires_grad=True)
    loss, _ = label_smoothed_loss(logits, torch.tensor([0, 1, 2]), 0.1)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


# ---------------------------------------------------------------- mixed precision choice

def test_bf16_on_a_cpu_without_native_bfloat16_trains_in_float32(monkeypatch):
    """Emulated bf16 matmuls ran ~50x slower than float32 on an AVX2-only CPU (a 35 s step instead of
    1.3 s): train.amp=bf16 there must fall back to float32 and say so; with AMX it stays bf16."""
    from mtrain import hardware

    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert hardware.resolve_amp("bf16", cpu) is None
    note = hardware.amp_note("bf16", None, cpu)
    assert "float32" in note and "no native bfloat16" in note and "\n" not in note
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert hardware.resolve_amp("bf16", cpu) is torch.bfloat16
    assert hardware.amp_note("bf16", torch.bfloat16, cpu).startswith("precision: bfloat16 (train.amp=bf16: cpu")
    assert hardware.resolve_amp("off", cpu) is None  # auto on CPUs: tests/test_precision.py


@pytest.mark.parametrize("major,auto", [(7, torch.float16), (8, torch.bfloat16)], ids=["T4", "A100"])
def test_bf16_asked_on_a_gpu_without_native_bfloat16_says_it_is_emulated(monkeypatch, major, auto):
    """A GPU of compute capability 7 (V100, T4) runs bfloat16 matmuls emulated: train.amp=auto picks
    float16 there, and an explicit bf16 is kept but the precision line says what it costs."""
    from mtrain import hardware

    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (major, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some GPU")
    assert hardware.resolve_amp("auto", gpu) is auto and hardware.resolve_amp("bf16", gpu) is torch.bfloat16
    note = hardware.amp_note("bf16", torch.bfloat16, gpu)
    assert note.startswith("precision: bfloat16 (train.amp=bf16: Some GPU") and "\n" not in note
    assert ("so emulated and slow; train.amp=auto trains in float16 here" in note) == (major < 8)


@pytest.mark.parametrize("amx,avx512_bf16,native", [(False, False, False), (True, False, True),
                                                    (False, True, True), (True, True, True)])
def test_native_bf16_means_amx_or_avx512_bf16_on_x86(monkeypatch, amx, avx512_bf16, native):
    from mtrain import hardware
    from mtrain.hardware import cpu_has_native_bf16, cpu_summary

    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert cpu_has_native_bf16() is native
    assert cpu_summary()["native_bf16"] is native


def test_device_names_resolve_or_fail_in_one_line(monkeypatch):
    """auto follows CUDA's availability; a name that is no device, CUDA where there is none, and a
    GPU index past the visible ones each fail in one line that says what to pass instead."""
    from mtrain.errors import MtrainError
    from mtrain.hardware import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(MtrainError, match=r"^--device gpu0: not a device name; use auto, cpu, cuda or cuda:N$"):
        resolve_device("gpu0")
    with pytest.raises(MtrainError, match=r"^--device cuda: CUDA is not available here"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(MtrainError, match=r"^--device cuda:2: 2 GPU\(s\) are visible here \(cuda:0 to cuda:1\); "
                                          r"name one of them, or check CUDA_VISIBLE_DEVICES$"):
        resolve_device("cuda:2")


def test_cpu_signature_is_the_first_processors_family_model_and_stepping(tmp_path):
    from mtrain.hardware import cpu_model, cpu_signature, cpuinfo_fields

    block = "processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {model}\n" \
            "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 2\n\n"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(block.format(n=0, model=207) + block.format(n=1, model=143), encoding="utf-8")
    fields = cpuinfo_fields(str(cpuinfo))
    assert cpu_signature(fields) == "family 6 model 207 stepping 2"
    assert cpu_model(fields) == "Intel(R) Xeon(R) Processor"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some ARM core\n\n", encoding="utf-8")
    assert cpu_signature(cpuinfo_fields(str(cpuinfo))) is None  # no x86 signature fields
    assert cpu_signature(cpuinfo_fields(str(tmp_path / "missing"))) is None


# ---------------------------------------------------------------- R-Drop

def test_symmetric_kl_hand_computed():
    """p = (1/2, 1/2) from logits (0, 0), q = (3/4, 1/4) from logits (log 3, 0):
    KL(p||q) = 1/2 ln(2/3) + 1/2 ln 2, KL(q||p) = 3/4 ln(3/2) + 1/4 ln(1/2); the term is their mean."""
    a, b = torch.zeros(1, 2), torch.tensor([[math.log(3.0), 0.0]])
    kl_pq = 0.5 * math.log(2 / 3) + 0.5 * math.log(2)
    kl_qp = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert symmetric_kl(a, b).item() == pytest.approx(0.5 * (kl_pq + kl_qp), rel=1e-6)
    assert symmetric_kl(b, a).item() == pytest.approx(symmetric_kl(a, b).item(), rel=1e-6)
    logits = torch.randn(5, 7)
    assert symmetric_kl(logits, logits).item() == 0.0
    twice = torch.cat([a, a]), torch.cat([b, b])  # summed over rows
    assert symmetric_kl(*twice).item() == pytest.approx(2 * symmetric_kl(a, b).item(), rel=1e-6)


def test_symmetric_kl_gradient_matches_autograd_of_the_definition():
    """The closed-form backward against torch.autograd.gradcheck and against autograd through
    the textbook definition with torch's kl_div."""
    torch.manual_seed(0)
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(symmetric_kl, (a, b))
    log_p, log_q = F.log_softmax(a, -1), F.log_softmax(b, -1)
    reference = 0.5 * (F.kl_div(log_q, log_p, log_target=True, reduction="sum")
                       + F.kl_div(log_p, log_q, log_target=True, reduction="sum"))
    ga, gb = torch.autograd.grad(reference, (a, b))
    ours = symmetric_kl(a, b)
    assert ours.item() == pytest.approx(reference.item(), rel=1e-10)
    ha, hb = torch.autograd.grad(ours, (a, b))
    assert torch.allclose(ga, ha) and torch.allclose(gb, hb)


def _objective_batch(dropout: float):
    from mtrain.config import ModelConfig
    from mtrain.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, vocab_size=20,
                      dropout=dropout, max_len=16)
    model = Transformer(cfg)
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    tgt_in = torch.tensor([[1, 10, 11, 12], [1, 13, 0, 0]])
    tgt_out = torch.tensor([[10, 11, 12, 2], [13, 2, 0, 0]])
    return model, (src, tgt_in, tgt_out)


def test_rdrop_without_dropout_equals_the_plain_loss_and_gradient():
    """With no dropout the two copies agree, the KL term is 0 and the mean of two equal losses is
    the plain loss: R-Drop changes nothing but the regulariser."""
    from mtrain.loss import Objective

    model, batch = _objective_batch(dropout=0.0)
    model.train()
    grads = []
    for alpha in (0.0, 5.0):
        model.zero_grad()
        loss, nll = Objective(model, 0.1, alpha)(*batch)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if alpha == 0.0:
            plain = loss.item(), nll.item()
    assert (loss.item(), nll.item()) == pytest.approx(plain, rel=1e-5)
    assert all(torch.allclose(g0, g1, atol=1e-6) for g0, g1 in zip(*grads))


def test_rdrop_adds_alpha_times_a_positive_kl_and_is_off_in_eval():
    """Under dropout the two copies draw independent masks, so KL > 0; from the same RNG state the
    loss grows linearly in alpha (the masks do not depend on it), by alpha/2 times the KL. In eval
    mode (validation loss) R-Drop is off."""
    from mtrain.loss import Objective

    model, batch = _objective_batch(dropout=0.3)
    model.train()
    losses = {}
    for alpha in (1.0, 2.0, 3.0):  # (alpha 0 takes the plain one-copy path, other masks)
        torch.manual_seed(1)
        losses[alpha] = Objective(model, 0.1, alpha)(*batch)[0].item()
    half_kl = losses[2.0] - losses[1.0]
    assert half_kl > 0
    assert losses[3.0] - losses[2.0] == pytest.approx(half_kl, rel=1e-4)
    model.eval()
    assert Objective(model, 0.1, 5.0)(*batch)[0].item() == pytest.approx(Objective(model, 0.1, 0.0)(*batch)[0].item())


# ---------------------------------------------------------------- RNG state in checkpoints


class FakeCudaGenerators:
    """torch.cuda's generator calls on a machine with `count` visible GPUs, each state a distinct tensor."""

    def __init__(self, monkeypatch, count: int):
        self.states = {i: torch.tensor([i + 10], dtype=torch.uint8) for i in range(count)}
        self.set_calls: list[tuple] = []
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_rng_state",
                            lambda device="cuda": self.states[torch.device(device).index].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state",
                            lambda state, device="cuda": self.set_calls.append((torch.device(device).index, int(state[0]))))
        monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                            lambda states: self.set_calls.append(("all", [int(s[0]) for s in states])))


def test_rng_state_saves_the_training_gpus_generator_and_restores_it_wherever_it_is_visible(monkeypatch):
    """A checkpoint keeps the generator of the GPU the process trained on, and a resume sets it on
    the GPU it trains on now, however many GPUs are visible; the CPU generators round-trip too."""
    from mtrain.resume import rng_state, set_rng_state
    gpus = FakeCudaGenerators(monkeypatch, count=4)
    torch.manual_seed(3)
    state = rng_state(torch.device("cuda", 2))
    assert [int(s[0]) for s in state["cuda"]] == [12]
    expected = torch.rand(3)
    gpus2 = FakeCudaGenerators(monkeypatch, count=1)  # resumed where one GPU is visible
    assert set_rng_state(state, torch.device("cuda", 0)) is None
    assert gpus2.set_calls == [(0, 12)] and torch.equal(torch.rand(3), expected)
    assert rng_state(torch.device("cpu"))["cuda"] == []  # on a CPU: no GPU state
    assert "run on a GPU" in set_rng_state(state)  # a GPU run resumed on a CPU: restored, with a note
    assert torch.equal(torch.rand(3), expected)


def test_rng_state_of_every_gpu_restores_only_where_as_many_are_visible(monkeypatch):
    """Checkpoints that saved every visible GPU's generator restore them all where as many GPUs are
    visible; elsewhere, and for a CPU run resumed on a GPU, set_rng_state says why it could not;
    a CPU run resumed on a CPU needs no note."""
    from mtrain.resume import rng_state, set_rng_state
    state = rng_state(torch.device("cpu"))
    state["cuda"] = [torch.tensor([10], dtype=torch.uint8), torch.tensor([11], dtype=torch.uint8)]
    gpus = FakeCudaGenerators(monkeypatch, count=2)
    assert set_rng_state(state, torch.device("cuda", 0)) is None and gpus.set_calls == [("all", [10, 11])]
    FakeCudaGenerators(monkeypatch, count=3)
    assert "generators of 2 GPUs and 3 are visible" in set_rng_state(state, torch.device("cuda", 0))
    state["cuda"] = []
    assert "run on a CPU" in set_rng_state(state, torch.device("cuda", 0))
    assert set_rng_state(state) is None


ADAM = types.SimpleNamespace(adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-9, weight_decay=0.0)


def test_float16_overflow_skips_the_update_lowers_the_scale_and_is_not_counted():
    """With float16's gradient scaler, an infinite gradient skips the optimizer step and halves the
    scale (as early in every float16 run); train_step then counts no update (it returns {}). A finite
    gradient steps. The scaler runs on the CPU here; on a GPU it is the same object on "cuda"."""
    from mtrain.trainer import Trainer, new_optimizer

    model = torch.nn.Linear(3, 2)
    optimizer = new_optimizer(model, ADAM, torch.device("cpu"))  # fused, as a GPU run's is: the scaler's own path
    assert optimizer.param_groups[0]["fused"] is True
    optimizer.param_groups[0]["lr"] = 0.1
    lines: list[str] = []
    fake = types.SimpleNamespace(model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0),
                                 tcfg=types.SimpleNamespace(clip_norm=0.0), state=types.SimpleNamespace(step=6),
                                 log=lines.append)
    before = [p.detach().clone() for p in model.parameters()]
    fake.scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    assert Trainer._clip_and_step(fake) == float("inf")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # not stepped
    assert fake.scaler.get_scale() == 512.0 and all(p.grad is None for p in model.parameters())
    assert lines == ["step 7: float16 gradients overflowed at loss scale 1024; update skipped, the scale is now 512"]
    fake.scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    assert math.isfinite(Trainer._clip_and_step(fake))
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and len(lines) == 1


def test_resumed_adam_keeps_its_fused_kernel_and_steps_under_the_loss_scaler():
    """A checkpoint written without fused Adam (fused=None) resumes into the fused optimizer the
    trainer makes: moments and step counts load, the kernel choice stays, and a scaled step (the
    float16 path) runs. Loading the file's groups as they are would turn fusion off, and the
    scaler's step would then fail."""
    from mtrain.trainer import new_optimizer, with_own_kernels

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    unfused = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    unfused.step()
    saved = unfused.state_dict()
    assert saved["param_groups"][0]["fused"] is None
    optimizer = new_optimizer(model, ADAM, torch.device("cpu"))
    optimizer.load_state_dict(with_own_kernels(saved, optimizer))
    group = optimizer.param_groups[0]
    assert group["fused"] is True and group["lr"] == 0.1 and group["betas"] == (0.9, 0.999)  # the file's hyperparameters
    for param in model.parameters():
        assert torch.equal(optimizer.state[param]["exp_avg"], unfused.state[param]["exp_avg"])
        assert float(optimizer.state[param]["step"]) == 1.0
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(float(optimizer.state[p]["step"]) == 2.0 for p in model.parameters())

