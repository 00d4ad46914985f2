"""The parity report: does the exported model translate like the mtrain checkpoint it came from?

On a check set (sources, and references when there are any), it measures
  * the largest difference in per-token log-probability of the references under teacher forcing
    (mtrain's forward against CTranslate2's `score_batch` or the Marian model's forward); without
    references, mtrain's own greedy translations are the targets;
  * the share of sentences whose greedy translation is the same text;
  * the BLEU of both sets of greedy translations (against the references, or against mtrain's own
    output when there are none), and their difference.
A float32 export must match closely; a quantized one must not lose more than a stated BLEU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mtrain.config import DecodeConfig
from mtrain.data import collate
from mtrain.export.runtime import SATURATION_NOTE, int8_saturates, is_int8
from mtrain.model import Transformer
from mtrain.score import encode_pairs, pairs_split
from mtrain.tokenizer import Tokenizer
from mtrain.translate import decode_batches, translate_lines

# A float32 export computes the same function with other kernels: differences are rounding
# (about 1e-6 per token measured on the recipe model), so 1e-3 catches any real mismatch.
FLOAT_LOGPROB_TOL = 1e-3
# Near-ties between the two best tokens may flip a few greedy outputs even at float32.
FLOAT_IDENTICAL_MIN = 0.95
# A quantized export may change outputs; it may not cost more than this much BLEU against references.
QUANTIZED_BLEU_DROP = 1.0
# Nor move a reference token's log-probability by a whole nat: int8 moved them by at most 0.39 on
# the Multi30k recipe model, while a wrongly converted model is off by several nats.
QUANTIZED_LOGPROB_TOL = 1.0
BATCH_TOKENS = 2048


@dataclass
class CheckSet:
    sources: list[str]
    references: list[str] | None
    origin: str  # for the report: "FILE", "DIR valid split", "built-in"


def greedy(model: Any, tokenizer: Tokenizer, sources: list[str], stats: dict | None) -> list[str]:
    """Greedy translations with the checkpoint's length rule, by mtrain or by an export's engine."""
    return translate_lines(model, tokenizer, sources, DecodeConfig(beam=1, max_tokens=BATCH_TOKENS), "cpu", stats)


@torch.inference_mode()
def mtrain_logprobs(model: Transformer, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
    logits = model.decode(tgt_in, model.encode(src), src).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)


def max_logprob_diff(model: Transformer, exported: Any, tokenizer: Tokenizer, sources: list[str],
                     targets: list[str]) -> tuple[float, int]:
    """(largest |difference| of a target token's log-probability, tokens compared)."""
    src_ids, tgt_ids, _ = encode_pairs(tokenizer, sources, targets, model.cfg.max_len)
    split = pairs_split(src_ids, tgt_ids)
    worst, count = 0.0, 0
    for rows in decode_batches([max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)], BATCH_TOKENS):
        src, tgt_in, tgt_out = collate(split, rows)
        mine = mtrain_logprobs(model, src, tgt_in, tgt_out)
        theirs = exported.score_ids([src_ids[i] for i in rows], [tgt_ids[i] for i in rows], src, tgt_in, tgt_out)
        for k, i in enumerate(rows):
            n = len(tgt_ids[i]) + 1  # the tokens and EOS
            other = torch.as_tensor(theirs[k], dtype=torch.float32)
            if other.numel() != n:
                return float("inf"), count
            worst = max(worst, float((mine[k, :n] - other).abs().max()))
            count += n
    return worst, count


def report(model: Transformer, tokenizer: Tokenizer, exported: Any, check: CheckSet, stats: dict | None,
           quantization: str | None) -> dict[str, Any]:
    """The report as one dict, with "passed" and, when it did not pass, "failure"."""
    import sacrebleu

    mine = greedy(model, tokenizer, check.sources, stats)
    theirs = greedy(exported, tokenizer, check.sources, stats)
    targets = check.references if check.references is not None else mine
    diff, tokens = max_logprob_diff(model, exported, tokenizer, check.sources, targets)
    identical = sum(a == b for a, b in zip(mine, theirs)) / max(len(mine), 1)
    refs = check.references if check.references is not None else mine
    bleu_mtrain = sacrebleu.corpus_bleu(mine, [refs]).score
    bleu_export = sacrebleu.corpus_bleu(theirs, [refs]).score
    result = {
        "check_set": check.origin, "sentences": len(check.sources), "tokens_scored": tokens,
        "references": "given" if check.references is not None else "mtrain's greedy output",
        "quantization": quantization or "float32",
        "max_logprob_diff": diff, "greedy_identical": identical,
        "bleu_mtrain": round(bleu_mtrain, 2), "bleu_export": round(bleu_export, 2),
        "bleu_diff": round(bleu_export - bleu_mtrain, 2),
    }
    if is_int8(quantization) and int8_saturates():  # the numbers above are this CPU's int8 kernels'
        result["note"] = SATURATION_NOTE
    failure = judge(result, quantization)
    result["passed"] = failure is None
    if failure:
        result["failure"] = failure
    return result


def judge(result: dict[str, Any], quantization: str | None) -> str | None:
    """Why the export fails its parity check, or None."""
    if quantization in (None, "float32"):
        if not result["max_logprob_diff"] <= FLOAT_LOGPROB_TOL:
            return (f"reference log-probabilities differ by up to {result['max_logprob_diff']:.3g} "
                    f"(tolerance {FLOAT_LOGPROB_TOL:g})")
        if result["greedy_identical"] < FLOAT_IDENTICAL_MIN:
            return (f"only {result['greedy_identical']:.1%} of greedy translations are identical "
                    f"(at least {FLOAT_IDENTICAL_MIN:.0%} expected)")
        return None
    if not result["max_logprob_diff"] <= QUANTIZED_LOGPROB_TOL:
        return (f"{quantization} moves reference log-probabilities by up to {result['max_logprob_diff']:.3g} "
                f"(tolerance {QUANTIZED_LOGPROB_TOL:g})")
    # Without references, BLEU against mtrain's own output measures agreement, not quality: not judged.
    if result["references"] == "given" and result["bleu_diff"] < -QUANTIZED_BLEU_DROP:
        return (f"{quantization} loses {-result['bleu_diff']:.2f} BLEU on the check set "
                f"(at most {QUANTIZED_BLEU_DROP:g} allowed)")
    return None


def format_report(result: dict[str, Any]) -> str:
    """The report as a few human-readable lines."""
    lines = [
        f"parity check on {result['sentences']} sentences ({result['check_set']}; references: {result['references']})",
        f"  largest reference log-prob difference: {result['max_logprob_diff']:.3g} over {result['tokens_scored']} tokens",
        f"  identical greedy translations: {result['greedy_identical']:.1%}",
        f"  greedy BLEU: mtrain {result['bleu_mtrain']:.2f}, export ({result['quantization']}) "
        f"{result['bleu_export']:.2f}, difference {result['bleu_diff']:+.2f}",
        f"  {'passed' if result['passed'] else 'FAILED: ' + result['failure']}",
    ]
    if "note" in result:
        lines.insert(-1, f"  note: {result['note']}")
    return "\n".join(lines)

