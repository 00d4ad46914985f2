"""train.amp: which precision a run resolves to on which hardware, and that `mtrain train
--dry-run` and the training log say it."""

from __future__ import annotations

import json

import pytest
import torch

from mtrain import hardware

CPU = torch.device("cpu")
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.num_threads=1"]


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_exactly_on_cpus_that_multiply_it_natively(monkeypatch, native):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    assert hardware.resolve_amp("auto", CPU) is (torch.bfloat16 if native else None)
    assert hardware.resolve_amp("off", CPU) is None
    assert hardware.resolve_amp("bf16", CPU) is (torch.bfloat16 if native else None)


@pytest.mark.parametrize("amx,avx512_bf16,isa", [(False, False, None), (True, False, "AMX"),
                                                 (False, True, "AVX512-BF16"), (True, True, "AMX")])
def test_the_note_names_the_instructions_that_make_bf16_native(monkeypatch, amx, avx512_bf16, isa):
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert hardware.cpu_bf16_isa() == isa
    dtype = hardware.resolve_amp("auto", CPU)
    note = hardware.amp_note("auto", dtype, CPU)
    assert "\n" not in note
    if isa is None:
        assert dtype is None and note.startswith("precision: float32 (train.amp=auto: cpu without native bfloat16")
    else:
        assert dtype is torch.bfloat16 and note.startswith("precision: bfloat16 (") and isa in note
        assert "train.amp=off" in note  # how to get float32 back


@pytest.mark.parametrize("onednn", [True, False])
def test_off_x86_onednn_decides_and_the_x86_checks_are_not_asked(monkeypatch, onednn):
    """On aarch64 torch's x86 checks exist and say False; oneDNN's check (the BF16 extension, as on
    AWS Graviton 3) decides instead."""
    monkeypatch.setattr(hardware.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(hardware, "onednn_has_bf16", lambda: onednn)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: pytest.fail("asked on aarch64"), raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: pytest.fail("asked on aarch64"), raising=False)
    assert hardware.cpu_bf16_isa() == ("oneDNN" if onednn else None)
    assert hardware.resolve_amp("auto", CPU) is (torch.bfloat16 if onednn else None)


def test_onednn_check_answers_a_boolean_on_this_build():
    assert isinstance(hardware.onednn_has_bf16(), bool)


@pytest.mark.parametrize("capability,expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_on_a_gpu_is_bfloat16_from_ampere_on_else_float16(monkeypatch, capability, expected):
    """A V100 (7.0) or T4 (7.5) gets float16 even though torch.cuda.is_bf16_supported() says yes
    there (bfloat16 is emulated); the capability asked is that of the device named, not the current one."""
    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: asked.append(index) or capability)
    assert hardware.resolve_amp("auto", torch.device("cuda", 1)) is expected
    assert hardware.resolve_amp("auto", torch.device("cuda")) is expected
    assert asked == [1, 0]


@pytest.mark.parametrize("native,amp,expected", [(True, "auto", "bfloat16"), (True, "off", "float32"),
                                                 (False, "auto", "float32")])
def test_dry_run_reports_the_resolved_precision(tokenized_slice, monkeypatch, native, amp, expected):
    from typer.testing import CliRunner

    from mtrain.cli import app

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    args = ["train", "--data", str(tokenized_slice), "--dry-run", "--device", "cpu", "--set", f"train.amp={amp}"]
    for item in TINY:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout[result.stdout.index("{"):])["precision"] == expected
    lines = [line for line in result.stderr.splitlines() if line.startswith("precision: ")]
    assert len(lines) == 1 and lines[0].startswith(f"precision: {expected} (train.amp={amp}")


# ---------------------------------------------------------------- decoding: decode.amp

def test_decode_amp_sets_the_precision_search_runs_in(monkeypatch):
    """bf16 (native CPU): the search of a float32 model runs under bf16 autocast, a bfloat16 copy's
    without; off: in float32, even inside a caller's bf16 autocast (a training loop's validation);
    an unknown value: one line naming decode.amp."""
    from mtrain import translate
    from mtrain.config import DecodeConfig, ModelConfig
    from mtrain.errors import MtrainError
    from mtrain.model import Transformer

    seen = []

    def search(model, src, max_len, decode, prefixes, lines):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return [[([5], 0.0)] * decode.nbest for _ in range(src.size(0))]

    class Side:
        vocab_size = 20

        def encode(self, lines, out_type=int):
            return [[5, 6] for _ in lines]

        def decode(self, ids):
            return ["x" for _ in ids]

    class Tok:
        src = tgt = Side()

    monkeypatch.setattr(translate, "_search", search)
    monkeypatch.setattr(translate, "encode_capped", lambda side, lines, max_len: ([[5, 6] for _ in lines], 0))
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    model = Transformer(ModelConfig(d_model=8, d_ff=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, vocab_size=20))
    translate.translate_nbest(model, Tok(), ["a"], DecodeConfig(beam=1, amp="bf16"), "cpu")
    translate.translate_nbest(model, Tok(), ["a"], DecodeConfig(beam=1), "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's autocast does not leak in
        translate.translate_nbest(model, Tok(), ["a"], DecodeConfig(beam=1), "cpu")
    assert seen == [torch.bfloat16, None, None]
    from mtrain.cpu.quantize import bfloat16_weights

    translate.translate_nbest(bfloat16_weights(model), Tok(), ["a"], DecodeConfig(beam=1, amp="bf16"), "cpu")
    assert seen[-1] is None  # weights load_for_decoding made bfloat16 need no autocast
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    translate.translate_nbest(model.float(), Tok(), ["a"], DecodeConfig(beam=1, amp="bf16"), "cpu")
    assert seen[-1] is None  # emulated bf16 would be slower, not faster
    with pytest.raises(MtrainError, match=r"^decode.amp='fast': unknown value; use auto, bf16, fp16 or off$"):
        translate.translate_nbest(model, Tok(), ["a"], DecodeConfig(beam=1, amp="fast"), "cpu")
