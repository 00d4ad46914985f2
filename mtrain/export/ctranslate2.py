"""An mtrain model as a CTranslate2 model, built through CTranslate2's own spec API.

The layouts line up one to one: CTranslate2's self-attention holds one fused Q/K/V projection and
its cross-attention a query projection and one fused K/V projection, exactly as mtrain's do. What
needs care:
  * post-norm: `pre_norm=False`, and no final LayerNorm on either stack;
  * positions: CTranslate2's built-in sinusoids put all sines before all cosines, mtrain interleaves
    them (paper 3.5), so mtrain's own table is written into the model, long enough for the longest
    input and output (`max_positions`);
  * special tokens: the source gets `</s>` appended (`add_source_eos`), decoding starts from `<s>`;
  * `<pad>` and `<s>` must never be generated: CTranslate2 has no model-level switch for that, so
    export.json lists them (`suppress_tokens`) and every caller passes them as `suppress_sequences`
    (mtrain's runtime does). A bias on the output layer would bake the ban in, but it would also
    renormalize every score, so teacher-forced log-probabilities would no longer match mtrain's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from mtrain.model import Transformer, sinusoids
from mtrain.tokenizer import Tokenizer

SUPPRESS_TOKENS = ["<pad>", "<s>"]  # mtrain's search never emits these (search.restrict_)


def numpy(t: Tensor) -> np.ndarray:
    """A float32 copy: quantization rewrites the spec's arrays in place, and a float32 CPU tensor's
    .numpy() would share memory with the live model."""
    return t.detach().float().cpu().numpy().copy()


def _linear(spec, module) -> None:
    spec.weight = numpy(module.weight)
    if module.bias is not None:
        spec.bias = numpy(module.bias)


def _norm(spec, module) -> None:
    spec.gamma = numpy(module.weight)
    spec.beta = numpy(module.bias)


def _encoder_layer(spec, layer) -> None:
    _linear(spec.self_attention.linear[0], layer.self_attn.qkv)
    _linear(spec.self_attention.linear[1], layer.self_attn.out)
    _norm(spec.self_attention.layer_norm, layer.norm1)  # post-norm: applied after the residual sum
    _linear(spec.ffn.linear_0, layer.ffn[0])
    _linear(spec.ffn.linear_1, layer.ffn[3])
    _norm(spec.ffn.layer_norm, layer.norm2)


def _decoder_layer(spec, layer) -> None:
    _linear(spec.self_attention.linear[0], layer.self_attn.qkv)
    _linear(spec.self_attention.linear[1], layer.self_attn.out)
    _norm(spec.self_attention.layer_norm, layer.norm1)
    _linear(spec.attention.linear[0], layer.cross_attn.q)
    _linear(spec.attention.linear[1], layer.cross_attn.kv)
    _linear(spec.attention.linear[2], layer.cross_attn.out)
    _norm(spec.attention.layer_norm, layer.norm2)
    _linear(spec.ffn.linear_0, layer.ffn[0])
    _linear(spec.ffn.linear_1, layer.ffn[3])
    _norm(spec.ffn.layer_norm, layer.norm3)


def build_spec(model: Transformer, tokenizer: Tokenizer, max_positions: int):
    """A ctranslate2 TransformerSpec holding the model's weights (float32; quantized on save)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    activation = common_spec.Activation.SWISH if cfg.activation == "swish" else common_spec.Activation.RELU
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=False, activation=activation)
    table = numpy(sinusoids(max_positions, cfg.d_model))
    spec.encoder.embeddings[0].weight = numpy(model.src_embed.weight)
    spec.encoder.position_encodings.encodings = table
    spec.encoder.scale_embeddings = True  # times sqrt(d_model), as mtrain's embed
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder):
        _encoder_layer(layer_spec, layer)
    spec.decoder.embeddings.weight = numpy(model.tgt_embed.weight)
    spec.decoder.position_encodings.encodings = table
    spec.decoder.scale_embeddings = True
    _linear(spec.decoder.projection, model.proj)  # tied: the target embedding (a bias where model.output_bias)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder):
        _decoder_layer(layer_spec, layer)
    spec.register_source_vocabulary(tokenizer.src.id_pieces())
    spec.register_target_vocabulary(tokenizer.tgt.id_pieces())
    config = spec.config
    config.add_source_eos = True
    config.add_source_bos = False
    config.decoder_start_token = "<s>"
    config.bos_token, config.eos_token, config.unk_token = "<s>", "</s>", "<unk>"
    config.layer_norm_epsilon = model.encoder[0].norm1.eps if len(model.encoder) else 1e-5
    return spec


def write(model: Transformer, tokenizer: Tokenizer, folder, quantization: str | None, max_positions: int) -> dict[str, Any]:
    """Validate, quantize and save the spec into `folder` (which exists and is empty)."""
    spec = build_spec(model, tokenizer, max_positions)
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(folder))
    return {"suppress_tokens": SUPPRESS_TOKENS}
