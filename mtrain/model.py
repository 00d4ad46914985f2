"""The post-norm Transformer of Vaswani et al. 2017 ("Attention Is All You Need") and nothing
else: this module knows no data, files, loss or search. Incremental decoding hands each layer's
queries, keys and values to a cache (mtrain.cache), which decides what they attend to."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mtrain.attention import attend
from mtrain.cache import PLAIN, BeamCache, CacheLayers, KVCache, LayerCache
from mtrain.config import ModelConfig
from mtrain.errors import MtrainError
from mtrain.reductions import PLAIN as PLAIN_REDUCTIONS, Reductions


def sinusoids(length: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(same); pos from 0 (paper 3.5)."""
    position = torch.arange(length, dtype=torch.float64)[:, None]  # float64: exact for long tables
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angle = position * inv_freq  # (length, d_model / 2)
    table = torch.empty(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


def key_mask(ids: Tensor, pad_id: int) -> Tensor:
    """(B, S) ids -> (B, 1, 1, S) bool, True = may attend (SDPA's polarity).

    Only keys are masked. A row that is all padding would mask every key, and a softmax over
    nothing is NaN in some SDPA kernels (older PyTorch, some GPU backends; CPU in 2.13 gives 0);
    such a row attends to its own pads instead: finite everywhere, and no real position reads
    it (it is masked as a key everywhere else)."""
    keep = ids != pad_id
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def split_heads(y: Tensor, parts: int, n_heads: int) -> tuple[Tensor, ...]:
    """(B, T, parts * D), a fused projection's output -> `parts` views of shape (B, H, T, d_head),
    no copy. Unbinding the parts axis before the heads move puts the backward's stack of their
    gradients straight into (B, T, parts, H, d_head), the projection's own layout; unbinding after
    the permute stacked them as (parts, B, H, T, d_head) and then copied that a second time."""
    B, T, width = y.shape
    return tuple(t.transpose(1, 2) for t in y.view(B, T, parts, n_heads, width // (parts * n_heads)).unbind(2))


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused Q/K/V projection (one matmul instead of three)."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # rows: W^Q, W^K, W^V stacked
        self.out = nn.Linear(d_model, d_model)  # W^O

    def forward(self, x: Tensor, mask: Tensor | None = None, is_causal: bool = False,
                cache: LayerCache | None = None) -> Tensor:
        B, T, D = x.shape
        q, k, v = split_heads(self.qkv(x), 3, self.n_heads)
        y = None
        if cache is not None:
            q, k, v, mask = cache.self_attention(q, k, v, mask)
            y = cache.attention(q, k, v, mask, is_causal)
        if y is None:
            y = attend(q, k, v, mask, self.attention_dropout if self.training else 0.0, is_causal)
        return self.out(y.transpose(1, 2).reshape(B, T, D))  # concat heads; a cache may fold rows in y


class CrossAttention(nn.Module):
    """Multi-head attention from the decoder over the encoder output; K and V share one matmul."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.attention_dropout = attention_dropout
        self.q = nn.Linear(d_model, d_model)  # W^Q
        self.kv = nn.Linear(d_model, 2 * d_model)  # W^K, W^V stacked
        self.out = nn.Linear(d_model, d_model)  # W^O

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        return split_heads(self.kv(memory), 2, self.n_heads)  # each (B, H, S, d_head)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor, cache: LayerCache | None = None) -> Tensor:
        B, T, D = x.shape
        q = self.q(x).view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, T, d_head)
        y = None
        if cache is None:
            k, v = self.memory_kv(memory)
        else:  # K/V computed on the first cached call, then reused for every step of the sentence
            q, k, v = cache.cross_attention(q, memory, self.memory_kv)
            y = cache.attention(q, k, v, mask, False)
        if y is None:
            y = attend(q, k, v, mask, self.attention_dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, D))  # concat heads


class FeedForward(nn.Sequential):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper eq. 2), with dropout on the hidden ReLU output
    (model.activation_dropout; the paper has none there, tensor2tensor's relu_dropout does).
    activation="swish": x * sigmoid(x) in place of max(0, x), as in Marian's models."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str = "relu"):
        nonlinearity = nn.SiLU() if activation == "swish" else nn.ReLU()
        super().__init__(nn.Linear(d_model, d_ff), nonlinearity, nn.Dropout(dropout), nn.Linear(d_ff, d_model))


def activation_dropout(cfg: ModelConfig) -> float:
    """The FFN hidden layer's dropout rate: model.activation_dropout, or model.dropout when negative."""
    return cfg.dropout if cfg.activation_dropout < 0 else cfg.activation_dropout


class EncoderLayer(nn.Module):
    """Post-norm: x = LayerNorm(x + Dropout(Sublayer(x))) for self-attention, then the FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation_dropout(cfg), cfg.activation)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)  # residual dropout (paper 5.4)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, mask=src_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    """Post-norm: masked self-attention, cross-attention over the encoder output, then the FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation_dropout(cfg), cfg.activation)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)  # residual dropout (paper 5.4)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, self_mask: Tensor | None = None,
                is_causal: bool = True, cache: LayerCache | None = None) -> Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, mask=self_mask, is_causal=is_causal, cache=cache)))
        x = self.norm2(x + self.dropout(self.cross_attn(x, memory, src_mask, cache=cache)))
        return self.norm3(x + self.dropout(self.ffn(x)))


class Transformer(nn.Module):
    """The encoder-decoder Transformer. Inputs are id tensors padded with `cfg.pad_id`; targets
    are right-padded (as `mtrain.data.collate` makes them), so the causal mask alone hides every
    target pad from every real position and decoder self-attention needs no padding mask."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise MtrainError(f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}; "
                              "pick n_heads that divides d_model")
        self.cfg = cfg
        src_vocab = cfg.src_vocab_size or cfg.vocab_size
        self.tgt_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Three-way tying (paper 3.4) needs one joint vocabulary; the pre-softmax projection always
        # shares the target embedding. With separate vocabularies the caller sets share_embeddings
        # false (two vocabularies of equal size are still two vocabularies).
        joint = cfg.share_embeddings and src_vocab == cfg.vocab_size
        self.src_embed = self.tgt_embed if joint else nn.Embedding(src_vocab, cfg.d_model)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # No output bias by default: the paper's softmax is over x W^T only, and it keeps the 63.08M
        # count exact (model.output_bias adds one, for imported Marian models).
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.output_bias)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.register_buffer("pe", sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        self.scale = math.sqrt(cfg.d_model)
        self.reset_parameters()
        self.proj.weight = self.tgt_embed.weight  # tie after init: one tensor, three uses

    def reset_parameters(self) -> None:
        """Xavier-uniform linear weights, zero biases: keeps activation variance ~1 through each
        sublayer, which post-norm needs (the residual sum is renormalised anyway). Q, K and V are
        initialised as the paper's separate d_model x d_model matrices, not as one fused matrix.
        Embeddings ~ N(0, d_model^-0.5): times sqrt(d_model) they have unit variance, on the scale of
        the sinusoids, and as the tied projection they give logits of unit variance."""
        d = self.cfg.d_model
        fused = {m.qkv for m in self.modules() if isinstance(m, SelfAttention)}
        fused |= {m.kv for m in self.modules() if isinstance(m, CrossAttention)}
        for module in self.modules():
            if isinstance(module, nn.Linear):
                for block in module.weight.split(d) if module in fused else [module.weight]:
                    nn.init.xavier_uniform_(block)  # a view: initialises that slice in place
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=d ** -0.5)

    # The layer caches decoding caches are made of (mtrain.cache), and the row reductions search
    # and the loss take (mtrain.reductions); a CPU model sets its own.
    cache_layers: CacheLayers = PLAIN
    reductions: Reductions = PLAIN_REDUCTIONS

    def new_cache(self, group: int = 1) -> KVCache:
        """An empty decoding cache; group > 1: beam search with `group` target rows per source
        row (mtrain.cache.BeamCache)."""
        n = len(self.decoder)
        return KVCache(n, self.cache_layers) if group == 1 else BeamCache(n, group, self.cache_layers)

    def embed(self, ids: Tensor, table: nn.Embedding, start: int = 0) -> Tensor:
        """Token embedding * sqrt(d_model) + sinusoid of positions start.., then dropout."""
        end = start + ids.shape[1]
        self.cover_positions(end)
        # In the table's dtype: a bfloat16 decoding copy (mtrain.cpu.quantize) keeps float32 sinusoids.
        return self.embed_dropout((table(ids) * self.scale + self.pe[start:end]).to(table.weight.dtype))

    def cover_positions(self, end: int) -> None:
        """Grow the sinusoid table to hold positions 0..end-1 (sinusoids extend to any length)."""
        if end > self.pe.shape[0]:
            self.pe = sinusoids(max(end, 2 * self.pe.shape[0]), self.cfg.d_model).to(self.pe.device)

    def encode(self, src: Tensor) -> Tensor:
        """(B, S) source ids -> memory (B, S, d_model)."""
        mask = key_mask(src, self.cfg.pad_id)
        x = self.embed(src, self.src_embed)
        for layer in self.encoder:
            x = layer(x, mask)
        return x

    def decode_states(self, tgt: Tensor, memory: Tensor, src: Tensor, cache: KVCache | None = None) -> Tensor:
        """(B, t) target ids -> final decoder states (B, t, d_model).

        With a cache, `tgt` holds only the new tokens; their positions continue from cache.length,
        and memory/src are read only on the first call (cross-attention K/V and mask are cached)."""
        t = tgt.shape[1]
        start = 0 if cache is None else cache.length
        src_mask = self.source_mask(src, cache)
        self_mask, is_causal = causal_mask(start, t, tgt.device)
        if cache is not None:
            cache.begin(tgt)
        x = self.embed(tgt, self.tgt_embed, start)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_mask, self_mask, is_causal, cache=None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += t
        return x

    def source_mask(self, src: Tensor, cache: KVCache | None) -> Tensor:
        """key_mask of the source, kept in the cache from its first call on."""
        if cache is None:
            return key_mask(src, self.cfg.pad_id)
        if cache.src_mask is None:
            cache.src_mask = key_mask(src, self.cfg.pad_id)
        return cache.src_mask

    def target_states(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: the final decoder states at the real (non-pad) target positions, (N,
        d_model), and the reference ids there, (N,), row-major."""
        states = self.decode_states(tgt_in, self.encode(src), src)  # (B, T, d_model)
        real = tgt_out != self.cfg.pad_id
        return states[real], tgt_out[real]

    def project(self, states: Tensor) -> Tensor:
        """(..., d_model) decoder states -> (..., vocab_size) logits (the tied pre-softmax matrix)."""
        return self.proj(states)

    def decode(self, tgt: Tensor, memory: Tensor, src: Tensor, cache: KVCache | None = None) -> Tensor:
        """(B, t) target ids -> logits (B, t, vocab_size); see decode_states."""
        return self.project(self.decode_states(tgt, memory, src, cache))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: (B, S) source and (B, T) shifted target ids -> logits (B, T, vocab_size)."""
        return self.decode(tgt_in, self.encode(src), src)


def causal_mask(start: int, t: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """The decoder self-attention mask for t new queries at positions start..start+t-1 over keys
    0..start+t-1, as (mask, is_causal) for SDPA. SDPA's is_causal aligns the triangle top-left, which
    is right only when there is no cached prefix; one new query may see every key, so needs none."""
    if start == 0:
        return None, t > 1
    if t == 1:
        return None, False
    return torch.ones(t, start + t, dtype=torch.bool, device=device).tril(diagonal=start), False
