"""The typer app: thin commands that parse arguments, resolve the config and call one function.

Heavy modules (torch, sentencepiece) are imported inside the commands so `--help` and
`--print-config` answer instantly. Every user-facing failure is an MtrainError, printed as one
line on stderr with exit code 1.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from mtrain.errors import MtrainError, first_line, is_out_of_memory

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train post-norm Transformer translation models from scratch, and use them.",
)


# The commands whose time goes into matrix products: the only ones MKL's stub can speed up.
MATMUL_COMMANDS = ("train", "translate", "score", "export", "serve", "import")


@app.callback()
def _before_any_command(ctx: typer.Context) -> None:
    # Runs before the command, so before anything imports torch: MKL's fast kernels on AMD CPUs
    # need their stub loaded first (mtrain.cpu.mkl, opt-in).
    if ctx.invoked_subcommand in MATMUL_COMMANDS:
        from mtrain.cpu import mkl

        mkl.enable()


def friendly(fn: Callable) -> Callable:
    """Turn MtrainError (and Ctrl-C) into one line on stderr and an exit code, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MtrainError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            # A training update's own out-of-memory error is an MtrainError with its step and budget;
            # this is any other (validation, translate, score): one line, the batch setting to lower.
            typer.echo(f"error: out of memory ({first_line(err)[:200]}); lower the batch: --max-tokens for translate and score "
                       "(decode.max_tokens), --set train.max_tokens=N for train, whose run resumes from its last.pt",
                       err=True)
            raise typer.Exit(1) from None
        except BrokenPipeError:
            # `mtrain translate ... | head` closes the pipe early; that is not an error.
            sys.stderr.close()
            raise typer.Exit(0) from None
        except OSError as err:  # an output path that is a folder (or a file), permissions, a full disk
            from mtrain.atomic import describe_write_error

            where = err.filename2 or err.filename  # os.replace(tmp, target) names the target second
            cause, remedy = describe_write_error(err)
            if remedy is None:
                cause = err.strerror or str(err)
                remedy = ("check the path (a file where a folder is expected, or the reverse), its permissions "
                          "and the free disk space")
            else:
                remedy += " and re-run"
            typer.echo(f"error: {f'{where}: ' if where else ''}{cause}; {remedy}", err=True)
            raise typer.Exit(1) from None

    return wrapper


ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config (see configs/); defaults otherwise.")
SetOpt = typer.Option(None, "--set", help="Override a config key: section.key=value (repeatable).")
PrintConfigOpt = typer.Option(False, "--print-config", help="Print the resolved config as YAML and exit.")


def resolve_config(config: Optional[Path], overrides: Optional[List[str]], extra: dict | None = None):
    """Load the config, apply `--set` overrides, then explicit command-line flags (which win)."""
    from mtrain.config import load_config

    flags = [f"{key}={value}" for key, value in (extra or {}).items() if value is not None]
    return load_config(config, list(overrides or []) + flags)


def print_config_and_exit(cfg) -> None:
    from mtrain.config import to_yaml

    typer.echo(to_yaml(cfg), nl=False)
    raise typer.Exit(0)


@app.command()
@friendly
def tokenize(
    data: Optional[List[str]] = typer.Option(None, "--data", help="Folder with {split}.{src} / {split}.{tgt} files (or .tsv/.jsonl per split); repeat it, as DIR or NAME=DIR, to combine corpora (each evaluation split comes from the first corpus that has it)."),
    out: Path = typer.Option(Path("data/multi30k-tok"), "--out", help="Output folder for spm.model, ids and stats.json."),
    src: Optional[str] = typer.Option(None, "--src", help="Source language suffix (data.src)."),
    tgt: Optional[str] = typer.Option(None, "--tgt", help="Target language suffix (data.tgt)."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="SentencePiece vocabulary size (tokenizer.vocab_size)."),
    model_type: Optional[str] = typer.Option(None, "--model-type", help="unigram | bpe (tokenizer.model_type)."),
    splits: str = typer.Option("train,valid,test2016", "--splits", help="Comma-separated splits; the first is cleaned and used to train SentencePiece."),
    joint: Optional[bool] = typer.Option(None, "--joint/--separate", help="One vocabulary for both sides, or one per side (tokenizer.joint)."),
    hf_dataset: Optional[str] = typer.Option(None, "--hf-dataset", help="Stream a Hugging Face dataset (a hub name such as bentrevett/multi30k, or a local folder of data files) instead of --data."),
    tag: Optional[List[str]] = typer.Option(None, "--tag", help="Start this corpus's source lines with the reserved token <NAME> (repeatable; data.tags)."),
    drop_overlap: Optional[bool] = typer.Option(None, "--drop-overlap", help="Drop training pairs whose source line occurs in an evaluation split (data.drop_overlap)."),
    spm_from: Optional[Path] = typer.Option(None, "--spm-from", help="Encode with the SentencePiece model(s) of this checkpoint, tokenized data folder or spm.model instead of training one (e.g. a student keeping its teacher's vocabulary)."),
    config: Optional[Path] = ConfigOpt,
    overrides: Optional[List[str]] = SetOpt,
    print_config: bool = PrintConfigOpt,
) -> None:
    """Check and clean parallel corpora, train SentencePiece on a sample, and cache token ids (streamed: memory stays bounded)."""
    cfg = resolve_config(
        config,
        overrides,
        {
            "data.src": src,
            "data.tgt": tgt,
            "tokenizer.vocab_size": vocab_size,
            "tokenizer.model_type": model_type,
            "tokenizer.joint": joint,
            "data.tags": ",".join(tag) if tag else None,
            "data.drop_overlap": drop_overlap,
        },
    )
    if print_config:
        print_config_and_exit(cfg)
    from mtrain.prepare import tokenize_corpus

    tokenize_corpus(cfg, data_dir=data, out_dir=out, splits=splits.split(","), hf_dataset=hf_dataset, spm_from=spm_from)


@app.command()
@friendly
def train(
    data: Optional[Path] = typer.Option(None, "--data", help="Folder written by `mtrain tokenize`; its corpora are mixed by data.weights when set."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (checkpoints, metrics, plot). Re-running the same command resumes from its last.pt."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N (auto: cuda when available)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Build data and model, print a JSON summary (parameters, batches) and exit."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer updates (train.max_steps)."),
    max_time: Optional[str] = typer.Option(None, "--max-time", help="Train to a time budget, e.g. 2h, 45m, 1h30m (train.max_time): the lr cools down over its last train.cooldown_fraction (a third), and the run ends at it as at max_steps."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start a new run from this checkpoint's weights and model section (fine-tuning): a fresh optimizer and lr schedule; --data must be tokenized with its vocabulary (tokenize --spm-from CKPT)."),
    config: Optional[Path] = ConfigOpt,
    overrides: Optional[List[str]] = SetOpt,
    print_config: bool = PrintConfigOpt,
) -> None:
    """Train a post-norm Transformer on tokenized data (torchrun --nproc_per_node N -m mtrain train ... for DDP)."""
    cfg = resolve_config(config, overrides, {"train.max_steps": max_steps, "train.max_time": max_time})
    start = None
    if init_from is not None:
        from mtrain import init
        from mtrain.config import set_keys

        start = init.read_start(init_from)
        cfg = init.config_for(cfg, start, set_keys(config, list(overrides or []))["model"])
    if print_config:
        print_config_and_exit(cfg)
    if data is None:
        raise MtrainError("train: --data is missing; pass the folder written by `mtrain tokenize` (e.g. --data data/multi30k-tok)")
    if out is None and not dry_run:
        raise MtrainError("train: --out is missing; pass a run folder (e.g. --out runs/quickstart)")
    if cfg.data.weights:  # names that do not fit the data: one line before the run folder is made
        from mtrain.data import TokenizedData

        TokenizedData(data).check_weights(cfg.data, cfg.data.train_split)
    from mtrain.memory import reuse_freed_memory
    from mtrain.train import train as run_training

    reuse_freed_memory()
    summary = run_training(cfg, data_dir=data, run_dir=out, device=device, dry_run=dry_run, start=start)
    if dry_run:
        return
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one summary (rank 0's)
        typer.echo(json.dumps(summary))
    if summary.get("stopped") == "interrupted":
        raise typer.Exit(128 + int(summary.get("signal", 2)))  # 130 for SIGINT, 143 for SIGTERM


@app.command()
@friendly
def translate(
    checkpoint: List[Path] = typer.Option(..., "--checkpoint", help="A checkpoint written by `mtrain train` (best.pt, last.pt, ...); repeat it to decode with an ensemble (the mean of the models' probabilities)."),
    input: str = typer.Option("-", "--input", "-i", help="Raw text, one sentence a line; - for stdin."),
    output: str = typer.Option("-", "--output", "-o", help="Where translations go; - for stdout."),
    beam: Optional[int] = typer.Option(None, "--beam", help="Beam size (decode.beam, default 5)."),
    greedy: bool = typer.Option(False, "--greedy", help="Greedy search (same as --beam 1)."),
    lenpen: Optional[float] = typer.Option(None, "--lenpen", help="GNMT length penalty alpha: scores / ((5 + len) / 6)^alpha (decode.lenpen, default 0.6)."),
    max_len_a: Optional[float] = typer.Option(None, "--max-len-a", help="Max output length = a * src_len + b tokens (decode.max_len_a, default 1.2); a is raised to the training data's tgt/src length ratio (mean + 2 std) when that is larger."),
    max_len_b: Optional[int] = typer.Option(None, "--max-len-b", help="b of the max output length (decode.max_len_b, default 10)."),
    nbest: Optional[int] = typer.Option(None, "--nbest", help="Print N index<TAB>score<TAB>translation lines per input (index from 0; N <= beam; with --sample, N samples)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Source tokens per batch (decode.max_tokens, default 4096)."),
    sample: bool = typer.Option(False, "--sample", help="Sample each token from the model's distribution instead of searching (score: the sum of the tokens' log-probabilities)."),
    topk: Optional[int] = typer.Option(None, "--topk", help="With --sample: draw from the K most probable tokens only (1 = greedy)."),
    topp: Optional[float] = typer.Option(None, "--topp", help="With --sample: draw from the fewest most probable tokens whose probability reaches P, in (0, 1] (nucleus sampling)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="With --sample: divide the logits by T > 0 (below 1 sharper, above 1 flatter)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="With --sample: the same seed gives the same samples, however the input is batched (default 0)."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="A file whose line i (raw target text) starts line i's translation; an empty line means no prefix. The prefix counts toward the length limit."),
    no_repeat_ngram: Optional[int] = typer.Option(None, "--no-repeat-ngram", help="Never produce the same N-gram of subwords twice in one translation (0 = off)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="On a CPU: decode in N processes side by side, the threads shared among them; the output of one process with their share of the threads (decode.workers, default 1)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    overrides: Optional[List[str]] = SetOpt,
) -> None:
    """Translate raw text with a trained checkpoint (greedy search, beam search or sampling)."""
    check_sampling_options(sample, topk, topp, temperature, seed)
    cfg = resolve_config(
        None,
        overrides,
        {
            "decode.beam": 1 if greedy else beam,
            "decode.lenpen": lenpen,
            "decode.max_len_a": max_len_a,
            "decode.max_len_b": max_len_b,
            "decode.nbest": nbest,
            "decode.max_tokens": max_tokens,
            "decode.sample": sample or None,
            "decode.topk": topk,
            "decode.topp": topp,
            "decode.temperature": temperature,
            "decode.seed": seed,
            "decode.no_repeat_ngram": no_repeat_ngram,
            "decode.workers": workers,
        },
    )
    from mtrain.translate import translate_file

    translate_file(list(checkpoint), input, output, cfg.decode, device=device, prefix=prefix)


def check_sampling_options(sample: bool, topk: Optional[int], topp: Optional[float], temperature: Optional[float],
                           seed: Optional[int]) -> None:
    given = [name for name, value in (("--topk", topk), ("--topp", topp), ("--temperature", temperature),
                                      ("--seed", seed)) if value is not None]
    if given and not sample:
        raise MtrainError(f"{given[0]} applies only to sampling; add --sample (or drop {given[0]})")
    if topk is not None and topk < 1:
        raise MtrainError(f"--topk {topk}: must be at least 1; leave it out to draw from every token")


@app.command()
@friendly
def score(
    checkpoint: List[Path] = typer.Option(..., "--checkpoint", help="A checkpoint written by `mtrain train`; repeat it to score with an ensemble (the log of the mean of the models' probabilities)."),
    src: str = typer.Option(..., "--src", help="Source sentences, raw text, one a line (- for stdin)."),
    tgt: str = typer.Option(..., "--tgt", help="Their translations, raw text, one a line (an empty line scores just </s>)."),
    output: str = typer.Option("-", "--output", "-o", help="Where the scores go; - for stdout."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object a line: {logprob, tokens, mean_logprob}."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Tokens per batch and side (decode.max_tokens, default 4096)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
) -> None:
    """Score sentence pairs: log p(target | source) by teacher forcing, one line per pair
    (total_logprob<TAB>tokens<TAB>mean_logprob, tokens counting </s>)."""
    cfg = resolve_config(None, None, {"decode.max_tokens": max_tokens})
    if cfg.decode.max_tokens < 1:
        raise MtrainError(f"--max-tokens {cfg.decode.max_tokens}: must be at least 1")
    from mtrain.score import score_file

    score_file(list(checkpoint), src, tgt, output, cfg.decode.max_tokens, as_json=json_out, device=device)


@app.command(name="eval")
@friendly
def evaluate(
    hyp: Optional[Path] = typer.Option(None, "--hyp", help="Detokenized hypotheses, one a line."),
    ref: List[Path] = typer.Option(..., "--ref", help="Raw reference file (repeat for several references)."),
    checkpoint: Optional[List[Path]] = typer.Option(None, "--checkpoint", help="Translate --src with this checkpoint, then score; repeat it for an ensemble."),
    src: Optional[Path] = typer.Option(None, "--src", help="Source file to translate (with --checkpoint)."),
    output_hyp: Optional[Path] = typer.Option(None, "--output-hyp", help="Also write the translations here (with --checkpoint)."),
    beam: Optional[int] = typer.Option(None, "--beam", help="Beam size (decode.beam)."),
    lenpen: Optional[float] = typer.Option(None, "--lenpen", help="Length penalty alpha (decode.lenpen)."),
    lowercase: bool = typer.Option(False, "--lowercase", help="Case-insensitive BLEU/TER/chrF (sacrebleu -lc)."),
    tokenize: Optional[str] = typer.Option(None, "--tokenize", help="sacrebleu BLEU tokenizer (13a, intl, none, ...)."),
    worst: int = typer.Option(0, "--worst", help="List the N sentences with the lowest sentence-BLEU."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    overrides: Optional[List[str]] = SetOpt,
) -> None:
    """Score translations with sacreBLEU (BLEU, chrF, TER), printing signatures."""
    if hyp is not None and (beam is not None or lenpen is not None or overrides):
        raise MtrainError("--beam, --lenpen and --set decode options apply only with --checkpoint; drop them when scoring --hyp")
    cfg = resolve_config(None, overrides, {"decode.beam": beam, "decode.lenpen": lenpen})
    check_eval_options(hyp, checkpoint, src, output_hyp, worst)
    from mtrain.evaluate import check_metric_options, evaluate, read_stripped_lines

    ref_lines = [read_stripped_lines(path) for path in ref]
    ref_names = [str(path) for path in ref]
    check_metric_options(lowercase, tokenize)  # an unknown --tokenize fails now, not after translating
    if hyp is not None:
        hyps, hyp_name = read_stripped_lines(hyp), str(hyp)
    else:
        hyps, hyp_name = translate_for_eval(checkpoint, src, output_hyp, cfg.decode, device, ref_lines, ref_names)
    result = evaluate(hyps, ref_lines, hyp_name, ref_names, lowercase, tokenize, worst)
    typer.echo(json.dumps(result.as_dict(), ensure_ascii=False) if json_out else result.report())


def check_eval_options(hyp: Optional[Path], checkpoint: Optional[List[Path]], src: Optional[Path],
                       output_hyp: Optional[Path], worst: int) -> None:
    if (hyp is None) == (not checkpoint):
        raise MtrainError("pass exactly one of --hyp FILE (score it) or --checkpoint FILE --src FILE (translate, then score)")
    if checkpoint and src is None:
        raise MtrainError("--checkpoint needs --src: the source file to translate")
    if hyp is not None and (src is not None or output_hyp is not None):
        raise MtrainError("--src and --output-hyp apply only with --checkpoint; drop them or use --checkpoint")
    if worst < 0:
        raise MtrainError(f"--worst {worst}: must be 0 or a positive number of lines")


def translate_for_eval(checkpoint: List[Path], src: Path, output_hyp: Optional[Path], decode, device: str,
                       ref_lines: list, ref_names: list) -> tuple[list, str]:
    """`eval --checkpoint`: translate --src (line counts checked first, so a mismatch fails before a
    long translation); the translations go to --output-hyp before scoring, whatever happens next."""
    import dataclasses

    from mtrain.atomic import atomic_write
    from mtrain.evaluate import check_line_counts, read_stripped_lines
    from mtrain.translate import translate_checkpoints

    src_lines = read_stripped_lines(src)
    check_line_counts(src_lines, ref_lines, str(src), ref_names)
    hyps = translate_checkpoints(list(checkpoint), src_lines, dataclasses.replace(decode, nbest=1), device)
    if output_hyp is not None:
        with atomic_write(output_hyp) as handle:
            handle.writelines(line + "\n" for line in hyps)
    return hyps, f"translations of {src}"


@app.command()
@friendly
def average(
    checkpoints: List[Path] = typer.Argument(..., help="Checkpoints to average (e.g. RUN/step-*.pt)."),
    out: Path = typer.Option(..., "--out", help="Where to write the averaged checkpoint."),
) -> None:
    """Average the weights of several checkpoints of one run into one (as the paper did)."""
    from mtrain.checkpoint import average_checkpoints

    average_checkpoints(checkpoints, out)




@app.command()
@friendly
def export(
    checkpoint: List[Path] = typer.Option(..., "--checkpoint", help="One checkpoint written by `mtrain train` (averaged.pt is the usual one)."),
    format: str = typer.Option(..., "--format", help="ctranslate2 (for ctranslate2.Translator) or huggingface (MarianMTModel + MarianTokenizer)."),
    out: Path = typer.Option(..., "--out", help="The folder to write (new or empty; --force replaces it)."),
    quantization: Optional[str] = typer.Option(None, "--quantization", help="ctranslate2 only: int8, int8_float32, int16, float16 or bfloat16 (default float32)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists and is not empty."),
    check: Optional[Path] = typer.Option(None, "--check", help="Source sentences to check parity on (raw text, one a line; default: a built-in handful)."),
    check_ref: Optional[Path] = typer.Option(None, "--check-ref", help="Their reference translations (one a line), for log-probabilities and BLEU."),
    data: Optional[Path] = typer.Option(None, "--data", help="A tokenized data folder: check parity on its validation split (sources and references)."),
    check_lines: int = typer.Option(200, "--check-lines", help="Check on at most this many sentences."),
    as_json: bool = typer.Option(False, "--json", help="Print the parity report as one JSON object."),
) -> None:
    """Export a checkpoint to CTranslate2 or Hugging Face, and check that it translates like mtrain."""
    from mtrain.export import ParityError, check_request, export_checkpoint
    from mtrain.export.checkset import read_check_set
    from mtrain.export.parity import format_report

    check_request(list(checkpoint), format, out, quantization, force)
    check_set = read_check_set(check, check_ref, data, check_lines)
    try:
        result = export_checkpoint(checkpoint[0], format, out, quantization, force, check_set)
    except ParityError as err:
        typer.echo(json.dumps(err.result) if as_json else format_report(err.result))
        raise
    typer.echo(json.dumps(result) if as_json else format_report(result))
    sys.stdout.flush()
    typer.echo(f"wrote {out} ({format}{', ' + quantization if quantization else ''})", err=True)


@app.command(name="import")
@friendly
def import_model(
    model: str = typer.Option(..., "--model", help="A Hugging Face MarianMTModel folder (OPUS-MT models, `mtrain export --format huggingface`), or a hub name such as Helsinki-NLP/opus-mt-de-en (downloaded)."),
    out: Path = typer.Option(..., "--out", help="The mtrain checkpoint to write (e.g. runs/opus-de-en/model.pt)."),
    format: str = typer.Option("huggingface", "--format", help="huggingface (MarianMTModel)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Import a Marian model as an mtrain checkpoint, to translate, score, fine-tune (train --init-from) and export."""
    if format != "huggingface":
        raise MtrainError(f"--format {format}: import reads huggingface (MarianMTModel) folders")
    if out.is_dir():
        raise MtrainError(f"--out {out}: a folder; pass the checkpoint file to write, e.g. {out / 'model.pt'}")
    from mtrain.hub import import_marian

    summary = import_marian(model, out)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"wrote {out}: {summary['parameters']:,} parameters, {summary['layers'][0]}+{summary['layers'][1]} "
                   f"layers, d_model {summary['d_model']}, {summary['activation']}, output bias "
                   f"{'yes' if summary['output_bias'] else 'no'}, vocabulary {summary['vocabulary']}")


@app.command()
@friendly
def serve(
    checkpoint: List[Path] = typer.Option(..., "--checkpoint", help="A checkpoint (repeat it for an ensemble) or a folder written by `mtrain export --format ctranslate2`, as `mtrain translate` takes them."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    beam: Optional[int] = typer.Option(None, "--beam", help="Default beam size of a request that sets none (decode.beam, default 5)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Source tokens per decoding batch (decode.max_tokens, default 4096)."),
    batch_wait_ms: float = typer.Option(5.0, "--batch-wait-ms", help="How long the first waiting request waits for others to share its batch."),
    max_lines: int = typer.Option(256, "--max-lines", help="Lines one request may hold (more: 413)."),
    max_chars: int = typer.Option(100_000, "--max-chars", help="Characters one request may hold, all lines together (more: 413)."),
    max_queue_lines: int = typer.Option(20_000, "--max-queue-lines", help="Lines waiting for a batch, all requests together, before new requests get 503."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N."),
    overrides: Optional[List[str]] = SetOpt,
) -> None:
    """Serve translations over HTTP: POST /translate, GET /health, a page to try it at /, API docs at /docs."""
    from mtrain.serve import require_server_libraries

    require_server_libraries()
    for name, value in (("--port", port if 0 < port < 65536 else 0), ("--max-lines", max_lines),
                        ("--max-chars", max_chars), ("--max-queue-lines", max_queue_lines)):
        if value < 1:
            raise MtrainError(f"{name}: must be at least 1{' and below 65536' if name == '--port' else ''}")
    if batch_wait_ms < 0:
        raise MtrainError(f"--batch-wait-ms {batch_wait_ms}: must not be negative")
    cfg = resolve_config(None, overrides, {"decode.beam": beam, "decode.max_tokens": max_tokens})
    from mtrain.hardware import resolve_device
    from mtrain.serve import serve as run_server
    from mtrain.serve.api import Limits

    run_server(list(checkpoint), cfg.decode, resolve_device(device), host, port, batch_wait_ms / 1000.0,
               Limits(max_lines, max_chars, max_queue_lines))


if __name__ == "__main__":  # after every command is registered, so `python -m mtrain.cli --help` lists them all
    app()
