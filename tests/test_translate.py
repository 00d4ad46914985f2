"""translate_lines and `mtrain translate`: one output line per input line, input order restored
after length sorting, empty and overlong lines, n-best format, atomic output, argument errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from mtrain.cli import app
from mtrain.config import DecodeConfig
from mtrain.tokenizer import EOS_ID
from mtrain.translate import decode_batches, translate_lines

REAL = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde spielen im Schnee mit einem roten Ball, während ein Kind zuschaut.",
    "Eine Frau.",
    "Kinder laufen am Strand entlang und lachen über die großen Wellen.",
]


class CopyCache:
    def __init__(self, group: int) -> None:
        self.length = 0
        self.group = group  # target rows per source row (beam search)

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:  # every row is at the same position
        pass

    def expand_beams(self, group: int) -> CopyCache:  # beam search's first step runs one row per source
        self.group = group
        return self


class CopyModel:
    """Emits its source token by token (probability 0.9, the rest spread evenly), then EOS: the
    translation of a line is the line itself, so any misplaced or cut line is visible in the text."""

    def __init__(self, vocab_size: int, max_len: int = 256) -> None:
        self.cfg = SimpleNamespace(max_len=max_len)
        self.vocab_size = vocab_size

    def new_cache(self, group: int = 1) -> CopyCache:
        return CopyCache(group)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return src.float().unsqueeze(-1)

    def decode(self, tgt, memory, src, cache):
        position = min(cache.length, src.size(1) - 1)
        cache.length += 1
        probs = torch.full((tgt.size(0), 1, self.vocab_size), 0.1 / (self.vocab_size - 1))
        probs.scatter_(2, src[:, position].repeat_interleave(cache.group).view(-1, 1, 1), 0.9)
        return probs.log()


@pytest.fixture(scope="module")
def tokenizer(tokenized_slice):
    from mtrain.data import TokenizedData

    return TokenizedData(tokenized_slice).tokenizer


def test_decode_batches_respect_the_budget_and_cover_every_line():
    lengths = [5, 1, 9, 3, 3, 7, 2, 20, 4]
    batches = decode_batches(lengths, max_tokens=16)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert len(batch) == 1 or len(batch) * (longest + 1) <= 16
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(lengths, reverse=True)  # sorted by length: little padding


@pytest.mark.parametrize("beam", [1, 3])
def test_order_restored_and_empty_and_overlong_lines(tokenizer, beam, capsys):
    long_line = " ".join(["Hund"] * 300)
    lines = [REAL[0], "", REAL[1], "   \t", long_line, REAL[2], long_line + " Katze", REAL[3], ""]
    model = CopyModel(tokenizer.tgt.vocab_size, max_len=64)
    decode = DecodeConfig(beam=beam, max_len_a=1.0, max_len_b=5, max_tokens=40)  # several batches
    out = translate_lines(model, tokenizer, lines, decode, "cpu")
    assert len(out) == len(lines)
    expected = tokenizer.src.normalize(lines)
    for i in (0, 2, 5, 7):  # real lines come back as themselves, each at its own index
        assert out[i] == expected[i]
    assert out[1] == out[3] == out[8] == ""
    cut = tokenizer.src.decode([tokenizer.src.encode([long_line])[0][:63]])[0]
    assert out[4] == out[6] == cut  # cut to max_len - 1 tokens (room for EOS)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "2 input line" in warnings[0]


def test_max_len_cuts_the_copy(tokenizer):
    model = CopyModel(tokenizer.tgt.vocab_size)
    [out] = translate_lines(model, tokenizer, [REAL[1]], DecodeConfig(beam=2, max_len_a=0.0, max_len_b=3), "cpu")
    assert out == tokenizer.tgt.decode([tokenizer.src.encode([REAL[1]])[0][:3]])[0]


def test_translations_never_add_lines(tokenizer):
    """A model may emit a newline byte piece; the output line must stay one line."""
    pieces = tokenizer.tgt.decode([[i] for i in range(tokenizer.tgt.vocab_size)])
    newline = pieces.index("\n")  # the byte-fallback piece <0x0A>

    class NewlineModel(CopyModel):
        def decode(self, tgt, memory, src, cache):
            logits = torch.zeros(tgt.size(0), 1, self.vocab_size)
            logits[:, 0, newline if cache.length < 2 else EOS_ID] = 10.0
            cache.length += 1
            return logits

    out = translate_lines(NewlineModel(tokenizer.tgt.vocab_size), tokenizer, ["a", "b"], DecodeConfig(beam=1), "cpu")
    assert len(out) == 2 and all("\n" not in line for line in out)


# --- the command line, on a tiny random checkpoint ----------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tokenizer, tokenized_slice, tmp_path_factory):
    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.model import Transformer

    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      vocab_size=tokenizer.tgt.vocab_size, max_len=48)
    torch.manual_seed(0)
    model = Transformer(cfg)
    path = tmp_path_factory.mktemp("run") / "best.pt"
    save_atomic(make(to_dict(Config(model=cfg)), model.state_dict(), tokenizer.to_state(),
                     TokenizedData(tokenized_slice).stats, 0), path)
    return path


def run(*args, input: str | bytes | None = None):
    return CliRunner().invoke(app, ["translate", *map(str, args)], input=input)


def test_cli_file_to_file_is_line_aligned_and_atomic(checkpoint, tmp_path):
    lines = REAL + ["", " ".join(["Hund"] * 100), "  "] + REAL[:2]
    src = tmp_path / "in.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "deep" / "out.en"
    result = run("--checkpoint", checkpoint, "--input", src, "--output", out, "--beam", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output
    written = out.read_text(encoding="utf-8").split("\n")
    assert written[-1] == "" and len(written) - 1 == len(lines)
    assert written[4] == written[6] == ""
    assert "1 input line" in result.stderr  # the overlong line, cut with a warning
    assert not list(out.parent.glob(".*.tmp"))
    # stdin to stdout gives the same lines; the last line needs no trailing newline
    piped = run("--checkpoint", checkpoint, "--beam", "2", "--device", "cpu", input="\n".join(lines))
    assert piped.exit_code == 0, piped.output
    assert piped.stdout == out.read_text(encoding="utf-8")


def test_cli_nbest_format(checkpoint):
    result = run("--checkpoint", checkpoint, "--beam", "3", "--nbest", "2", "--device", "cpu",
                 input=REAL[0] + "\n\n" + REAL[2] + "\n")
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [int(r[0]) for r in rows] == [0, 0, 1, 1, 2, 2] and all(len(r) == 3 for r in rows)
    for first, second in (rows[0:2], rows[4:6]):
        assert math.isfinite(float(first[1])) and float(first[1]) >= float(second[1])
    assert rows[2][2] == rows[3][2] == ""


def test_cli_invalid_utf8_names_the_line_and_keeps_the_old_output(checkpoint, tmp_path):
    src = tmp_path / "bad.de"
    src.write_bytes(REAL[0].encode() + b"\n" + b"caf\xe9\n")
    out = tmp_path / "out.en"
    out.write_text("previous\n", encoding="utf-8")
    result = run("--checkpoint", checkpoint, "--input", src, "--output", out, "--device", "cpu")
    assert result.exit_code == 1
    assert f"{src}:2: invalid UTF-8" in result.stderr and "Traceback" not in result.output
    assert out.read_text(encoding="utf-8") == "previous\n"
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("args, needle", [
    (["--beam", "0"], "--beam 0"),
    (["--beam", "2", "--nbest", "3"], "--nbest 3"),
    (["--greedy", "--nbest", "2"], "--nbest 2"),
    (["--max-len-a", "-1"], "--max-len-a"),
    (["--max-len-b", "-2"], "--max-len-b"),
    (["--workers", "0"], "--workers 0"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "nonsense"], "--device"),
])
def test_cli_bad_arguments_fail_in_one_line(checkpoint, args, needle):
    result = run("--checkpoint", checkpoint, *args, input="Hallo\n")
    assert result.exit_code == 1
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("search", [["--greedy"], ["--beam", "3", "--nbest", "2"],
                                    ["--sample", "--nbest", "2", "--topk", "5", "--seed", "3"]])
def test_cli_workers_translate_as_one_process_does(checkpoint, tmp_path, monkeypatch, search):
    """--workers 2 decodes the batches in two processes (mtrain.cpu.workers) of one thread each: the
    output is byte for byte that of one process with one thread, over several chunks of many small
    batches, with empty lines kept. Against one process with two threads, whose matrix products may
    sum in another order (they did on an AMD Zen 4), the text is the same and the scores agree to
    float32 rounding."""
    import mtrain.checkpoint as checkpoint_module
    import mtrain.translate as translate_module

    monkeypatch.setattr(translate_module, "CHUNK_LINES", 4)  # the reading side, in this process
    lines = (REAL + ["", "  "]) * 3
    src = tmp_path / "in.de"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    threads = torch.get_num_threads()
    outputs = {}
    try:
        for workers, process_threads in ((1, 1), (1, 2), (2, 2)):
            torch.set_num_threads(process_threads)
            if workers == 2:  # the calling process builds no model of its own; the spawned workers do
                monkeypatch.setattr(checkpoint_module, "Transformer", no_model_here)
            out = tmp_path / f"out{workers}-{process_threads}.en"
            result = run("--checkpoint", checkpoint, "-i", src, "-o", out, "--max-tokens", "24", "--device", "cpu",
                         "--workers", workers, *search)
            assert result.exit_code == 0, result.output
            outputs[workers, process_threads] = out.read_text(encoding="utf-8")
    finally:
        torch.set_num_threads(threads)
    assert outputs[2, 2] == outputs[1, 1]
    assert len(outputs[1, 1].splitlines()) == len(lines) * (2 if "--nbest" in search else 1)
    if "--nbest" not in search:
        assert outputs[1, 2] == outputs[2, 2]
        return
    two_threads, workers = ([line.split("\t") for line in outputs[k].splitlines()] for k in ((1, 2), (2, 2)))
    assert [(i, text) for i, _, text in two_threads] == [(i, text) for i, _, text in workers]
    for (_, a, _), (_, b, _) in zip(two_threads, workers):  # printed to 4 decimals
        assert math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=2e-4)


def no_model_here(*args, **kwargs):
    raise AssertionError("a model was built in the calling process of decoding workers")


def test_outline_reads_the_checkpoint_without_its_weights(checkpoint, monkeypatch):
    """load_outline gives the calling process of decoding workers the tokenizer, the stats and the
    max_len that cuts the input, as load_for_decoding does, with no model built and no weights kept."""
    import mtrain.checkpoint as checkpoint_module
    from mtrain.translate import load_for_decoding, load_outline

    model, tokenizer, ckpt = load_for_decoding(checkpoint, torch.device("cpu"))
    monkeypatch.setattr(checkpoint_module, "Transformer", no_model_here)
    outline, outline_tokenizer, outline_ckpt = load_outline([checkpoint], torch.device("cpu"))
    assert outline.cfg.max_len == model.cfg.max_len == 48
    assert outline_tokenizer.src.model == tokenizer.src.model and outline_tokenizer.tgt.model == tokenizer.tgt.model
    assert "model" not in outline_ckpt and outline_ckpt["stats"] == ckpt["stats"]


def test_outline_checks_an_ensemble_as_loading_does(checkpoint, tmp_path):
    """Members trained on other data fail in the calling process, before any worker starts."""
    from mtrain.checkpoint import load
    from mtrain.errors import MtrainError
    from mtrain.translate import load_outline

    state = dict(load(checkpoint)["tokenizer"], src_model=b"other")
    other = resave(checkpoint, tmp_path / "other.pt", tokenizer=state)
    with pytest.raises(MtrainError, match="its vocabulary differs"):
        load_outline([checkpoint, other], torch.device("cpu"))


def test_outline_of_an_exported_folder_loads_no_translator(checkpoint, tmp_path, monkeypatch):
    """For a CTranslate2 folder the calling process reads export.json and the SentencePiece model only."""
    import json

    import mtrain.export.runtime as runtime
    from mtrain.checkpoint import load
    from mtrain.errors import MtrainError
    from mtrain.translate import load_outline

    monkeypatch.setattr(runtime, "CTranslate2Model", no_model_here)
    state = load(checkpoint)["tokenizer"]
    (tmp_path / "spm.model").write_bytes(state["src_model"])
    meta = {"format": "ctranslate2", "max_len": 33, "max_positions": 1024, "stats": {"a": 1}}
    (tmp_path / "export.json").write_text(json.dumps(meta))
    outline, tokenizer, ckpt = load_outline(tmp_path, torch.device("cpu"))
    assert outline.cfg.max_len == 33 and tokenizer.src.model == state["src_model"] and ckpt == {"stats": {"a": 1}}
    for broken, needle in (({"format": "huggingface"}, "a huggingface export"), ({"max_len": "33"}, "'max_len'")):
        (tmp_path / "export.json").write_text(json.dumps(dict(meta, **broken)))
        with pytest.raises(MtrainError, match=needle):
            load_outline(tmp_path, torch.device("cpu"))


def torch_before_worker_start() -> bool:
    from mtrain.cpu.workers import _worker

    return _worker["torch_before_start"]


def test_translate_workers_start_before_torch(checkpoint):
    """MKL's dispatch (mtrain.cpu.mkl) must come before torch: nothing a translate worker
    unpickles before its start imports torch."""
    from mtrain.translate import decoding_pool

    with decoding_pool(str(checkpoint), DecodeConfig(workers=2), torch.device("cpu")) as pool:
        assert pool.executor.submit(torch_before_worker_start).result() is False


def test_workers_need_a_cpu(checkpoint):
    """Decoding processes share a CPU: asked for on a GPU device, one line says to use one."""
    from mtrain.errors import MtrainError
    from mtrain.translate import decoding_pool

    with pytest.raises(MtrainError, match="decode.workers=2: .* use decode.workers=1"):
        decoding_pool([checkpoint], DecodeConfig(workers=2), torch.device("cuda"))
    with decoding_pool([checkpoint], DecodeConfig(workers=1), torch.device("cuda")) as pool:
        assert pool is None


def beam3_lines(checkpoint, setting: str, lines: list[str]) -> list[str]:
    """`mtrain translate --beam 3 --set SETTING` of lines: one line out per line in (checked), empty
    lines staying empty."""
    result = run("--checkpoint", checkpoint, "--beam", "3", "--device", "cpu", "--set", setting,
                 input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    written = result.stdout.split("\n")
    assert len(written) - 1 == len(lines) and written[-1] == ""
    assert all(out == "" for line, out in zip(lines, written) if not line)
    return written[:-1]


def test_cli_int8_decoding_is_line_aligned_and_deterministic(checkpoint, tmp_path):
    # decode.quantize=int8 goes through the same text handling: one line out per line in, empty lines
    # stay empty, and the same input gives the same output on a second run.
    lines = REAL + ["", REAL[1]]
    first = beam3_lines(checkpoint, "decode.quantize=int8", lines)
    assert beam3_lines(checkpoint, "decode.quantize=int8", lines) == first


def test_cli_bf16_decoding_is_line_aligned_and_matches_a_bf16_copy(checkpoint, monkeypatch):
    # decode.amp=bf16 (forced native here) loads the weights as bfloat16: the CLI's output is that of
    # translate_lines on a bfloat16 copy of the model, line for line, empty lines staying empty.
    from mtrain import hardware
    from mtrain.checkpoint import load_model
    from mtrain.cpu.quantize import bfloat16_weights

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    lines = REAL + ["", REAL[1]]
    written = beam3_lines(checkpoint, "decode.amp=bf16", lines)
    model, tokenizer, ckpt = load_model(checkpoint)
    expected = translate_lines(bfloat16_weights(model), tokenizer, lines, DecodeConfig(beam=3), "cpu",
                               ckpt.get("stats") or None)
    assert written == expected


@pytest.mark.parametrize("setting, needle", [("decode.quantize=int4", "decode.quantize"),
                                             ("decode.amp=bf16", "drop decode.amp")])
def test_cli_int8_settings_that_cannot_work_fail_in_one_line(checkpoint, setting, needle):
    extra = [] if setting.startswith("decode.quantize") else ["--set", "decode.quantize=int8"]
    result = run("--checkpoint", checkpoint, "--device", "cpu", "--set", setting, *extra, input="Hallo\n")
    assert result.exit_code == 1
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


# --- ensembles from the command line ---------------------------------------------------------------

def resave(checkpoint, path, **changes):
    """A copy of `checkpoint` with some entries replaced (weights, tokenizer, config)."""
    from mtrain.checkpoint import load, save_atomic

    ckpt = load(checkpoint)
    ckpt.update(changes)
    save_atomic(ckpt, path)
    return path


def test_cli_ensemble_of_a_checkpoint_with_itself_translates_as_it_does(checkpoint, tmp_path):
    alone = run("--checkpoint", checkpoint, "--beam", "3", "--device", "cpu", input="\n".join(REAL) + "\n")
    twice = run("--checkpoint", checkpoint, "--checkpoint", resave(checkpoint, tmp_path / "copy.pt"),
                "--beam", "3", "--device", "cpu", input="\n".join(REAL) + "\n")
    assert alone.exit_code == twice.exit_code == 0, twice.output
    assert twice.stdout == alone.stdout and len(twice.stdout.splitlines()) == len(REAL)


def test_cli_ensemble_of_different_models_is_line_aligned(checkpoint, tmp_path):
    from mtrain.checkpoint import load

    torch.manual_seed(1)
    weights = {name: torch.randn_like(w) * 0.1 for name, w in load(checkpoint)["model"].items()}
    other = resave(checkpoint, tmp_path / "other.pt", model=weights)
    lines = REAL + ["", REAL[0]]
    result = run("--checkpoint", checkpoint, "--checkpoint", other, "--beam", "2", "--device", "cpu",
                 input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    out = result.stdout.split("\n")
    assert len(out) - 1 == len(lines) and out[4] == "" and out[0] == out[5]


def test_cli_ensemble_needs_one_vocabulary_and_one_direction(checkpoint, tokenized_slice, tmp_path):
    from mtrain.checkpoint import load
    from mtrain.config import TokenizerConfig
    from mtrain.tokenizer import Tokenizer

    lines = (tokenized_slice / "train.src.txt").read_text(encoding="utf-8").splitlines()[:500]
    other_vocab = Tokenizer.train(lines, lines, TokenizerConfig(vocab_size=400)).to_state()
    config = load(checkpoint)["config"]
    reversed_pair = {**config, "data": {**config["data"], "src": config["data"]["tgt"], "tgt": config["data"]["src"]}}
    for path, needle in [(resave(checkpoint, tmp_path / "vocab.pt", tokenizer=other_vocab), "vocabulary differs"),
                         (resave(checkpoint, tmp_path / "reversed.pt", config=reversed_pair), "translates en->de")]:
        result = run("--checkpoint", checkpoint, "--checkpoint", path, "--device", "cpu", input="Hallo\n")
        assert result.exit_code == 1
        assert f"{path}: " in result.stderr and needle in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
