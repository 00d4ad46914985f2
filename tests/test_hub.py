"""`mtrain import --format huggingface`: mtrain's own Marian export comes back exactly (weights,
tokenizer, translations); an OPUS-MT-style folder that transformers itself writes (swish, a
final_logits_bias, two SentencePiece models sharing one vocabulary, </s> 0 and <pad> last, decoding
from <pad>) translates in mtrain as transformers' greedy `generate` does, fine-tunes, and exports;
what does not fit the post-norm model is refused in one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mtrain import checkpoint  # noqa: E402
from mtrain.cli import app  # noqa: E402
from mtrain.config import DecodeConfig  # noqa: E402
from mtrain.translate import load_for_decoding, translate_lines  # noqa: E402


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_checkpoint(tokenized_slice, tmp_path_factory) -> Path:
    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.model import Transformer

    data = TokenizedData(tokenized_slice)
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=2, n_decoder_layers=1,
                      vocab_size=data.tokenizer.tgt.vocab_size, max_len=64)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny") / "best.pt"
    config = to_dict(Config(model=cfg))
    config["data"].update(src="de", tgt="en")
    save_atomic(make(config, Transformer(cfg).state_dict(), data.tokenizer.to_state(), data.stats, 0), path)
    return path


@pytest.fixture(scope="module")
def lines(multi30k_slice) -> list[str]:
    return (multi30k_slice / "valid.de").read_text(encoding="utf-8").splitlines()[:12]


def test_import_after_export_gives_the_checkpoint_back(tiny_checkpoint, lines, tmp_path):
    exported, back = tmp_path / "hf", tmp_path / "back.pt"
    assert cli("export", "--checkpoint", tiny_checkpoint, "--format", "huggingface", "--out", exported).exit_code == 0
    result = cli("import", "--model", exported, "--out", back)
    assert result.exit_code == 0, result.output
    a, b = checkpoint.load(tiny_checkpoint), checkpoint.load(back)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["tokenizer"] == b["tokenizer"] and a["config"]["model"] == b["config"]["model"]
    decode = DecodeConfig(beam=3)
    original, imported = (translate_lines(*load_for_decoding([p], torch.device("cpu"))[:2], lines, decode, "cpu")
                          for p in (tiny_checkpoint, back))
    assert original == imported


def train_spm(text: list[str], vocab_size: int) -> bytes:
    """A SentencePiece model as Marian's are: <unk> 0, <s> 1, </s> 2, no <pad>."""
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buffer, vocab_size=vocab_size,
                                   model_type="unigram", minloglevel=2)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def opus_folder(multi30k_slice, tmp_path_factory) -> Path:
    """What an OPUS-MT model's folder holds, written by transformers: random weights."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    from mtrain.export.runtime import pieces

    folder = tmp_path_factory.mktemp("opus")
    de = (multi30k_slice / "train.de").read_text(encoding="utf-8").splitlines()
    en = (multi30k_slice / "train.en").read_text(encoding="utf-8").splitlines()
    source, target = train_spm(de, 300), train_spm(en, 250)
    (folder / "source.spm").write_bytes(source)
    (folder / "target.spm").write_bytes(target)
    shared = ["</s>", "<unk>"]
    for piece in pieces(source) + pieces(target):
        if piece not in shared and piece not in ("<s>",):
            shared.append(piece)
    shared.append("<pad>")
    (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(shared)}), encoding="utf-8")
    MarianTokenizer(str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json"),
                    source_lang="de", target_lang="en").save_pretrained(folder)
    pad = len(shared) - 1
    config = MarianConfig(vocab_size=len(shared), decoder_vocab_size=len(shared), d_model=32, encoder_layers=2,
                          decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, activation_function="swish", max_position_embeddings=128,
                          pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0,
                          scale_embedding=True, share_encoder_decoder_embeddings=True, bad_words_ids=[[pad]])
    torch.manual_seed(3)
    model = MarianMTModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights large enough that the output depends on the input
            if p.dim() == 2:
                p.normal_(0, 0.5 if "shared" in name else 0.2)
        model.final_logits_bias.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, lines: list[str], n: int) -> list[str]:
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer, model = MarianTokenizer.from_pretrained(folder), MarianMTModel.from_pretrained(folder).eval()
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=n + 1)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def test_an_opus_mt_style_folder_translates_as_transformers_generate(opus_folder, lines, tmp_path):
    out = tmp_path / "opus.pt"
    result = cli("import", "--model", opus_folder, "--out", out)
    assert result.exit_code == 0, result.output
    assert "swish, output bias yes, vocabulary mapped" in result.output
    cfg = checkpoint.load(out)["config"]["model"]
    assert cfg["activation"] == "swish" and cfg["output_bias"] and cfg["max_len"] == 128
    n = 12  # mtrain: at most n tokens, then </s>; transformers: n + 1 new tokens, the last forced to </s>
    model, tokenizer, _ = load_for_decoding([out], torch.device("cpu"))
    ours = translate_lines(model, tokenizer, lines, DecodeConfig(beam=1, max_len_a=0.0, max_len_b=n), "cpu")
    assert ours == hf_greedy(opus_folder, lines, n)
    assert len({line for line in ours}) > 1  # the outputs depend on the input


def test_an_imported_model_fine_tunes_and_exports(opus_folder, multi30k_slice, tmp_path):
    imported = tmp_path / "opus.pt"
    assert cli("import", "--model", opus_folder, "--out", imported).exit_code == 0
    data = tmp_path / "tok"
    result = cli("tokenize", "--data", multi30k_slice, "--src", "de", "--tgt", "en", "--splits", "train,valid",
                 "--spm-from", imported, "--out", data)
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    settings = ["train.max_steps=2", "train.max_tokens=512", "train.eval_every=2", "train.eval_max_sentences=4",
                "train.save_every=2", "train.num_threads=1"]
    result = cli("train", "--data", data, "--out", run, "--device", "cpu", "--init-from", imported,
                 *[x for item in settings for x in ("--set", item)])
    assert result.exit_code == 0, result.output
    tuned = checkpoint.load(run / "last.pt")
    assert tuned["tokenizer"] == checkpoint.load(imported)["tokenizer"] and "proj.bias" in tuned["model"]
    ct2 = tmp_path / "ct2"
    pytest.importorskip("ctranslate2")
    result = cli("export", "--checkpoint", run / "last.pt", "--format", "ctranslate2", "--out", ct2)
    assert result.exit_code == 0, result.output  # the export's parity check passed on its built-in sentences
    hf, back = tmp_path / "hf", tmp_path / "back.pt"
    assert cli("export", "--checkpoint", run / "last.pt", "--format", "huggingface", "--out", hf).exit_code == 0
    assert cli("import", "--model", hf, "--out", back).exit_code == 0
    again = checkpoint.load(back)
    assert again["tokenizer"] == tuned["tokenizer"]
    assert all(torch.equal(again["model"][k], tuned["model"][k]) for k in tuned["model"])


@pytest.mark.parametrize("change, needle", [
    ({"normalize_before": True}, "normalize_before=true"),
    ({"activation_function": "gelu"}, "activation_function='gelu'"),
    ({"scale_embedding": False}, "scale_embedding=false"),
    ({"decoder_ffn_dim": 128}, "encoder_ffn_dim=64 and decoder_ffn_dim=128"),
])
def test_what_does_not_fit_is_refused_in_one_line(opus_folder, tmp_path, change, needle):
    import shutil

    folder = tmp_path / "changed"
    shutil.copytree(opus_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    result = cli("import", "--model", folder, "--out", tmp_path / "x.pt")
    assert result.exit_code == 1 and needle in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "x.pt").exists()
