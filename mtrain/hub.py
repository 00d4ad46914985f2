"""Hugging Face `MarianMTModel` folders as mtrain checkpoints: `mtrain import --format huggingface`.

The ~1,500 public OPUS-MT models (Helsinki-NLP/opus-mt-*) are Marian models in this form, and so is
what `mtrain export --format huggingface` writes. Marian is mtrain's post-norm Transformer; the
import undoes the differences of form (the inverse of mtrain.export.huggingface):
  * q, k and v projections are fused into mtrain's; the d_model coordinates go back from Marian's
    sinusoid order (all sines, then all cosines) to mtrain's interleaved one;
  * ids: mtrain's are <pad> 0, <unk> 1, <s> 2, </s> 3. OPUS-MT models have </s> 0, <unk> 1, <pad>
    last, no <s>, and start decoding from <pad>: the embedding rows (and the output bias) are put in
    mtrain's order, and <s> becomes a row of its own holding the start token's embedding;
  * OPUS-MT's two SentencePiece models (source.spm, target.spm) share one vocabulary (vocab.json):
    the checkpoint keeps both models and that list (mtrain.tokenizer.MappedSide). A folder whose
    vocabulary is its SentencePiece model's own pieces (mtrain's exports) keeps mtrain's plain form,
    so import after export gives back the checkpoint's weights and tokenizer exactly;
  * `activation_function` swish and a non-zero `final_logits_bias` become model.activation=swish and
    model.output_bias=true.
What does not fit a post-norm model with one FFN width and head count is refused in one line naming
the setting: `normalize_before` (pre-norm), `scale_embedding: false`, untied output embeddings,
encoder and decoder of different widths, other activations, learned position embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtrain.config import Config, DataConfig, DecodeConfig, ModelConfig, to_dict
from mtrain.errors import MtrainError
from mtrain.export.huggingface import interleave_order
from mtrain.export.runtime import pieces
from mtrain.model import Transformer
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_PIECES, UNK_ID, Tokenizer

ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def local_folder(model: str) -> Path:
    """A folder on disk, or a model on the Hugging Face hub (e.g. Helsinki-NLP/opus-mt-de-en),
    downloaded into the hub's cache first."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise MtrainError(f"--model {model}: a file; pass the folder of a MarianMTModel (config.json, weights, "
                          "source.spm, target.spm, vocab.json) or a hub name such as Helsinki-NLP/opus-mt-de-en")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model, allow_patterns=[
            "*.json", "*.spm", "model.safetensors", "pytorch_model.bin"]))
    except Exception as err:  # offline, a missing repository, no huggingface_hub
        raise MtrainError(f"--model {model}: not a folder, and the Hugging Face hub did not give it "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:160]}); download it and pass its folder") from None


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise MtrainError(f"{path}: missing; a MarianMTModel folder has config.json, its weights, source.spm, "
                          "target.spm and vocab.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MtrainError(f"{path}: not JSON ({err})") from None


def check_config(config: dict[str, Any], path: Path) -> None:
    """One line naming the first setting a post-norm mtrain model cannot take."""
    def refuse(setting: str, why: str) -> MtrainError:
        return MtrainError(f"{path}: {setting}: {why}; mtrain imports post-norm Marian models only")

    if config.get("model_type") != "marian":
        raise refuse(f"model_type={config.get('model_type')!r}", "not a Marian model")
    if config.get("normalize_before"):
        raise refuse("normalize_before=true", "a pre-norm model (LayerNorm before each sublayer)")
    if config.get("scale_embedding") is False:
        raise refuse("scale_embedding=false", "mtrain multiplies embeddings by sqrt(d_model)")
    if config.get("activation_function", "swish") not in ACTIVATIONS:
        raise refuse(f"activation_function={config['activation_function']!r}", "only relu and swish are supported")
    for a, b in (("encoder_ffn_dim", "decoder_ffn_dim"), ("encoder_attention_heads", "decoder_attention_heads")):
        if config.get(a) != config.get(b):
            raise refuse(f"{a}={config.get(a)} and {b}={config.get(b)}", "mtrain has one of each for both stacks")
    if config.get("tie_word_embeddings") is False:
        raise refuse("tie_word_embeddings=false", "mtrain's output layer is the target embedding")
    if config.get("static_position_embeddings") is False or config.get("layernorm_embedding"):
        raise refuse("learned position embeddings or layernorm_embedding", "mtrain adds fixed sinusoids only")


@dataclasses.dataclass
class Vocabulary:
    """How the folder's ids map to mtrain's: `order[i]` is the folder's id of mtrain's id i."""

    order: list[int]
    tokenizer: Tokenizer


def special_ids(config: dict[str, Any], vocab: dict[str, int]) -> tuple[int, int, int, int]:
    """The folder's ids of (pad, unk, decoding start, eos)."""
    pad, eos = config.get("pad_token_id"), config.get("eos_token_id")
    start = config.get("decoder_start_token_id", pad)
    if "<unk>" not in vocab or pad is None or eos is None:
        raise MtrainError("vocab.json and config.json must name <unk>, pad_token_id and eos_token_id")
    return int(pad), int(vocab["<unk>"]), int(start if start is not None else pad), int(eos)


def vocabulary(folder: Path, config: dict[str, Any], side: str) -> tuple[dict[str, int], bytes]:
    """(piece -> id, the SentencePiece model) of one side."""
    spm_file = folder / ("source.spm" if side == "src" else "target.spm")
    if not spm_file.is_file():
        raise MtrainError(f"{spm_file}: missing; a MarianMTModel folder has source.spm and target.spm")
    name = "target_vocab.json" if side == "tgt" and (folder / "target_vocab.json").is_file() else "vocab.json"
    return read_json(folder / name), spm_file.read_bytes()


def read_vocabulary(folder: Path, config: dict[str, Any]) -> Vocabulary:
    """mtrain's ids for the folder's: its own (plain) where the folder's are mtrain's, else mapped."""
    (src_vocab, src_model), (tgt_vocab, tgt_model) = vocabulary(folder, config, "src"), vocabulary(folder, config, "tgt")
    separate = (folder / "target_vocab.json").is_file()
    pad, unk, start, eos = special_ids(config, tgt_vocab)
    mtrain_ids = (pad, unk, start, eos) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    own = [{piece: i for i, piece in enumerate(_safe_pieces(model))} for model in (src_model, tgt_model)]
    if mtrain_ids and src_vocab == own[0] and tgt_vocab == own[1]:  # mtrain's own export: plain, as it was
        joint = not separate and src_model == tgt_model
        return Vocabulary(list(range(len(own[1]))), Tokenizer(src_model, None if joint else tgt_model))
    if separate:
        raise MtrainError(f"{folder / 'target_vocab.json'}: separate source and target vocabularies; mtrain imports "
                          "Marian models with one vocabulary shared by both sides (as OPUS-MT models have)")
    by_id = {i: piece for piece, i in src_vocab.items()}
    size = max(by_id) + 1
    if sorted(by_id) != list(range(size)):
        raise MtrainError(f"{folder / 'vocab.json'}: ids are not 0..{size - 1}")
    rest = [i for i in range(size) if i not in (pad, unk, start, eos)]
    order = [pad, unk, start, eos, *rest]
    names = [*SPECIAL_PIECES, *(by_id[i] for i in rest)]
    return Vocabulary(order, Tokenizer(src_model, tgt_model, names))


def _safe_pieces(model: bytes) -> list[str]:
    try:
        return pieces(model)
    except Exception as err:
        raise MtrainError(f"source.spm: not a SentencePiece model ({str(err).splitlines()[0][:120]})") from None


def read_weights(folder: Path) -> dict[str, Tensor]:
    safetensors, pickle = folder / WEIGHT_FILES[0], folder / WEIGHT_FILES[1]
    if safetensors.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors))
    if pickle.is_file():
        return torch.load(pickle, map_location="cpu", weights_only=True)
    raise MtrainError(f"{folder}: no model.safetensors or pytorch_model.bin")


class Coordinates:
    """Marian's d_model order back to mtrain's (the inverse of mtrain.export.huggingface.Reorder)."""

    def __init__(self, d_model: int) -> None:
        self.back = torch.argsort(interleave_order(d_model))

    def vector(self, v: Tensor) -> Tensor:
        return v[self.back]

    def into(self, w: Tensor) -> Tensor:  # reads the residual stream: (out, d_model)
        return w[:, self.back]

    def out_of(self, w: Tensor) -> Tensor:  # writes the residual stream: (d_model, in)
        return w[self.back, :]


def model_config(config: dict[str, Any], vocab_size: int, output_bias: bool) -> ModelConfig:
    return ModelConfig(
        d_model=config["d_model"], d_ff=config["encoder_ffn_dim"], n_heads=config["encoder_attention_heads"],
        n_encoder_layers=config["encoder_layers"], n_decoder_layers=config["decoder_layers"],
        dropout=float(config.get("dropout", 0.1)), attention_dropout=float(config.get("attention_dropout", 0.0)),
        activation_dropout=float(config.get("activation_dropout", 0.0)), vocab_size=vocab_size,
        max_len=int(config.get("max_position_embeddings", 512)),
        activation=ACTIVATIONS[config.get("activation_function", "swish")], output_bias=output_bias)


def mtrain_state(hf: dict[str, Tensor], cfg: ModelConfig, order: list[int]) -> dict[str, Tensor]:
    """mtrain's state dict for a Marian state dict (see the module docstring)."""
    c, rows = Coordinates(cfg.d_model), torch.tensor(order)
    g = lambda name: hf[name].float()  # noqa: E731
    target = hf.get("model.decoder.embed_tokens.weight", hf.get("model.shared.weight"))
    state = {"tgt_embed.weight": c.into(target.float()[rows])}
    state["proj.weight"] = state["tgt_embed.weight"]
    if cfg.share_embeddings:
        state["src_embed.weight"] = state["tgt_embed.weight"]
    else:  # mtrain's own export of separate vocabularies: its ids are mtrain's (order is the identity)
        state["src_embed.weight"] = c.into(g("model.encoder.embed_tokens.weight"))

    def attention(ours: str, theirs: str, fused: list[tuple[str, list[str]]]) -> None:
        for name, parts in fused:
            state[f"{ours}.{name}.weight"] = torch.cat([c.into(g(f"{theirs}.{p}.weight")) for p in parts])
            state[f"{ours}.{name}.bias"] = torch.cat([g(f"{theirs}.{p}.bias") for p in parts])
        state[f"{ours}.out.weight"] = c.out_of(g(f"{theirs}.out_proj.weight"))
        state[f"{ours}.out.bias"] = c.vector(g(f"{theirs}.out_proj.bias"))

    def norm(ours: str, theirs: str) -> None:
        state[f"{ours}.weight"], state[f"{ours}.bias"] = c.vector(g(f"{theirs}.weight")), c.vector(g(f"{theirs}.bias"))

    def ffn(ours: str, theirs: str) -> None:
        state[f"{ours}.0.weight"], state[f"{ours}.0.bias"] = c.into(g(f"{theirs}.fc1.weight")), g(f"{theirs}.fc1.bias")
        state[f"{ours}.3.weight"], state[f"{ours}.3.bias"] = c.out_of(g(f"{theirs}.fc2.weight")), c.vector(g(f"{theirs}.fc2.bias"))

    qkv = [("qkv", ["q_proj", "k_proj", "v_proj"])]
    for i in range(cfg.n_encoder_layers):
        ours, theirs = f"encoder.{i}", f"model.encoder.layers.{i}"
        attention(f"{ours}.self_attn", f"{theirs}.self_attn", qkv)
        norm(f"{ours}.norm1", f"{theirs}.self_attn_layer_norm")
        ffn(f"{ours}.ffn", theirs)
        norm(f"{ours}.norm2", f"{theirs}.final_layer_norm")
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder.{i}", f"model.decoder.layers.{i}"
        attention(f"{ours}.self_attn", f"{theirs}.self_attn", qkv)
        norm(f"{ours}.norm1", f"{theirs}.self_attn_layer_norm")
        attention(f"{ours}.cross_attn", f"{theirs}.encoder_attn", [("q", ["q_proj"]), ("kv", ["k_proj", "v_proj"])])
        norm(f"{ours}.norm2", f"{theirs}.encoder_attn_layer_norm")
        ffn(f"{ours}.ffn", theirs)
        norm(f"{ours}.norm3", f"{theirs}.final_layer_norm")
    if cfg.output_bias:
        state["proj.bias"] = hf["final_logits_bias"].float().reshape(-1)[rows]
    return state


def shares_embeddings(hf: dict[str, Tensor], path: Path) -> bool:
    """Whether the encoder's embedding is the decoder's; the decoder's must be the output layer's."""
    decoder = hf.get("model.decoder.embed_tokens.weight", hf.get("model.shared.weight"))
    encoder = hf.get("model.encoder.embed_tokens.weight", hf.get("model.shared.weight"))
    if decoder is None or encoder is None:
        raise MtrainError(f"{path}: no embedding matrix (model.shared.weight) among the weights")
    if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], decoder):
        raise MtrainError(f"{path}: the output layer differs from the decoder's embedding; mtrain imports models "
                          "whose output layer is tied to it (tie_word_embeddings)")
    return encoder.shape == decoder.shape and torch.equal(encoder, decoder)


def settings(folder: Path, config: dict[str, Any], cfg: ModelConfig) -> tuple[Config, dict[str, Any]]:
    """(the checkpoint's config, its stats). A folder mtrain exported says in export.json what its
    checkpoint had (max_len, decoding settings, the length ratio stats, languages); another folder's
    languages come from tokenizer_config.json and its beam from generation_config.json."""
    exported = read_json(folder / "export.json") if (folder / "export.json").is_file() else {}
    if exported.get("format") == "huggingface":
        dropout_like = cfg.activation_dropout == cfg.dropout  # mtrain writes -1 ("as dropout") as that rate
        cfg = dataclasses.replace(cfg, max_len=int(exported.get("max_len", cfg.max_len)),
                                  activation_dropout=-1.0 if dropout_like else cfg.activation_dropout)
        decode = DecodeConfig(**{k: v for k, v in (exported.get("decode") or {}).items()
                                 if k in DecodeConfig.__dataclass_fields__})
        data = DataConfig(src=exported.get("source_language") or "src", tgt=exported.get("target_language") or "tgt")
        return Config(model=cfg, data=data, decode=decode), exported.get("stats") or {}
    languages = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    generation = read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    data = DataConfig(src=languages.get("source_lang") or "src", tgt=languages.get("target_lang") or "tgt")
    beam = int(generation.get("num_beams") or config.get("num_beams") or 5)
    return Config(model=cfg, data=data, decode=DecodeConfig(beam=beam)), {}


def import_marian(model: str, out: Path) -> dict[str, Any]:
    """Read a MarianMTModel folder (or hub name), write an mtrain checkpoint to `out`; returns a
    summary: the settings it took and the vocabulary mapping."""
    from mtrain.checkpoint import make, save_atomic

    folder = local_folder(model)
    config = read_json(folder / "config.json")
    check_config(config, folder / "config.json")
    vocab = read_vocabulary(folder, config)
    hf = read_weights(folder)
    shared = shares_embeddings(hf, folder)
    if not shared and vocab.tokenizer.joint:
        raise MtrainError(f"{folder}: one vocabulary but two embedding matrices; mtrain imports Marian models "
                          "that share one (share_encoder_decoder_embeddings)")
    bias = hf.get("final_logits_bias")
    output_bias = bias is not None and bool(bias.abs().max() > 0)
    cfg = model_config(config, len(vocab.order), output_bias)
    if not shared:
        cfg = dataclasses.replace(cfg, share_embeddings=False, src_vocab_size=vocab.tokenizer.src.vocab_size)
    if cfg.d_model % cfg.n_heads:
        raise MtrainError(f"{folder / 'config.json'}: d_model={cfg.d_model} is not a multiple of its "
                          f"{cfg.n_heads} attention heads")
    state = mtrain_state(hf, cfg, vocab.order)
    transformer = Transformer(cfg)
    missing, unexpected = transformer.load_state_dict(state, strict=False)
    if missing or unexpected:  # an importer bug, not a user error
        raise RuntimeError(f"import state mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    full, stats = settings(folder, config, cfg)
    save_atomic(make(to_dict(full), transformer.state_dict(), vocab.tokenizer.to_state(), stats, 0), out)
    return {"model": str(model), "out": str(out), "parameters": sum(p.numel() for p in transformer.parameters()),
            "vocabulary": "mtrain's own" if not vocab.tokenizer.mapped else f"mapped ({len(vocab.order)} ids)",
            "activation": cfg.activation, "output_bias": cfg.output_bias, "max_len": cfg.max_len,
            "layers": [cfg.n_encoder_layers, cfg.n_decoder_layers], "d_model": cfg.d_model,
            "scale": math.sqrt(cfg.d_model)}
