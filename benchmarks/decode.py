"""Decoding speed, side by side: mtrain greedy and beam 5 (float32, with int8 linear layers as
`--set decode.quantize=int8` decodes, and with bfloat16 weights as `--set decode.amp=bf16` decodes
where the CPU multiplies bfloat16 natively), Hugging Face `MarianMTModel.generate` (greedy and beam 5) and
CTranslate2 (float32 and int8, greedy and beam 5, when installed) on the same Multi30k test2016
sentences; and mtrain's beam 5 with an ensemble of two such models (`--checkpoint A --checkpoint B`).

The models are randomly initialised at one shape (post-norm, d_model 256, 3+3 layers, d_ff 1024,
4 heads, vocab 8000), so every system is made to decode exactly the same number of steps: each
batch gets one target length L (its longest source, in tokens) and EOS is suppressed before it.
All systems see the same length-sorted batches (mtrain's 4096 source-token budget), twice: the
first pass warms every system on the very batches it is timed on, and the second is the one timed.
oneDNN, which mtrain's bfloat16 and int8 linear layers run on, compiles a kernel for each new
matmul shape (about 1 ms each) and keeps it for the process; the first pass pays that for each batch
size, which a translation of many lines pays once. The first pass's speeds are reported too
(<system>_first_pass_sent_s and the ratios' *_first_pass).

    python benchmarks/decode.py [--quick] [--json] [--sentences N] [--threads T]
    python benchmarks/decode.py --checkpoint RUN/averaged.pt [--json] [--threads T]

With --checkpoint, a real trained model instead: test2016 translated by mtrain (beam 5, float32,
with int8 linear layers, and with bfloat16 weights where native) and by its `mtrain export` to CTranslate2 in float32 and int8 (beam 5,
CTranslate2's own search and length penalty), all through mtrain's text handling; sentences/s, cased
sacreBLEU and the share of lines identical to mtrain float32's, same run.

Prints a table (stderr with --json) and, with --json, one JSON object on stdout with
<system>_sent_s for each system above (mtrain_greedy, mtrain_beam5, mtrain_int8_greedy, mtrain_int8_beam5,
mtrain_bf16_greedy, mtrain_bf16_beam5, hf_greedy, hf_beam5, ct2_beam5, ct2_int8_greedy, ct2_int8_beam5, mtrain_ensemble2_beam5), the matching
*_tok_s (target tokens/s: decoding steps x sentences) and the ratios, each of the timed pass and of the first.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtrain.cpu import mkl  # noqa: E402

if __name__ == "__main__":  # before torch, as the CLI does; CTranslate2's spawned process keeps its own
    mkl.enable()

import torch  # noqa: E402

from mtrain.config import ModelConfig, TokenizerConfig  # noqa: E402
from mtrain.ensemble import Ensemble  # noqa: E402
from mtrain.export.runtime import pieces  # noqa: E402
from mtrain.hardware import cpu_has_native_bf16, machine_record  # noqa: E402
from mtrain.model import Transformer  # noqa: E402
from mtrain.cpu.quantize import bfloat16_weights, quantize_int8  # noqa: E402
from mtrain.search import beam_search, greedy_search  # noqa: E402
from mtrain.tokenizer import EOS_ID, PAD_ID, Tokenizer  # noqa: E402
from mtrain.translate import decode_batches  # noqa: E402

SHAPE = ModelConfig(d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                    vocab_size=8000, dropout=0.0)
CORPUS = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]
CACHE = ROOT / "data" / "bench-decode"  # the benchmark's SentencePiece model (data/ is not committed)
BEAM = 5
MAX_TOKENS = 4096
# (mtrain system, peer system) pairs whose speed ratio is reported as <mtrain>_vs_<peer>.
RATIOS = [("mtrain_beam5", "hf_beam5"), ("mtrain_beam5", "ct2_beam5"), ("mtrain_greedy", "hf_greedy"),
          ("mtrain_beam5", "ct2_int8_beam5"), ("mtrain_bf16_beam5", "ct2_int8_beam5"),
          ("mtrain_bf16_greedy", "hf_greedy"), ("mtrain_greedy", "ct2_int8_greedy"),
          ("mtrain_int8_beam5", "ct2_int8_beam5"), ("mtrain_int8_greedy", "hf_greedy"),
          ("mtrain_int8_greedy", "ct2_int8_greedy"), ("mtrain_int8_beam5", "hf_beam5")]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def corpus_dir() -> Path:
    for path in CORPUS:
        if (path / "test2016.de").is_file():
            return path
    sys.exit("no Multi30k copy in data/multi30k or ../shared/corpora/multi30k")


def load_tokenizer(corpus: Path) -> Tokenizer:
    """A joint 8k SentencePiece model of Multi30k train, trained once and cached."""
    if (CACHE / "spm.model").is_file():
        return Tokenizer.load(CACHE)
    log("training the benchmark's SentencePiece model (once) ...")
    read = lambda name: (corpus / name).read_text(encoding="utf-8").splitlines()  # noqa: E731
    return Tokenizer.train(read("train.de"), read("train.en"), TokenizerConfig(vocab_size=SHAPE.vocab_size), CACHE)


def batches_of(ids: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
    """(padded src ending in EOS, target length L) per length-sorted batch."""
    out = []
    for batch in decode_batches([len(seq) for seq in ids], MAX_TOKENS):
        rows = [ids[i] for i in batch]
        src = torch.full((len(rows), max(map(len, rows)) + 1), PAD_ID, dtype=torch.long)
        for r, seq in enumerate(rows):
            src[r, : len(seq)] = torch.tensor(seq)
            src[r, len(seq)] = EOS_ID
        out.append((src, max(map(len, rows))))
    return out


class FixedLength(torch.nn.Module):
    """Benchmark-only wrapper: EOS is impossible before step `steps` - 1, so that with
    max_len = steps - 1 search runs exactly `steps` decoder steps (the last one emits EOS).
    It sits outside mtrain.search, so the normal decoding path pays nothing for it."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model, self.cfg, self.steps = model, model.cfg, 0

    def new_cache(self, group: int = 1):
        return self.model.new_cache(group)

    def encode(self, src):
        return self.model.encode(src)

    def decode(self, tgt, memory, src, cache):
        return self.project(self.decode_states(tgt, memory, src, cache))

    def decode_states(self, tgt, memory, src, cache):
        self.position = cache.length
        return self.model.decode_states(tgt, memory, src, cache)

    def project(self, states):
        logits = self.model.project(states)
        if self.position < self.steps - 1:
            logits[..., EOS_ID] = float("-inf")
        return logits


def run_mtrain(models: list[FixedLength], src: torch.Tensor, steps: int, beam: int) -> None:
    """Greedy (beam 1) or beam search; several models decode as one Ensemble, each suppressing EOS
    itself."""
    for model in models:
        model.steps = steps
    decoder = models[0] if len(models) == 1 else Ensemble(models)
    max_len = torch.full((src.size(0),), steps - 1)
    if beam == 1:
        out = greedy_search(decoder, src, max_len)
        assert all(len(ids) == steps - 1 for ids in out)
    else:
        out = beam_search(decoder, src, beam, 0.6, max_len)
        assert all(len(hyps[0][0]) == steps - 1 for hyps in out)


def marian_config(vocab: int):
    from transformers import MarianConfig

    # Marian is post-norm with scaled embeddings and sinusoids, like mtrain. Its pad token is the
    # last vocabulary entry (as in OPUS-MT, which the CTranslate2 converter expects).
    return MarianConfig(
        vocab_size=vocab + 1, d_model=SHAPE.d_model, encoder_layers=SHAPE.n_encoder_layers,
        decoder_layers=SHAPE.n_decoder_layers, encoder_attention_heads=SHAPE.n_heads,
        decoder_attention_heads=SHAPE.n_heads, encoder_ffn_dim=SHAPE.d_ff, decoder_ffn_dim=SHAPE.d_ff,
        activation_function="relu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=512, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=vocab, eos_token_id=EOS_ID, decoder_start_token_id=vocab,
        forced_eos_token_id=None,
    )


def run_hf(model, src: torch.Tensor, steps: int, beam: int, vocab: int) -> None:
    src = src.masked_fill(src == PAD_ID, vocab)  # Marian's pad id
    with torch.inference_mode():
        out = model.generate(input_ids=src, attention_mask=src != vocab, num_beams=beam, do_sample=False,
                             min_new_tokens=steps, max_new_tokens=steps, length_penalty=0.6, early_stopping=False)
    assert out.size(1) == steps + 1  # decoder start token + steps tokens


def save_marian_for_ct2(model, tokenizer: Tokenizer, folder: Path) -> Path:
    """HF model + MarianTokenizer folder (what TransformersConverter reads), then convert."""
    import ctranslate2
    from transformers import MarianTokenizer

    names = pieces(tokenizer.src.model)
    names[PAD_ID] = "<pad0>"  # Marian's pad is an extra last entry; mtrain's id 0 keeps another name
    vocab = {piece: i for i, piece in enumerate(names)}
    vocab["<pad>"] = len(names)
    hf_dir = folder / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    (hf_dir / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer.save(folder / "spm")
    spm_path = str(folder / "spm" / "spm.model")
    MarianTokenizer(spm_path, spm_path, str(hf_dir / "vocab.json")).save_pretrained(hf_dir)
    model.save_pretrained(hf_dir)
    out = folder / "ct2"
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out), force=True)
    return out


def run_ct2(translator, rows: list[list[int]], steps: int, names: list[str], beam: int) -> None:
    tokens_in = [[names[i] for i in row if i != PAD_ID] for row in rows]  # ends with </s>
    out = translator.translate_batch(tokens_in, beam_size=beam, min_decoding_length=steps,
                                     max_decoding_length=steps, length_penalty=0.6, max_batch_size=0)
    assert all(len(r.hypotheses[0]) == steps for r in out), "ct2 did not decode exactly L steps"


class Ct2Process:
    """CTranslate2 translators in a process of their own, timed there.

    CTranslate2's OpenMP calls in the process that runs PyTorch bind to PyTorch's libgomp, whose
    team then has more threads than the machine has cores. libgomp then stops spinning between
    parallel regions and puts its threads to sleep, so every later PyTorch op waits for its threads
    to wake: after one CTranslate2 call, an mtrain greedy batch took 416 ms instead of 246 ms (2
    cores), and PyTorch alone with OMP_WAIT_POLICY=passive was as slow. Users run one of them in
    a process, so each runs in its own here."""

    def __init__(self, folder: Path, names: list[str], threads: int, compute_types: tuple[str, ...]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe()
        self.process = context.Process(target=_ct2_serve, args=(child, str(folder), names, threads, compute_types),
                                       daemon=True)
        self.process.start()
        self.pipe.recv()  # the translators are loaded

    def run(self, src: torch.Tensor, steps: int, compute_type: str, beam: int) -> float:
        """Seconds the process took to decode one batch."""
        self.pipe.send((src.tolist(), steps, compute_type, beam))
        result = self.pipe.recv()
        if isinstance(result, str):
            raise RuntimeError(f"CTranslate2 process: {result}")
        return result

    def close(self) -> None:
        self.pipe.send(None)
        self.process.join(timeout=30)


def _ct2_serve(pipe, folder: str, names: list[str], threads: int, compute_types: tuple[str, ...]) -> None:
    import ctranslate2

    translators = {kind: ctranslate2.Translator(folder, device="cpu", compute_type=kind, intra_threads=threads,
                                                inter_threads=1) for kind in compute_types}
    pipe.send("ready")
    while (request := pipe.recv()) is not None:
        rows, steps, kind, beam = request
        try:
            start = time.perf_counter()
            run_ct2(translators[kind], rows, steps, names, beam)
            pipe.send(time.perf_counter() - start)
        except Exception as error:  # noqa: BLE001 - reported by the parent
            pipe.send(f"{type(error).__name__}: {error}")


def timed(systems: dict, batches) -> dict[str, float]:
    """Seconds per system. Systems take turns batch by batch, so load from other processes on a
    shared machine falls on all of them alike rather than on whichever ran during a busy minute.
    A system that returns a number has timed itself (in another process: Ct2Process)."""
    seconds = dict.fromkeys(systems, 0.0)
    for src, steps in batches:
        for name, run in systems.items():
            start = time.perf_counter()
            took = run(src, steps)
            seconds[name] += took if isinstance(took, float) else time.perf_counter() - start
    return seconds


def real_model(checkpoint: Path, n: int, threads: int, emit) -> dict:
    """mtrain beam 5 (float32, int8, and bfloat16 where native) vs its CTranslate2 exports (float32, int8)
    on test2016 of the checkpoint's data."""
    import sacrebleu

    from mtrain.checkpoint import load_model
    from mtrain.config import DecodeConfig
    from mtrain.export import export_checkpoint
    from mtrain.translate import load_for_decoding, translate_lines

    model, tokenizer, ckpt = load_model(checkpoint)
    data = ckpt["config"]["data"]
    corpus = corpus_dir()
    sources = (corpus / f"test2016.{data['src']}").read_text(encoding="utf-8").splitlines()[:n]
    refs = (corpus / f"test2016.{data['tgt']}").read_text(encoding="utf-8").splitlines()[:n]
    decode = DecodeConfig(**{**ckpt["config"].get("decode", {}), "beam": BEAM, "nbest": 1})
    systems = {"mtrain_beam5": model}
    systems["mtrain_int8_beam5"] = load_for_decoding(checkpoint, torch.device("cpu"),
                                                     dataclasses.replace(decode, quantize="int8"))[0]
    if cpu_has_native_bf16():
        systems["mtrain_bf16_beam5"] = load_for_decoding(checkpoint, torch.device("cpu"),
                                                         dataclasses.replace(decode, amp="bf16"))[0]
    with tempfile.TemporaryDirectory() as tmp:
        for name, quantization in (("ct2_float32_beam5", None), ("ct2_int8_beam5", "int8")):
            export_checkpoint(checkpoint, "ctranslate2", Path(tmp) / name, quantization)
            systems[name] = load_for_decoding(Path(tmp) / name, torch.device("cpu"))[0]
        results, seconds, outputs = {}, dict.fromkeys(systems, 0.0), {name: [] for name in systems}
        chunks = [sources[i : i + 100] for i in range(0, len(sources), 100)]
        for name, system in systems.items():  # warm-up
            translate_lines(system, tokenizer, sources[:8], decode, "cpu", ckpt["stats"])
        for chunk in chunks:  # systems take turns, chunk by chunk (see timed)
            for name, system in systems.items():
                start = time.perf_counter()
                outputs[name] += translate_lines(system, tokenizer, chunk, decode, "cpu", ckpt["stats"])
                seconds[name] += time.perf_counter() - start
    emit(f"{checkpoint}: {len(sources)} test2016 sentences, beam {BEAM}, lenpen {decode.lenpen}, {threads} threads")
    for name in systems:
        bleu = sacrebleu.corpus_bleu(outputs[name], [refs]).score
        results[f"{name}_sent_s"] = round(len(sources) / seconds[name], 2)
        results[f"{name}_bleu"] = round(bleu, 2)
        emit(f"{name:<20} {len(sources) / seconds[name]:9.1f} sent/s   BLEU {bleu:6.2f}  ({seconds[name]:.1f} s)")
    for name in [name for name in systems if name != "mtrain_beam5"]:
        results[f"{name}_vs_mtrain"] = round(results[f"{name}_sent_s"] / results["mtrain_beam5_sent_s"], 3)
        same = sum(a == b for a, b in zip(outputs[name], outputs["mtrain_beam5"])) / len(sources)
        results[f"{name}_same_lines"] = round(same, 4)  # share of lines identical to mtrain float32's
        emit(f"{name}: {same:.1%} of lines identical to mtrain_beam5's")
    results.update(checkpoint=str(checkpoint), sentences=len(sources), threads=threads, torch=torch.__version__,
                   hardware=machine_record())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 sentences instead of 1000")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--sentences", type=int, default=0, help="override the number of sentences")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads for every system (0 = torch's default)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--checkpoint", type=Path, help="a trained checkpoint: mtrain vs its CTranslate2 exports")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    n = args.sentences or (300 if args.quick else 1000)
    if args.checkpoint is not None:
        table = sys.stderr if args.json else sys.stdout
        results = real_model(args.checkpoint, n, threads, lambda line: print(line, file=table, flush=True))
        if args.json:
            print(json.dumps(results))
        return

    corpus = corpus_dir()
    tokenizer = load_tokenizer(corpus)
    lines = (corpus / "test2016.de").read_text(encoding="utf-8").splitlines()[:n]
    ids = tokenizer.src.encode(lines)
    batches = batches_of(ids)
    warmup = batches_of(ids[:8])
    torch.manual_seed(0)
    model = FixedLength(Transformer(SHAPE).eval())
    torch.manual_seed(1)
    members = [model, FixedLength(Transformer(SHAPE).eval())]
    results: dict[str, float] = {}
    table = sys.stderr if args.json else sys.stdout  # the readable table; JSON alone on stdout
    emit = lambda line: print(line, file=table, flush=True)  # noqa: E731
    emit(f"{n} sentences, {len(batches)} batches, {threads} threads, torch {torch.__version__}")
    emit(f"mkl: {mkl.status}")
    systems = {
        "mtrain_greedy": lambda src, steps: run_mtrain([model], src, steps, 1),
        "mtrain_beam5": lambda src, steps: run_mtrain([model], src, steps, BEAM),
        "mtrain_ensemble2_beam5": lambda src, steps: run_mtrain(members, src, steps, BEAM),
    }
    int8 = FixedLength(quantize_int8(copy.deepcopy(model.model)))  # the same weights as `model`, in int8
    systems["mtrain_int8_greedy"] = lambda src, steps: run_mtrain([int8], src, steps, 1)
    systems["mtrain_int8_beam5"] = lambda src, steps: run_mtrain([int8], src, steps, BEAM)
    if cpu_has_native_bf16():  # emulated bfloat16 is many times slower than float32: no row then
        bf16 = FixedLength(bfloat16_weights(copy.deepcopy(model.model)))  # as decode.amp=bf16 loads it
        systems["mtrain_bf16_greedy"] = lambda src, steps: run_mtrain([bf16], src, steps, 1)
        systems["mtrain_bf16_beam5"] = lambda src, steps: run_mtrain([bf16], src, steps, BEAM)
    ct2 = None
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_hf and importlib.util.find_spec("transformers"):
            from transformers import MarianMTModel

            torch.manual_seed(0)
            hf = MarianMTModel(marian_config(SHAPE.vocab_size)).eval()
            systems["hf_greedy"] = lambda src, steps: run_hf(hf, src, steps, 1, SHAPE.vocab_size)
            systems["hf_beam5"] = lambda src, steps: run_hf(hf, src, steps, BEAM, SHAPE.vocab_size)
            if importlib.util.find_spec("ctranslate2"):
                ct2_dir = save_marian_for_ct2(hf, tokenizer, Path(tmp))
                ct2 = Ct2Process(ct2_dir, pieces(tokenizer.src.model), threads, ("default", "int8"))
                for name, compute_type, beam in (("ct2_beam5", "default", BEAM), ("ct2_int8_greedy", "int8", 1),
                                                 ("ct2_int8_beam5", "int8", BEAM)):
                    systems[name] = (lambda src, steps, kind=compute_type, b=beam: ct2.run(src, steps, kind, b))
        timed(systems, warmup)
        first_pass = timed(systems, batches)  # each system meets these batch sizes for the first time
        seconds = timed(systems, batches)
        if ct2 is not None:
            ct2.close()
    tokens = sum(steps * src.size(0) for src, steps in batches)
    for name, secs in seconds.items():
        results[f"{name}_sent_s"] = round(n / secs, 2)
        results[f"{name}_tok_s"] = round(tokens / secs, 1)
        emit(f"{name:<20} {n / secs:9.1f} sent/s {tokens / secs:10.0f} tok/s  ({secs:.1f} s)")
    for name, secs in first_pass.items():
        results[f"{name}_first_pass_sent_s"] = round(n / secs, 2)
    for mine, peer in RATIOS:
        if f"{mine}_sent_s" in results and f"{peer}_sent_s" in results:
            ratio = results[f"{mine}_sent_s"] / results[f"{peer}_sent_s"]
            first = results[f"{mine}_first_pass_sent_s"] / results[f"{peer}_first_pass_sent_s"]
            results[f"{mine}_vs_{peer}"] = round(ratio, 3)
            results[f"{mine}_vs_{peer}_first_pass"] = round(first, 3)
            emit(f"{mine} / {peer}: {ratio:.2f}x (first pass {first:.2f}x)")
    ratio = results["mtrain_ensemble2_beam5_sent_s"] / results["mtrain_beam5_sent_s"]
    results["mtrain_ensemble2_vs_single_beam5"] = round(ratio, 3)
    emit(f"mtrain beam 5, ensemble of 2 / one model: {ratio:.2f}x (2 models: 0.5x would be the compute ratio)")
    results.update(sentences=n, threads=threads, torch=torch.__version__, machine=platform.machine(),
                   hardware=machine_record(), shape="d256 3+3 ff1024 h4 v8000", max_tokens=MAX_TOKENS)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
