"""Threads or processes for decoding on a CPU, on benchmarks/decode.py's model, sentences and batches:
- mtrain with bfloat16 weights (float32 with --float32), greedy and beam 5: one process with T
  threads, one with 1 thread, and T processes with 1 thread each side by side, each decoding every
  batch (sentences/s in all: what `mtrain translate --workers T` can reach on a large input);
- Hugging Face greedy `generate` (when transformers is installed), the same three ways;
- CTranslate2 int8 (when installed): intra_threads=T, inter_threads=1 (benchmarks/decode.py's setting)
  against intra_threads=1, inter_threads=T, the batches submitted at once.

    python benchmarks/decode_processes.py [--threads 2] [--sentences 1000] [--float32] [--json]

Each measurement runs in fresh processes and times a second pass over the batches (the first makes
oneDNN's kernels for their shapes). Processes side by side start that pass together (each says it
is ready and waits for the word to go), as the workers of a long `mtrain translate` run are all
busy at once, and are timed from the first one's start of it to the last one's end."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]


def benchmark_batches(args: argparse.Namespace):
    """decode.py's tokenizer and its batches of the first --sentences test2016 lines."""
    import decode as bench

    tokenizer = bench.load_tokenizer(bench.corpus_dir())
    lines = (bench.corpus_dir() / "test2016.de").read_text(encoding="utf-8").splitlines()[: args.sentences]
    return tokenizer, bench.batches_of(tokenizer.src.encode(lines))


def second_pass(decode_batch, batches) -> tuple[float, float]:
    """When the second of two passes of decode_batch(src, steps) over the batches began and ended
    (the first makes the kernels for their shapes). Between the two passes the process prints
    "ready" and waits for a line on stdin (measure)."""
    for first in (True, False):
        if not first:
            print("ready", flush=True)
            sys.stdin.readline()
        start = time.time()
        for src, steps in batches:
            decode_batch(src, steps)
        end = time.time()
    return start, end


def mtrain_pass(args: argparse.Namespace, threads: int, beam: int) -> tuple[float, float]:
    """The timed pass of one process decoding every batch with mtrain (a child process)."""
    from mtrain.cpu import mkl

    mkl.enable()  # before torch, as the CLI does
    import decode as bench
    import torch

    from mtrain.model import Transformer
    from mtrain.cpu.quantize import bfloat16_weights

    torch.set_num_threads(threads)
    _, batches = benchmark_batches(args)
    torch.manual_seed(0)
    model = Transformer(bench.SHAPE).eval()
    model = bench.FixedLength(model if args.float32 else bfloat16_weights(model))
    return second_pass(lambda src, steps: bench.run_mtrain([model], src, steps, beam), batches)


def hf_pass(args: argparse.Namespace, threads: int) -> tuple[float, float]:
    """The timed pass of Hugging Face greedy `generate` over every batch (a child process)."""
    import decode as bench
    import torch
    from transformers import MarianMTModel

    torch.set_num_threads(threads)
    _, batches = benchmark_batches(args)
    torch.manual_seed(0)
    hf = MarianMTModel(bench.marian_config(bench.SHAPE.vocab_size)).eval()
    return second_pass(lambda src, steps: bench.run_hf(hf, src, steps, 1, bench.SHAPE.vocab_size), batches)


def ct2_rates(args: argparse.Namespace) -> dict[str, float]:
    """CTranslate2 int8 sentences/s, greedy and beam 5, intra- against inter-threads."""
    import decode as bench
    import torch
    from transformers import MarianMTModel

    import ctranslate2
    from mtrain.export.runtime import pieces

    tokenizer, batches = benchmark_batches(args)
    names = pieces(tokenizer.src.model)
    torch.manual_seed(0)
    hf = MarianMTModel(bench.marian_config(bench.SHAPE.vocab_size)).eval()
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(bench.save_marian_for_ct2(hf, tokenizer, Path(tmp)))
        data = [([[names[i] for i in row if i != bench.PAD_ID] for row in src.tolist()], steps) for src, steps in batches]
        for beam in (1, 5):
            for intra, inter in ((args.threads, 1), (1, args.threads)):
                translator = ctranslate2.Translator(folder, device="cpu", compute_type="int8", intra_threads=intra,
                                                    inter_threads=inter)
                for _ in range(2):
                    start = time.perf_counter()
                    pending = [translator.translate_batch(rows, beam_size=beam, min_decoding_length=steps,
                                                          max_decoding_length=steps, length_penalty=0.6,
                                                          max_batch_size=0, asynchronous=True)
                               for rows, steps in data]
                    for results in pending:
                        for result in results:
                            result.result()
                    seconds = time.perf_counter() - start
                rates[f"ct2_int8_{'greedy' if beam == 1 else 'beam5'}_intra{intra}_inter{inter}"] = round(
                    sum(src.size(0) for src, _ in batches) / seconds, 1)
                del translator
    return rates


def span(passes: list[str]) -> float:
    """Seconds from the first timed pass's start to the last one's end ("start end" per process):
    processes side by side count as busy from the first start to the last end."""
    times = [tuple(map(float, line.split())) for line in passes]
    return max(end for _, end in times) - min(start for start, _ in times)


def child(argv: list[str]) -> list[str]:
    """The command that reruns this script as one measurement."""
    return [sys.executable, str(Path(__file__).resolve()), *argv]


def measure(argv: list[str], processes: int) -> float:
    """Seconds that `processes` children running this script with argv take for their timed passes,
    started together: each is told to go once all have finished their first pass."""
    children = [subprocess.Popen(child(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 stderr=subprocess.DEVNULL) for _ in range(processes)]
    for process in children:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{' '.join(argv)}: a measuring process ended before its first pass was done")
    for process in children:
        process.stdin.write("go\n")
        process.stdin.flush()
    return span([process.communicate()[0] for process in children])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--float32", action="store_true", help="the float32 model instead of its bfloat16 copy")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=2, type=int, metavar=("THREADS", "BEAM"), help=argparse.SUPPRESS)
    parser.add_argument("--ct2", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf", type=int, metavar="THREADS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child: when its timed pass began and ended
        print(*mtrain_pass(args, *args.one))
        return {}
    if args.hf:
        print(*hf_pass(args, args.hf))
        return {}
    if args.ct2:
        print(json.dumps(ct2_rates(args)))
        return {}
    common = ["--sentences", str(args.sentences), "--threads", str(args.threads)] + (["--float32"] if args.float32 else [])
    from mtrain.hardware import machine_record

    result = {"precision": "float32" if args.float32 else "bfloat16 weights", "threads": args.threads,
              "sentences": args.sentences, "hardware": machine_record()}
    n = args.sentences
    systems = [("mtrain_greedy", ["--one", "{threads}", "1"]), ("mtrain_beam5", ["--one", "{threads}", "5"])]
    if importlib.util.find_spec("transformers"):
        systems.append(("hf_greedy", ["--hf", "{threads}"]))
    for name, extra in systems:
        command = lambda threads: [a.format(threads=threads) for a in extra]  # noqa: E731
        result[f"{name}_1_process_{args.threads}_threads"] = round(n / measure(common + command(args.threads), 1), 1)
        result[f"{name}_1_process_1_thread"] = round(n / measure(common + command(1), 1), 1)
        rate = n * args.threads / measure(common + command(1), args.threads)
        result[f"{name}_{args.threads}_processes_1_thread"] = round(rate, 1)
        result[f"{name}_processes_vs_threads"] = round(rate / result[f"{name}_1_process_{args.threads}_threads"], 3)
    try:
        ct2 = subprocess.run(child(common + ["--ct2"]), check=True, capture_output=True, text=True)
        result.update(json.loads(ct2.stdout))
    except subprocess.CalledProcessError as error:  # no CTranslate2 or transformers here
        print(f"CTranslate2 skipped: {error.stderr.strip().splitlines()[-1]}", file=sys.stderr)
    for key, value in result.items():
        if key != "hardware":
            print(f"{key}: {value}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
