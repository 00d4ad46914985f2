"""The model card (README.md) of a Hugging Face export: what the model is, what it was trained
on, the scores its checkpoint records, and how it was checked against mtrain."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _training_data(meta: dict[str, Any], stats: dict[str, Any]) -> str:
    splits = stats.get("splits", {})
    train = splits.get(stats.get("train_split", "train"), {})
    if not train:
        return "not recorded in the checkpoint"
    return (f"{train.get('lines', '?')} sentence pairs after cleaning ({meta['source_language']}→"
            f"{meta['target_language']}; {train.get('src_tokens', {}).get('total', '?')} source and "
            f"{train.get('tgt_tokens', {}).get('total', '?')} target subword tokens)")


def card_text(meta: dict[str, Any], model, stats: dict[str, Any], valid_bleu: float | None) -> str:
    cfg = model.cfg
    src, tgt = meta["source_language"] or "src", meta["target_language"] or "tgt"
    n_params = sum(p.numel() for p in model.parameters())
    point = meta["checkpoint"]
    averaged = point.get("averaged_from")
    origin = f"the average of {len(averaged)} checkpoints" if averaged else "one checkpoint"
    parity = meta["parity"]
    lines = [
        "---",
        f"language: [{src}, {tgt}]",
        "library_name: transformers",
        "pipeline_tag: translation",
        "tags: [translation, marian, mtrain]",
        "---",
        "",
        f"# {src}→{tgt} translation model trained with mtrain",
        "",
        "## Architecture",
        f"The post-norm Transformer of Vaswani et al. 2017 as a `MarianMTModel`: d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, feed-forward {cfg.d_ff}, {cfg.n_encoder_layers} encoder and "
        f"{cfg.n_decoder_layers} decoder layers, ReLU, sinusoidal positions, "
        f"{'one joint' if meta['joint_vocabulary'] else 'a source and a target'} SentencePiece vocabulary "
        f"({cfg.vocab_size} target pieces), tied output projection; {n_params / 1e6:.2f}M parameters.",
        "",
        "## Training data",
        _training_data(meta, stats),
        "",
        "## Scores",
        f"Exported from {origin} at update {point.get('step')}.",
    ]
    if valid_bleu is not None:
        lines.append(f"Best validation BLEU during training (greedy, sacreBLEU): {valid_bleu:.2f}.")
    lines += [
        f"Parity with the mtrain checkpoint on {parity['sentences']} sentences ({parity['check_set']}): "
        f"reference log-probabilities within {parity['max_logprob_diff']:.2g}, "
        f"{parity['greedy_identical']:.0%} identical greedy translations.",
        "",
        "## Use",
        "With transformers 4.x, `pipeline(\"translation\", model=\"PATH\")` works as well.",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        'tokenizer, model = AutoTokenizer.from_pretrained("PATH"), AutoModelForSeq2SeqLM.from_pretrained("PATH")',
        'output = model.generate(**tokenizer(["..."], return_tensors="pt", padding=True))',
        "print(tokenizer.batch_decode(output, skip_special_tokens=True))",
        "```",
        "Decoding starts from `<s>` (`decoder_start_token_id`); the tokenizer appends `</s>` to the source. "
        "`MarianTokenizer` normalizes punctuation with sacremoses when it is installed, which mtrain does not: "
        "inputs with unusual quotes or dashes may tokenize differently.",
        "",
    ]
    return "\n".join(lines)


def write_card(folder: Path, meta: dict[str, Any], model, stats: dict[str, Any] | None = None,
               valid_bleu: float | None = None) -> None:
    (folder / "README.md").write_text(card_text(meta, model, stats or {}, valid_bleu), encoding="utf-8")
