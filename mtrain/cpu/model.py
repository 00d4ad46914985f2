"""The training step's CPU version of the paper's model: subclasses of mtrain.model's layers that
run a CPU training step faster with the same values (dropout masks the same in distribution).
`accelerate(model)` turns a model's layers into them in place (the parameters stay where they
are, so a checkpoint does not know the difference); MTRAIN_CPU_FAST=0 leaves the model as it is.

What they change, each measured in the docstring of the function it calls (mtrain.cpu.ops):
- a sublayer's residual dropout and the FFN's hidden dropout are folded into the linear layer
  after them (dropout_linear, relu_dropout), with masks drawn from 15 random bits
  (ops.Dropout, keep_bits);
- the whole step runs on the rows of the batch's real positions, without its padding
  (mtrain.cpu.packing: target_states), and attention takes those rows straight to its heads
  (heads_attention) where that is faster.
In evaluation (validation, decoding) every layer runs the plain model's ops."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mtrain.attention import attend
from mtrain.cache import KVCache, LayerCache
from mtrain.cpu import fast, switches
from mtrain.cpu.ops import Dropout, dropout, dropout_linear, heads_attention, on_fast_cpu, relu_dropout
from mtrain.cpu.packing import Packing
from mtrain.cpu.reductions import CPU as CPU_REDUCTIONS
from mtrain.model import (CrossAttention, DecoderLayer, EncoderLayer, FeedForward, SelfAttention, Transformer,
                          causal_mask, key_mask, split_heads)


class FastSelfAttention(SelfAttention):
    """SelfAttention with the residual dropout in W^O, on a packed step's rows."""

    def forward(self, x: Tensor, mask: Tensor | None = None, is_causal: bool = False,
                cache: LayerCache | None = None, dropout: float = 0.0, packing: Packing | None = None) -> Tensor:
        """dropout: the residual dropout on the output (paper 5.4), applied in W^O (dropout_linear).
        packing: x is (N, d_model) rows of that padded batch (mtrain.cpu.packing), and so is the output."""
        qkv = self.qkv(x)
        p = self.attention_dropout if self.training else 0.0
        if heads_from_rows(qkv, packing, p):
            y = heads_attention(packing.to_heads(qkv, 3, self.n_heads), None, mask, is_causal)
            return dropout_linear(self.out, packing.from_heads(y), dropout, self.training)
        if packing is not None:
            qkv = packing.to_grid(qkv)
        B, T, _ = qkv.shape
        q, k, v = split_heads(qkv, 3, self.n_heads)
        y = None
        if cache is not None:
            q, k, v, mask = cache.self_attention(q, k, v, mask)
            y = cache.attention(q, k, v, mask, is_causal)
        if y is None:
            y = attend(q, k, v, mask, p, is_causal)  # (B', H, T', d_head): a cache may fold rows
        y = y.transpose(1, 2).reshape(B, T, x.size(-1))  # concat heads
        return dropout_linear(self.out, y if packing is None else packing.to_rows(y), dropout, self.training)


class FastCrossAttention(CrossAttention):
    """CrossAttention with the residual dropout in W^O, on a packed step's rows."""

    def memory_kv(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        kv = self.kv(memory)
        k, v = split_heads(kv if packing is None else packing.to_grid(kv), 2, self.n_heads)
        return k, v  # each (B, H, S, d_head)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor, cache: LayerCache | None = None,
                dropout: float = 0.0, packing: Packing | None = None,
                memory_packing: Packing | None = None) -> Tensor:
        """dropout: the residual dropout on the output (paper 5.4), applied in W^O (dropout_linear).
        packing, memory_packing: x, memory are rows of those padded batches (mtrain.cpu.packing)."""
        q = self.q(x)
        p = self.attention_dropout if self.training else 0.0
        if memory_packing is not None and heads_from_rows(q, packing, p):
            kv = memory_packing.to_heads(self.kv(memory), 2, self.n_heads)
            y = heads_attention(packing.to_heads(q, 1, self.n_heads), kv, mask, False)
            return dropout_linear(self.out, packing.from_heads(y), dropout, self.training)
        if packing is not None:
            q = packing.to_grid(q)
        B, T, D = q.shape
        q = q.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, T, d_head)
        y = None
        if cache is None:
            k, v = self.memory_kv(memory, memory_packing)
        else:  # K/V computed on the first cached call, then reused for every step of the sentence
            q, k, v = cache.cross_attention(q, memory, self.memory_kv)
            y = cache.attention(q, k, v, mask, False)
        if y is None:
            y = attend(q, k, v, mask, p)
        y = y.transpose(1, 2).reshape(B, T, D)  # concat heads
        return dropout_linear(self.out, y if packing is None else packing.to_rows(y), dropout, self.training)


class FastFeedForward(FeedForward):
    """FeedForward with the hidden and the residual dropout folded into its linear layers."""

    def forward(self, x: Tensor, dropout_p: float = 0.0) -> Tensor:
        """dropout_p: the residual dropout on the output (paper 5.4). In training the first layer,
        its ReLU and the hidden dropout run as one (relu_dropout) and both dropouts' scales
        go into W2 (dropout_linear); in evaluation the layers run in order, as a decoding copy fuses the ReLU
        into the first (mtrain.cpu.quantize)."""
        if not self.training:
            return super().forward(x)
        if not isinstance(self[1], nn.ReLU):  # the fused kernels are ReLU's; other activations run in order
            return dropout(super().forward(x), dropout_p, self.training)
        hidden, scale = relu_dropout(self[0](x), self[2].p, self.training)
        return dropout_linear(self[3], hidden, dropout_p, self.training, in_scale=scale)


class FastEncoderLayer(EncoderLayer):
    """EncoderLayer whose sublayers drop their own outputs, on a packed step's rows."""

    def forward(self, x: Tensor, src_mask: Tensor, packing: Packing | None = None) -> Tensor:
        p = self.dropout.p  # each sublayer drops its own output (in its last linear layer)
        x = self.norm1(x + self.self_attn(x, mask=src_mask, dropout=p, packing=packing))
        return self.norm2(x + self.ffn(x, dropout_p=p))


class FastDecoderLayer(DecoderLayer):
    """DecoderLayer whose sublayers drop their own outputs, on a packed step's rows."""

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, self_mask: Tensor | None = None,
                is_causal: bool = True, cache: LayerCache | None = None,
                packing: Packing | None = None, memory_packing: Packing | None = None) -> Tensor:
        p = self.dropout.p  # each sublayer drops its own output (in its last linear layer)
        x = self.norm1(x + self.self_attn(x, mask=self_mask, is_causal=is_causal, cache=cache, dropout=p,
                                          packing=packing))
        x = self.norm2(x + self.cross_attn(x, memory, src_mask, cache=cache, dropout=p, packing=packing,
                                           memory_packing=memory_packing))
        return self.norm3(x + self.ffn(x, dropout_p=p))


class FastTransformer(Transformer):
    """Transformer whose training step runs on the real positions of a batch (target_states), its
    loss's row sums by the CPU's reductions."""

    reductions = CPU_REDUCTIONS

    def embed(self, ids: Tensor, table: nn.Embedding, start: int = 0, packing: Packing | None = None) -> Tensor:
        """Token embedding * sqrt(d_model) + sinusoid of positions start.., then dropout; with a
        packing, (N, d_model) for its rows."""
        end = start + ids.shape[1]
        self.cover_positions(end)
        if packing is None:
            ids, pe = ids, self.pe[start:end]
        else:
            ids, pe = packing.take(ids), self.pe.index_select(0, packing.positions())
        # In the table's dtype: a bfloat16 decoding copy (mtrain.cpu.quantize) keeps float32 sinusoids.
        return self.embed_dropout((table(ids) * self.scale + pe).to(table.weight.dtype))

    def encode(self, src: Tensor, packing: Packing | None = None) -> Tensor:
        """(B, S) source ids -> memory (B, S, d_model); with packing (Packing.of(src)), its rows
        (N, d_model)."""
        mask = key_mask(src, self.cfg.pad_id)
        x = self.embed(src, self.src_embed, packing=packing)
        for layer in self.encoder:
            x = layer(x, mask, packing)
        return x

    def decode_states(self, tgt: Tensor, memory: Tensor, src: Tensor, cache: KVCache | None = None,
                      packing: Packing | None = None, memory_packing: Packing | None = None) -> Tensor:
        """(B, t) target ids -> final decoder states (B, t, d_model).

        With a cache, `tgt` holds only the new tokens; their positions continue from cache.length,
        and memory/src are read only on the first call (cross-attention K/V and mask are cached).
        With packings (teacher forcing only), memory is the rows of memory_packing and the states
        are the rows of packing (Packing.of(tgt)), (N, d_model)."""
        t = tgt.shape[1]
        start = 0 if cache is None else cache.length
        src_mask = self.source_mask(src, cache)
        self_mask, is_causal = causal_mask(start, t, tgt.device)
        if cache is not None:
            cache.begin(tgt)
        x = self.embed(tgt, self.tgt_embed, start, packing)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_mask, self_mask, is_causal, cache=None if cache is None else cache.layers[i],
                      packing=packing, memory_packing=memory_packing)
        if cache is not None:
            cache.length += t
        return x

    def target_states(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        """Transformer.target_states; where packs(src), on the rows of both sides' real positions."""
        if not packs(src):
            return super().target_states(src, tgt_in, tgt_out)
        pad_id = self.cfg.pad_id  # tgt_in and tgt_out are real at the same cells (BOS + ids, ids + EOS)
        src_rows, tgt_rows = Packing.of(src, pad_id), Packing.of(tgt_out, pad_id)
        memory = self.encode(src, src_rows)  # (N_src, d_model)
        states = self.decode_states(tgt_in, memory, src, packing=tgt_rows, memory_packing=src_rows)
        real = tgt_rows.index[: tgt_rows.real]  # the real rows come first, in row-major order
        return states[: tgt_rows.real], tgt_out.reshape(-1).index_select(0, real)


# The dtypes whose packed CPU training steps take attention from the rows straight to the heads.
HEADS_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def heads_from_rows(x: Tensor, packing: Packing | None, dropout_p: float) -> bool:
    """Whether attention takes a packed step's rows straight to its heads and back (Packing.to_heads,
    ops.heads_attention, Packing.from_heads): a CPU training step (gradients wanted, eager) without
    attention dropout, in float32, float64 and bfloat16 (autocast), where it does
    bfloat16_attention's arithmetic without the grid. At the
    small shape the copies into and out of the grid cost about twice as long as the one gather
    each way (benchmarks/results/amd-epyc-avx2/NOTES.md). switches.heads_from_rows=False keeps the grid."""
    return (packing is not None and switches.heads_from_rows and on_fast_cpu(x) and x.dtype in HEADS_DTYPES
            and dropout_p == 0.0 and torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling())


def packs(ids: Tensor) -> bool:
    """Whether the training step runs on the batch's real positions only (mtrain.cpu.packing): on a
    CPU, eager, in float32 and under bfloat16 autocast alike. Finding the positions takes the host
    a look at the ids, which on a GPU would wait for the device, and the compiler wants the padded
    shapes, which it sees again from batch to batch. Under bfloat16 autocast on an AMX Xeon, packed
    and padded steps alternated in one process ran 1.011x (median; small shape) and 1.121x (base
    shape) as fast; a float32 step 1.02-1.05x (small shape, 2-core AVX2 EPYC; benchmarks/results/amd-epyc-avx2/NOTES.md)."""
    return on_fast_cpu(ids) and not torch.compiler.is_compiling()


FAST = {SelfAttention: FastSelfAttention, CrossAttention: FastCrossAttention, FeedForward: FastFeedForward,
        EncoderLayer: FastEncoderLayer, DecoderLayer: FastDecoderLayer, Transformer: FastTransformer,
        nn.Dropout: Dropout}


def accelerate(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """`model` (in place) with every layer of mtrain.model, and every nn.Dropout, as its CPU
    training version above, for training on `device`; the model as it is on other devices and
    where MTRAIN_CPU_FAST=0."""
    if torch.device(device).type == "cpu" and fast():
        for module in model.modules():
            module.__class__ = FAST.get(type(module), type(module))
    return model
