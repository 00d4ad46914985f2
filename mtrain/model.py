"""The post-norm Transformer of Vaswani et al. 2017 ("Attention Is All You Need"), an explicit
KV cache for incremental decoding, and nothing else: this module knows no data, files or loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtrain.config import ModelConfig
from mtrain.errors import MtrainError


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


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
           is_causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d_head)) v per head. Under bfloat16 autocast on a CPU, q, k and v go
    to float32 first: PyTorch's CPU attention kernels run ~6x slower in bfloat16 than in float32
    (forward + backward, measured at Multi30k shapes), while their matmuls are tiny (d_head 64,
    ~15 positions), so the float32 copies cost less than they save."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):  # autocast would cast them back to bfloat16
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                  dropout_p=dropout_p, is_causal=is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


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
        G = 1 if cache is None else cache.group  # beam search: one source's G rows side by side
        # (B/G, G*T, 3, H, d_head) -> three (B/G, H, G*T, d_head) views, no copy
        q, k, v = self.qkv(x).view(B // G, G * T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is not None and G > 1:
            k, v, mask = cache.append_beams(k, v)
        elif cache is not None:
            k, v = cache.append_self(k, v)
        p = self.attention_dropout if self.training else 0.0
        y = attend(q, k, v, mask, p, is_causal)
        return self.out(y.transpose(1, 2).reshape(B, T, D))  # concat heads: (B, T, D)


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
        B, S, D = memory.shape
        k, v = self.kv(memory).view(B, S, 2, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        return k, v  # each (B, H, S, d_head)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor, cache: LayerCache | None = None) -> Tensor:
        B, T, D = x.shape
        if cache is None:
            k, v = self.memory_kv(memory)
        else:  # computed on the first cached call, then reused for every step of the sentence
            if cache.cross_k is None:
                cache.cross_k, cache.cross_v = self.memory_kv(memory)
            k, v = cache.cross_k, cache.cross_v
        # With cache.group = G > 1 (beam search), K/V are stored once per source and the G rows of
        # one source attend with their queries side by side: (B, T) -> (B / G, G * T) queries.
        G = 1 if cache is None else cache.group
        q = self.q(x).view(B // G, G * T, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B/G, H, G*T, d_head)
        p = self.attention_dropout if self.training else 0.0
        y = attend(q, k, v, mask, p)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class Dropout(nn.Dropout):
    """nn.Dropout, with a cheaper mask for float32 and bfloat16 on CPU, where bernoulli_ (one random
    float per element) costs more than the matmul before it (in bfloat16, 5x more): see
    cpu_dropout_keep. About 8% of a float32 training step on a 2-core CPU. GPUs, other dtypes and
    torch.compile use F.dropout (already fused there)."""

    def forward(self, x: Tensor) -> Tensor:
        if (not self.training or self.p == 0.0 or x.device.type != "cpu"
                or x.dtype not in (torch.float32, torch.bfloat16) or torch.compiler.is_compiling()):
            return super().forward(x)
        keep, scale = cpu_dropout_keep(x, self.p)
        if x.dtype == torch.float32:
            return x * keep.to(x.dtype).mul_(scale)  # a float mask multiplies faster than a bool one
        # bfloat16 has no exact 1 / (1 - p) (1/0.9 -> 1.109, a 0.2% bias): scale each element in
        # float32 and round it, so the error is each element's own rounding, not one shared bias.
        return x.mul(scale).mul_(keep)


def cpu_dropout_keep(x: Tensor, p: float) -> tuple[Tensor, float]:
    """A bool mask shaped like x, False with probability p' = p rounded to a multiple of 2^-15
    (0.1 -> 0.100006), and the scale 1 / (1 - p') that makes E[keep * scale] = 1 exactly. One
    64-bit draw (63 random bits) gives four 15-bit uniforms."""
    threshold = round(p * 32768)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()  # uniform on [0, 2^63)
    keep = (bits.view(torch.int16)[:n] & 0x7FFF) >= threshold  # the low 15 bits of each 16
    return keep.view(x.shape), 32768 / (32768 - threshold)


class FeedForward(nn.Sequential):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper eq. 2), with dropout on the hidden ReLU output
    (model.activation_dropout; the paper has none there, tensor2tensor's relu_dropout does)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__(nn.Linear(d_model, d_ff), nn.ReLU(), Dropout(dropout), nn.Linear(d_ff, d_model))


def activation_dropout(cfg: ModelConfig) -> float:
    """The FFN hidden layer's dropout rate: model.activation_dropout, or model.dropout when negative."""
    return cfg.dropout if cfg.activation_dropout < 0 else cfg.activation_dropout


class EncoderLayer(nn.Module):
    """Post-norm: x = LayerNorm(x + Dropout(Sublayer(x))) for self-attention, then the FFN."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation_dropout(cfg))
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

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
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, activation_dropout(cfg))
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, self_mask: Tensor | None = None,
                is_causal: bool = True, cache: LayerCache | None = None) -> Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, mask=self_mask, is_causal=is_causal, cache=cache)))
        x = self.norm2(x + self.dropout(self.cross_attn(x, memory, src_mask, cache=cache)))
        return self.norm3(x + self.dropout(self.ffn(x)))


class LayerCache:
    """One decoder layer's cached keys and values, each (B, H, length, d_head); cross-attention
    ones are per source row, (B / group, H, S, d_head).

    With group G > 1 (beam search) self-attention K/V are never reordered: they are kept per
    source row, (B / G, H, G * capacity, d_head), where the key of beam g at step s sits at
    s * G + g, and each row attends through `beam_mask` to the slots of its own ancestors. A beam
    reorder then rewrites a small ancestry table instead of copying every layer's K/V."""

    def __init__(self, group: int = 1) -> None:
        self.group = group
        self.length = 0  # group > 1: steps stored in self_k/self_v
        self.beam_mask: Tensor | None = None  # group > 1: (B / G, 1, G, G * steps), set by KVCache
        self.self_k: Tensor | None = None
        self.self_v: Tensor | None = None
        self.cross_k: Tensor | None = None
        self.cross_v: Tensor | None = None
        # A row reorder of self_k/self_v not applied yet: the next append applies it while it
        # copies anyway (one copy of the cache per beam-search step instead of two).
        self.order: Tensor | None = None

    def append_self(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys/values and return all of them so far."""
        if self.self_k is not None:
            k = _reorder_cat(self.self_k, k, self.order)
            v = _reorder_cat(self.self_v, v, self.order)
        self.self_k, self.self_v, self.order = k, v, None
        return k, v

    def append_beams(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """group > 1: store this step's (B / G, H, G, d_head) keys/values in place; return the
        keys/values of every step so far and the ancestry mask to attend with."""
        G, start = self.group, self.length * self.group
        if self.self_k is None or self.self_k.size(2) < start + G:  # grow by doubling (rarely)
            steps = max(32, 2 * self.length)
            self.self_k = _grow(self.self_k, k, steps * G, start)
            self.self_v = _grow(self.self_v, v, steps * G, start)
        self.self_k[:, :, start : start + G] = k
        self.self_v[:, :, start : start + G] = v
        self.length += 1
        end = start + G
        return self.self_k[:, :, :end], self.self_v[:, :, :end], self.beam_mask

    def reorder_self(self, index: Tensor) -> None:
        self.order = index if self.order is None else self.order.index_select(0, index)

    def tensors(self) -> dict[str, Tensor]:
        return {name: t for name, t in vars(self).items() if isinstance(t, Tensor)}


def _grow(old: Tensor | None, like: Tensor, capacity: int, filled: int) -> Tensor:
    """A (B, H, capacity, d_head) buffer holding the first `filled` positions of old."""
    out = like.new_empty(like.shape[0], like.shape[1], capacity, like.shape[3])
    if old is not None:
        out[:, :, :filled] = old[:, :, :filled]
    return out


def _reorder_cat(old: Tensor, new: Tensor, order: Tensor | None) -> Tensor:
    """torch.cat([old[order], new], dim=2), with index_select writing straight into the result."""
    if order is None:
        return torch.cat([old, new], dim=2)
    length = old.shape[2]
    out = old.new_empty(order.numel(), old.shape[1], length + new.shape[2], old.shape[3])
    torch.index_select(old, 0, order, out=out[:, :, :length])
    out[:, :, length:] = new
    return out


class KVCache:
    """Decoding state for `Transformer.decode*`: per decoder layer, self-attention K/V that grow by
    the tokens of each call, cross-attention K/V computed once; `length` = target tokens seen.

    group = G > 1 (beam search): target row r belongs to source row r // G, and decode is given
    memory/src with one row per source, so cross-attention K/V are computed and stored once per
    source instead of once per beam."""

    def __init__(self, n_layers: int, group: int = 1) -> None:
        self.group = group
        self.layers = [LayerCache(group) for _ in range(n_layers)]
        self.length = 0
        self.src_mask: Tensor | None = None  # (B, 1, 1, S) key mask, fixed on the first call
        # group > 1: ancestry[r, s] = the beam (0..G-1) within its source of row r's ancestor at step s
        self.ancestry: Tensor | None = None

    def beam_step(self, rows: int, device: torch.device) -> None:
        """group > 1, before one new token per row: record each row as its own ancestor at this
        step and give every layer the mask (rows / G, 1, G, G * steps) of its ancestors' slots."""
        G, t = self.group, self.length
        if self.ancestry is None or self.ancestry.size(1) == t:
            grown = torch.empty(rows, max(32, 2 * t), dtype=torch.long, device=device)
            if self.ancestry is not None:
                grown[:, :t] = self.ancestry
            self.ancestry = grown
        beams = torch.arange(G, device=device)
        self.ancestry[:, t] = beams.repeat(rows // G)
        mask = (self.ancestry[:, : t + 1, None] == beams).view(rows // G, 1, G, (t + 1) * G)
        for layer in self.layers:
            layer.beam_mask = mask

    def expand_beams(self, group: int) -> KVCache:
        """This plain cache after one step with one row per source -> a group-`group` beam cache
        in which each source has `group` identical beams (rows r * group .. r * group + group - 1).
        Beam search runs its first step, where every beam is the same BOS prefix, once per
        sentence instead of once per beam. Cross-attention K/V and the source mask are shared."""
        if self.group != 1 or self.length != 1:
            raise ValueError(f"expand_beams needs a plain cache after one step, got group={self.group}, length={self.length}")
        if group == 1:  # one beam per source is the plain layout
            return self
        out = KVCache(len(self.layers), group)
        out.src_mask = self.src_mask
        for old, new in zip(self.layers, out.layers):
            new.cross_k, new.cross_v = old.cross_k, old.cross_v
            # (sources, H, 1, d_head) broadcast to step 0's slots of all G beams
            new.append_beams(old.self_k.expand(-1, -1, group, -1), old.self_v.expand(-1, -1, group, -1))
        out.beam_step(old.self_k.shape[0] * group, old.self_k.device)  # each beam its own step-0 ancestor
        out.length = 1
        return out

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Keep/duplicate/permute batch rows (beam search): row i becomes old row index[i].

        Per-source state (cross-attention K/V, source mask) follows index[::group] // group, which
        assumes each new group of rows comes from one old group. cross=False leaves it as it is:
        exact when index only moves rows among rows of one source (beams of one sentence), and it
        saves copying it at every beam-search step."""
        source = index[:: self.group] // self.group if self.group > 1 else index
        if self.group > 1:  # self-attention K/V stay where they are; only the ancestry moves
            if self.ancestry is not None:
                self.ancestry = self.ancestry.index_select(0, index)
            for layer in self.layers:
                for name in ("self_k", "self_v", "cross_k", "cross_v"):
                    if cross and getattr(layer, name) is not None:
                        setattr(layer, name, getattr(layer, name).index_select(0, source))
            if cross and self.src_mask is not None:
                self.src_mask = self.src_mask.index_select(0, source)
            return
        for layer in self.layers:
            layer.reorder_self(index)
            for name in ("cross_k", "cross_v"):
                if cross and getattr(layer, name) is not None:
                    setattr(layer, name, getattr(layer, name).index_select(0, source))
        if cross and self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, source)


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
        # No output bias: the paper's softmax is over x W^T only, and it keeps the 63.08M count exact.
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.embed_dropout = Dropout(cfg.dropout)
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

    def new_cache(self, group: int = 1) -> KVCache:
        """group > 1: beam search with `group` target rows per source row (see KVCache)."""
        return KVCache(len(self.decoder), group)

    def embed(self, ids: Tensor, table: nn.Embedding, start: int = 0) -> Tensor:
        """Token embedding * sqrt(d_model) + sinusoid of positions start.., then dropout."""
        end = start + ids.shape[1]
        if end > self.pe.shape[0]:  # sinusoids extend to any length; grow the table when needed
            self.pe = sinusoids(max(end, 2 * self.pe.shape[0]), self.cfg.d_model).to(self.pe.device)
        return self.embed_dropout(table(ids) * self.scale + self.pe[start:end])

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
        if cache is None:
            src_mask = key_mask(src, self.cfg.pad_id)
        else:
            if cache.src_mask is None:
                cache.src_mask = key_mask(src, self.cfg.pad_id)
            src_mask = cache.src_mask
        self_mask, is_causal = causal_mask(start, t, tgt.device)
        if cache is not None and cache.group > 1:
            if t != 1:
                raise ValueError(f"a beam-search cache (group={cache.group}) takes one token per call, got {t}")
            cache.beam_step(tgt.shape[0], tgt.device)
        x = self.embed(tgt, self.tgt_embed, start)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_mask, self_mask, is_causal, cache=None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += t
        return x

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
