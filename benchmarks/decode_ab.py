"""Two forms of one decoding path, alternated batch by batch in one process, so that load from
elsewhere on a shared machine hits both alike, with a bfloat16 decoding copy (--float32: the
float32 model):
- `--compare cpu_kernels` (default): mtrain.cpu.native's C kernels (attention over a bfloat16 cache; beam
  search's top-k and log-sum-exp over the bfloat16 logits; linear layers on AMX) against decoding
  without them (float32 cache, PyTorch's attention, upcast logits, oneDNN's linear layers).
- `--compare amx_linear`: the linear layers of decoding steps by mtrain.cpu.native.amx_linear
  against oneDNN's kernel, everything else the same (mtrain.cpu.switches.amx_linear).

    python benchmarks/decode_ab.py --threads 2                 # greedy, the C kernels
    python benchmarks/decode_ab.py --beam 5 --threads 2 --json
    python benchmarks/decode_ab.py --compare amx_linear --threads 2 [--float32]

The model, sentences and batches are benchmarks/decode.py's (random weights at its shape, every
system made to decode the same number of steps). The order of the two alternates from round to
round; a warm-up pass over the first batches comes first. Besides the speed it reports the share
of sentences whose output is the same under both (they differ by float32 rounding in the scores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402  (the same shape, sentences and batches)
from ab import alternate  # noqa: E402

from mtrain.cpu import mkl  # noqa: E402

if __name__ == "__main__":  # before torch runs anything, as the CLI does
    mkl.enable()

import torch  # noqa: E402

import mtrain.cpu.cache as cache_module  # noqa: E402
import mtrain.cpu.quantize as quantize_module  # noqa: E402
import mtrain.search as search_module  # noqa: E402
from mtrain.cpu import native, switches  # noqa: E402
from mtrain.hardware import cpu_has_native_bf16, machine_record  # noqa: E402
from mtrain.model import Transformer  # noqa: E402
from mtrain.cpu.quantize import bfloat16_weights  # noqa: E402
from mtrain.search import beam_search, greedy_search  # noqa: E402


def setter(module, name: str, value):
    return lambda: setattr(module, name, value)


class _Off:
    """mtrain.cpu.native as the modules see it where nothing was built."""

    library = staticmethod(lambda: None)
    wanted = staticmethod(lambda x: False)
    attend = staticmethod(lambda *args: None)
    topk_logsumexp = staticmethod(lambda *args: None)
    amx_takes = staticmethod(lambda x: False)


def _kernels(module):
    return lambda: [setattr(user, "native", module) for user in (cache_module, search_module, quantize_module)]


# Each comparison: {baseline, candidate}, in that order; each variant sets what it changes.
COMPARISONS = {
    "cpu_kernels": {"torch": _kernels(_Off), "c": _kernels(native)},
    "amx_linear": {"onednn": setter(switches, "amx_linear", False), "amx": setter(switches, "amx_linear", True)},
}


def search(model, src: torch.Tensor, steps: int, beam: int) -> list[list[int]]:
    """The output ids of each sentence: greedy, or the best of beam search."""
    model.steps = steps
    max_len = torch.full((src.size(0),), steps - 1)
    if beam == 1:
        return greedy_search(model, src, max_len)
    return [hyps[0][0] for hyps in beam_search(model, src, beam, 0.6, max_len)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="cpu_kernels")
    parser.add_argument("--float32", action="store_true", help="the float32 model instead of its bfloat16 copy")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = bench.corpus_dir()
    tokenizer = bench.load_tokenizer(corpus)
    lines = (corpus / "test2016.de").read_text(encoding="utf-8").splitlines()[: args.sentences]
    batches = bench.batches_of(tokenizer.src.encode(lines))
    torch.manual_seed(0)
    model = Transformer(bench.SHAPE).eval()
    model = bench.FixedLength(model if args.float32 else bfloat16_weights(model))
    variants = COMPARISONS[args.compare]
    baseline, candidate = variants
    seconds, ratios, outputs = alternate(variants, batches, args.rounds, lambda batch: search(model, *batch, args.beam),
                                         warmup=3)
    seconds = {name: sum(runs) for name, runs in seconds.items()}
    outputs = {name: [ids for batch in runs for ids in batch] for name, runs in outputs.items()}
    n = len(lines) * args.rounds
    same = sum(a == b for a, b in zip(outputs[baseline], outputs[candidate])) / len(lines)
    result = {
        "compare": args.compare, "search": "greedy" if args.beam == 1 else f"beam {args.beam}",
        "precision": "float32" if args.float32 else "bfloat16 weights", "native_bf16": cpu_has_native_bf16(),
        "threads": torch.get_num_threads(), "rounds": args.rounds,
        "sent_s": {name: round(n / s, 1) for name, s in seconds.items()},
        f"{candidate}_speedup_total": round(seconds[baseline] / seconds[candidate], 3),
        f"{candidate}_speedup_median": round(statistics.median(ratios), 3),
        "same_outputs": round(same, 4), "torch": torch.__version__, "hardware": machine_record(),
    }
    print(f"{result['search']}, {result['precision']}, {result['threads']} threads: sentences/s {baseline} "
          f"{result['sent_s'][baseline]}, {candidate} {result['sent_s'][candidate]}; {candidate} / {baseline} "
          f"{result[f'{candidate}_speedup_total']}x in total, median per batch {result[f'{candidate}_speedup_median']}x; "
          f"same output for {same:.1%} of sentences", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
