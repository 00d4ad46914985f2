"""An mtrain model as a Hugging Face `MarianMTModel` with its `MarianTokenizer`.

Marian in transformers is the same post-norm encoder-decoder, with these differences in form:
  * separate q/k/v projections, each with a bias: mtrain's fused projections are split;
  * its sinusoidal table is not saved with the model and puts all sines before all cosines, where
    mtrain interleaves them (paper 3.5). Rather than change the table, the export reorders the
    model's d_model coordinates (even ones first, then odd ones) everywhere they appear: embeddings,
    every projection into or out of the residual stream, every LayerNorm. LayerNorm and dot products
    do not care about the order of coordinates, so this is the same function, exactly, and
    Marian's own table then adds the right sinusoid to the right coordinate;
  * decoding starts from `decoder_start_token_id` (mtrain's `<s>`, id 2); the tokenizer appends
    `</s>` to the source itself; `<pad>` and `<s>` are banned from the output (`bad_words_ids`);
  * `final_logits_bias` is zero: mtrain's output layer has no bias (unless model.output_bias).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtrain.export.runtime import Shape
from mtrain.model import Transformer
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, UNK_ID


def interleave_order(d_model: int) -> Tensor:
    """Marian coordinate j holds mtrain coordinate order[j]: sines (even) first, then cosines (odd)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


class Reorder:
    """Weights of one mtrain model with the d_model coordinates put in Marian's order."""

    def __init__(self, d_model: int) -> None:
        self.order = interleave_order(d_model)

    def vector(self, v: Tensor) -> Tensor:
        return v[self.order].clone()

    def embedding(self, w: Tensor) -> Tensor:  # (vocab, d_model)
        return w[:, self.order].clone()

    def into(self, w: Tensor) -> Tensor:  # a projection reading the residual stream: (out, d_model)
        return w[:, self.order].clone()

    def out_of(self, w: Tensor) -> Tensor:  # a projection writing the residual stream: (d_model, in)
        return w[self.order, :].clone()


def _norm(state: dict, name: str, module, r: Reorder) -> None:
    state[f"{name}.weight"] = r.vector(module.weight)
    state[f"{name}.bias"] = r.vector(module.bias)


def _attention(state: dict, name: str, weights: list[tuple[str, Tensor, Tensor]], out, r: Reorder) -> None:
    for proj, w, b in weights:
        state[f"{name}.{proj}.weight"] = r.into(w)
        state[f"{name}.{proj}.bias"] = b.clone()
    state[f"{name}.out_proj.weight"] = r.out_of(out.weight)
    state[f"{name}.out_proj.bias"] = r.vector(out.bias)


def _ffn(state: dict, name: str, ffn, r: Reorder) -> None:
    state[f"{name}.fc1.weight"] = r.into(ffn[0].weight)
    state[f"{name}.fc1.bias"] = ffn[0].bias.clone()
    state[f"{name}.fc2.weight"] = r.out_of(ffn[3].weight)
    state[f"{name}.fc2.bias"] = r.vector(ffn[3].bias)


def _split(linear, parts: int, names: str) -> list[tuple[str, Tensor, Tensor]]:
    return list(zip(names.split(), linear.weight.chunk(parts), linear.bias.chunk(parts)))


def marian_state(model: Transformer) -> dict[str, Tensor]:
    """The state dict of a MarianMTModel that computes what `model` computes."""
    r = Reorder(model.cfg.d_model)
    state: dict[str, Tensor] = {}
    with torch.no_grad():
        state["model.encoder.embed_tokens.weight"] = r.embedding(model.src_embed.weight)
        state["model.decoder.embed_tokens.weight"] = r.embedding(model.tgt_embed.weight)
        if model.src_embed is model.tgt_embed:
            state["model.shared.weight"] = state["model.decoder.embed_tokens.weight"]
        for i, layer in enumerate(model.encoder):
            name = f"model.encoder.layers.{i}"
            _attention(state, f"{name}.self_attn", _split(layer.self_attn.qkv, 3, "q_proj k_proj v_proj"),
                       layer.self_attn.out, r)
            _norm(state, f"{name}.self_attn_layer_norm", layer.norm1, r)
            _ffn(state, name, layer.ffn, r)
            _norm(state, f"{name}.final_layer_norm", layer.norm2, r)
        for i, layer in enumerate(model.decoder):
            name = f"model.decoder.layers.{i}"
            _attention(state, f"{name}.self_attn", _split(layer.self_attn.qkv, 3, "q_proj k_proj v_proj"),
                       layer.self_attn.out, r)
            _norm(state, f"{name}.self_attn_layer_norm", layer.norm1, r)
            cross = [("q_proj", layer.cross_attn.q.weight, layer.cross_attn.q.bias)]
            cross += _split(layer.cross_attn.kv, 2, "k_proj v_proj")
            _attention(state, f"{name}.encoder_attn", cross, layer.cross_attn.out, r)
            _norm(state, f"{name}.encoder_attn_layer_norm", layer.norm2, r)
            _ffn(state, name, layer.ffn, r)
            _norm(state, f"{name}.final_layer_norm", layer.norm3, r)
        state["lm_head.weight"] = state["model.decoder.embed_tokens.weight"]  # tied, as in mtrain
        bias = model.proj.bias  # model.output_bias (imported Marian models); else none, as the paper
        state["final_logits_bias"] = torch.zeros(1, model.cfg.vocab_size) if bias is None else bias.detach().reshape(1, -1)
    return {k: v.float().contiguous() for k, v in state.items()}


def marian_config(model: Transformer, max_positions: int):
    from transformers import MarianConfig

    cfg = model.cfg
    joint = model.src_embed is model.tgt_embed
    return MarianConfig(
        vocab_size=cfg.src_vocab_size or cfg.vocab_size,
        decoder_vocab_size=cfg.vocab_size,
        share_encoder_decoder_embeddings=joint,
        tie_word_embeddings=True,
        d_model=cfg.d_model,
        encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=cfg.activation,
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.dropout if cfg.activation_dropout < 0 else cfg.activation_dropout,
        max_position_embeddings=max_positions,
        scale_embedding=True,  # times sqrt(d_model), as mtrain's embed
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,
        is_encoder_decoder=True,
        architectures=["MarianMTModel"],
    )


def generation_config(beam: int, max_positions: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=BOS_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        forced_eos_token_id=EOS_ID, num_beams=beam, max_length=max_positions,
        bad_words_ids=[[PAD_ID], [BOS_ID]],  # mtrain's search never emits these either
    )


def _vocab(side) -> dict[str, int]:
    return {piece: i for i, piece in enumerate(side.id_pieces())}


def write_tokenizer(tokenizer: Tokenizer, folder: Path, src: str | None, tgt: str | None, max_len: int) -> None:
    """MarianTokenizer's files: source.spm, target.spm, vocab.json (pieces -> mtrain's ids), and
    target_vocab.json with separate vocabularies."""
    (folder / "source.spm").write_bytes(tokenizer.src.model)
    (folder / "target.spm").write_bytes(tokenizer.tgt.model)
    (folder / "vocab.json").write_text(json.dumps(_vocab(tokenizer.src), ensure_ascii=False), encoding="utf-8")
    separate = not tokenizer.joint
    if separate:
        (folder / "target_vocab.json").write_text(json.dumps(_vocab(tokenizer.tgt), ensure_ascii=False),
                                                  encoding="utf-8")
    config = {
        "tokenizer_class": "MarianTokenizer", "source_lang": src, "target_lang": tgt, "separate_vocabs": separate,
        "unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": max_len,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    special = {"unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1), encoding="utf-8")


def write(model: Transformer, tokenizer: Tokenizer, folder: Path, ckpt: dict[str, Any], max_positions: int,
          beam: int) -> dict[str, Any]:
    """Save the MarianMTModel (safetensors), its generation config and tokenizer into `folder`."""
    from transformers import MarianMTModel

    quiet()
    hf = MarianMTModel(marian_config(model, max_positions))
    missing, unexpected = hf.load_state_dict(marian_state(model), strict=False)
    missing = [k for k in missing if "embed_positions" not in k]
    if missing or unexpected:  # an exporter bug, not a user error: say what did not line up
        raise RuntimeError(f"Marian state mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.generation_config = generation_config(beam, max_positions)
    hf.eval().save_pretrained(folder)
    data = ckpt["config"].get("data", {})
    write_tokenizer(tokenizer, folder, data.get("src"), data.get("tgt"), model.cfg.max_len)
    return {"suppress_tokens": ["<pad>", "<s>"]}


def quiet() -> None:
    """No per-shard progress bars or generate() notes on stderr: export prints its own report."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


class MarianModel:
    """An exported folder loaded in transformers, searched greedily by `generate` (for the parity
    report: the same length limit and banned tokens as mtrain's greedy search)."""

    def __init__(self, folder: Path, max_len: int) -> None:
        from transformers import MarianMTModel

        quiet()
        self.model = MarianMTModel.from_pretrained(folder).eval()
        self.cfg = Shape(max_len=max_len)

    @torch.inference_mode()
    def search(self, src: Tensor, max_len: Tensor, decode, prefixes) -> list[list[tuple[list[int], float]]]:
        out = self.model.generate(input_ids=src, attention_mask=src != PAD_ID, num_beams=1, do_sample=False,
                                  max_new_tokens=int(max_len.max()) + 1, min_new_tokens=0)
        hyps = []
        for row, limit in zip(out[:, 1:].tolist(), max_len.tolist()):  # out[:, 0] is the start token
            ids = row[: row.index(EOS_ID)] if EOS_ID in row else row
            hyps.append([([i for i in ids if i != PAD_ID][: int(limit)], 0.0)])
        return hyps

    @torch.inference_mode()
    def score_ids(self, src_ids, tgt_ids, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> list[list[float]]:
        logits = self.model(input_ids=src, attention_mask=src != PAD_ID, decoder_input_ids=tgt_in).logits.float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)
        return [logp[k, : len(ids) + 1].tolist() for k, ids in enumerate(tgt_ids)]
