"""Properties of mtrain.model: PyTorch's own layers as an oracle, masks, cache, tying, sizes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import DEVICES
from mtrain.config import ModelConfig, load_config
from mtrain.errors import MtrainError
from mtrain.cpu.ops import Dropout
from mtrain.attention import attend
from mtrain.cpu.attention import bfloat16_attention
from mtrain.model import Transformer, key_mask, sinusoids

ROOT = Path(__file__).resolve().parents[1]
PAD = 0
TINY = ModelConfig(d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                   dropout=0.0, vocab_size=50, max_len=64)


def tiny(**changes) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY.__dict__, **changes})
    return Transformer(cfg).eval()


def ids(batch: int, length: int, vocab: int = 50, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, length), generator=gen)  # no specials, no PAD


def padded(lengths: list[int], width: int, seed: int = 1) -> torch.Tensor:
    x = ids(len(lengths), width, seed=seed)
    for row, n in enumerate(lengths):
        x[row, n:] = PAD
    return x


# ---------------------------------------------------------------------------------------------
# Oracle: torch.nn's post-norm layers with our weights copied in


def copy_encoder_layer(ours, theirs: nn.TransformerEncoderLayer) -> None:
    with torch.no_grad():
        ours.self_attn.qkv.weight.copy_(theirs.self_attn.in_proj_weight)
        ours.self_attn.qkv.bias.copy_(theirs.self_attn.in_proj_bias)
        ours.self_attn.out.load_state_dict(theirs.self_attn.out_proj.state_dict())
        ours.ffn[0].load_state_dict(theirs.linear1.state_dict())
        ours.ffn[3].load_state_dict(theirs.linear2.state_dict())
        ours.norm1.load_state_dict(theirs.norm1.state_dict())
        ours.norm2.load_state_dict(theirs.norm2.state_dict())


def copy_decoder_layer(ours, theirs: nn.TransformerDecoderLayer) -> None:
    d = ours.norm1.normalized_shape[0]
    with torch.no_grad():
        ours.self_attn.qkv.weight.copy_(theirs.self_attn.in_proj_weight)
        ours.self_attn.qkv.bias.copy_(theirs.self_attn.in_proj_bias)
        ours.self_attn.out.load_state_dict(theirs.self_attn.out_proj.state_dict())
        ours.cross_attn.q.weight.copy_(theirs.multihead_attn.in_proj_weight[:d])
        ours.cross_attn.q.bias.copy_(theirs.multihead_attn.in_proj_bias[:d])
        ours.cross_attn.kv.weight.copy_(theirs.multihead_attn.in_proj_weight[d:])
        ours.cross_attn.kv.bias.copy_(theirs.multihead_attn.in_proj_bias[d:])
        ours.cross_attn.out.load_state_dict(theirs.multihead_attn.out_proj.state_dict())
        ours.ffn[0].load_state_dict(theirs.linear1.state_dict())
        ours.ffn[3].load_state_dict(theirs.linear2.state_dict())
        for i in (1, 2, 3):
            getattr(ours, f"norm{i}").load_state_dict(getattr(theirs, f"norm{i}").state_dict())


def torch_layers(cfg: ModelConfig):
    torch.manual_seed(123)  # weights independent of ours, so the copy is really tested
    kw = dict(d_model=cfg.d_model, nhead=cfg.n_heads, dim_feedforward=cfg.d_ff, dropout=0.0,
              batch_first=True, norm_first=False)
    return nn.TransformerEncoderLayer(**kw).eval(), nn.TransformerDecoderLayer(**kw).eval()


def test_layers_match_torch_post_norm_layers_with_padding():
    model = tiny()
    enc, dec = torch_layers(model.cfg)
    copy_encoder_layer(model.encoder[0], enc)
    copy_decoder_layer(model.decoder[0], dec)
    src = padded([7, 4, 1], 7)
    real = src != PAD
    x = torch.randn(3, 7, 32)
    y = torch.randn(3, 5, 32)
    with torch.no_grad():
        ours = model.encoder[0](x, key_mask(src, PAD))
        theirs = enc(x, src_key_padding_mask=~real)
        # torch's fast path may zero padded rows; only real positions are defined
        torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
        causal = nn.Transformer.generate_square_subsequent_mask(5)
        ours = model.decoder[0](y, x, key_mask(src, PAD), is_causal=True)
        theirs = dec(y, x, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=~real)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_whole_model_matches_torch_stacks_without_final_norm():
    """Embeddings * sqrt(d) + sinusoids, N post-norm layers, no stack-final LayerNorm, tied output."""
    model = tiny()
    enc, dec = torch_layers(model.cfg)
    encoder = nn.TransformerEncoder(enc, 2, norm=None, enable_nested_tensor=False).eval()
    decoder = nn.TransformerDecoder(dec, 2, norm=None).eval()
    for ours, theirs in zip(model.encoder, encoder.layers):
        copy_encoder_layer(ours, theirs)
    for ours, theirs in zip(model.decoder, decoder.layers):
        copy_decoder_layer(ours, theirs)
    src, tgt = padded([6, 3], 6), ids(2, 5, seed=2)
    emb = model.tgt_embed.weight
    pe = sinusoids(8, 32)
    with torch.no_grad():
        memory = encoder(emb[src] * math.sqrt(32) + pe[:6], src_key_padding_mask=src == PAD)
        states = decoder(emb[tgt] * math.sqrt(32) + pe[:5], memory,
                         tgt_mask=nn.Transformer.generate_square_subsequent_mask(5), tgt_is_causal=True,
                         memory_key_padding_mask=src == PAD)
        torch.testing.assert_close(model(src, tgt), states @ emb.T, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Masks


@pytest.mark.parametrize("device", DEVICES)
def test_causality_future_targets_do_not_change_earlier_logits(device):
    model = tiny().to(device)
    src, tgt = ids(2, 6).to(device), ids(2, 8, seed=3).to(device)
    changed = tgt.clone()
    changed[:, 5:] = ids(2, 3, seed=4)
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("device", DEVICES)
def test_padding_invariance_src_and_tgt(device):
    """Appending pad columns to both sides leaves every real position's logits unchanged, and a
    sentence batched with a longer one gives the same logits as alone."""
    model = tiny().to(device)
    src, tgt = padded([6, 4, 2], 6).to(device), padded([5, 3, 5], 5, seed=5).to(device)
    wide_src = torch.cat([src, torch.full((3, 4), PAD, device=device)], dim=1)
    wide_tgt = torch.cat([tgt, torch.full((3, 3), PAD, device=device)], dim=1)
    with torch.no_grad():
        base = model(src, tgt)
        wide = model(wide_src, wide_tgt)
        alone = model(src[1:2, :4], tgt[1:2, :3])
    real = tgt != PAD
    torch.testing.assert_close(wide[:, :5][real], base[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(base[1:2, :3], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_padded_source_row_gives_no_nan_anywhere(device):
    model = tiny().to(device).train()  # dropout 0 in TINY: deterministic, but gradients on
    src, tgt = padded([5, 0, 3], 5).to(device), padded([4, 4, 2], 4, seed=6).to(device)
    logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    logits[tgt != PAD].logsumexp(-1).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():  # the empty row does not leak into its neighbours
        torch.testing.assert_close(logits[2:3, :2], model(src[2:3, :3], tgt[2:3, :2]), atol=1e-5, rtol=0)


def test_key_mask_masks_pad_keys_only():
    mask = key_mask(torch.tensor([[5, 6, PAD], [PAD, PAD, PAD]]), PAD)
    assert mask.shape == (2, 1, 1, 3)
    assert mask[0].flatten().tolist() == [True, True, False]
    assert mask[1].all()  # an all-pad row attends to its pads rather than to nothing (NaN)


# ---------------------------------------------------------------------------------------------
# Incremental decoding


@pytest.mark.parametrize("device", DEVICES)
def test_cached_decoding_equals_full_forward_including_reorder_and_multi_token_steps(device):
    model = tiny().to(device)
    src, tgt = padded([6, 3, 5], 6).to(device), ids(3, 7, seed=7).to(device)
    with torch.no_grad():
        memory = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, :3], memory, src, cache),  # a prefix of 3 at once
                 model.decode(tgt[:, 3:5], memory, src, cache)]  # 2 tokens after a cached prefix
        assert cache.length == 5
        torch.testing.assert_close(torch.cat(steps, 1), model(src, tgt[:, :5]), atol=1e-5, rtol=0)

        order = torch.tensor([2, 0, 0], device=device)  # beam search: keep, duplicate, drop rows
        cache.reorder(order)
        src, tgt, memory = src[order], tgt[order], memory[order]
        tgt[1, 5:] = ids(1, 2, seed=8)  # the duplicated row continues differently
        steps += [model.decode(tgt[:, 5:6], memory, src, cache),  # one token: no mask needed
                  model.decode(tgt[:, 6:7], memory, src, cache)]
        torch.testing.assert_close(torch.cat(steps[-2:], 1), model(src, tgt)[:, 5:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_beam_cache_equals_full_forward_through_beam_moves_and_dropped_sources(device):
    """group=2: two target rows per source; K/V stay in place and an ancestry mask picks each
    row's prefix, so after moving beams and dropping a source every row must still see exactly
    its own prefix (the full forward of that prefix is the reference)."""
    model = tiny().to(device)
    src, G = padded([6, 3, 5], 6).to(device), 2
    tgt = ids(6, 6, seed=11).to(device)  # row r's tokens; rows 2b, 2b+1 belong to source b
    with torch.no_grad():
        memory, cache = model.encode(src), model.new_cache(group=G)
        prefix = tgt[:, :0]
        moves = {2: (torch.tensor([1, 1, 2, 2, 5, 4], device=device), False),  # duplicate / swap within sources
                 4: (torch.tensor([4, 5, 0, 1], device=device), True)}  # drop source 1, swap the other two
        for step in range(6):
            if step in moves:
                index, cross = moves[step]
                cache.reorder(index, cross=cross)
                if cross:
                    memory, src = memory[index[::G] // G], src[index[::G] // G]
                prefix = prefix[index]
            new = tgt[: prefix.shape[0], step : step + 1]  # rows that share a prefix now part
            prefix = torch.cat([prefix, new], 1)
            got = model.decode(new, memory, src, cache)[:, -1]
            full = model(src.repeat_interleave(G, 0), prefix)[:, -1]
            torch.testing.assert_close(got, full, atol=1e-5, rtol=0)


def test_positions_extend_past_max_len():
    model = tiny(max_len=4)
    src, tgt = ids(1, 9), ids(1, 10, seed=9)
    with torch.no_grad():
        full = model(src, tgt)
        memory, cache = model.encode(src), model.new_cache()
        steps = torch.cat([model.decode(tgt[:, i:i + 1], memory, src, cache) for i in range(10)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.pe[:10], sinusoids(10, 32))


# ---------------------------------------------------------------------------------------------
# Embeddings, positions, tying, sizes


def test_sinusoids_hand_values():
    pe = sinusoids(3, 4)  # d=4: frequencies 10000^(0/4) = 1 and 10000^(2/4) = 100
    assert pe[0].tolist() == [0.0, 1.0, 0.0, 1.0]  # positions start at 0: sin 0, cos 0
    expected = [math.sin(2), math.cos(2), math.sin(2 / 100), math.cos(2 / 100)]
    torch.testing.assert_close(pe[2], torch.tensor(expected))
    big = sinusoids(51, 512)
    assert big[50, 510].item() == pytest.approx(math.sin(50 / 10000 ** (510 / 512)), abs=1e-7)
    assert big[50, 511].item() == pytest.approx(math.cos(50 / 10000 ** (510 / 512)), abs=1e-7)


def test_embedding_is_scaled_by_sqrt_d_model_plus_positions():
    model = tiny()
    x = ids(2, 5)
    expected = model.src_embed.weight[x] * math.sqrt(32) + sinusoids(5, 32)
    torch.testing.assert_close(model.embed(x, model.src_embed), expected)
    # with the init N(0, d^-1/2), scaled embeddings have unit variance, like the sinusoids' scale
    assert model.tgt_embed.weight.std().item() == pytest.approx(32 ** -0.5, rel=0.1)


def test_three_way_tying_with_joint_vocabulary():
    for model in (tiny(), tiny(src_vocab_size=50)):
        ptrs = {model.src_embed.weight.data_ptr(), model.tgt_embed.weight.data_ptr(),
                model.proj.weight.data_ptr()}
        assert len(ptrs) == 1
        n = sum(p.numel() for p in model.parameters())
        assert n == sum(p.numel() for p in tiny(src_vocab_size=50, share_embeddings=False).parameters()) - 50 * 32


def test_separate_vocabularies_tie_target_embedding_and_projection_only():
    model = tiny(src_vocab_size=70)
    assert model.src_embed.weight.shape == (70, 32)
    assert model.tgt_embed.weight.data_ptr() == model.proj.weight.data_ptr()
    assert model.src_embed.weight.data_ptr() != model.tgt_embed.weight.data_ptr()
    with torch.no_grad():
        assert model(ids(2, 4, vocab=70), ids(2, 3)).shape == (2, 3, 50)
    assert tiny(share_embeddings=False).src_embed is not tiny(share_embeddings=False).tgt_embed


def count(cfg: ModelConfig) -> int:
    with torch.device("meta"):  # no memory, no init time: only shapes
        return sum(p.numel() for p in Transformer(cfg).parameters())


def test_transformer_base_has_63_08M_parameters():
    # d=512, d_ff=2048, V=37000 joint, tied three ways, no output bias:
    #   embeddings        37000*512                                          = 18,944,000
    #   attention block   4*(512*512 + 512)                                  =  1,050,624
    #   FFN               512*2048 + 2048 + 2048*512 + 512                   =  2,099,712
    #   encoder layer     attention + FFN + 2 LayerNorms (2*2*512)           =  3,152,384
    #   decoder layer     2 attentions + FFN + 3 LayerNorms (3*2*512)        =  4,204,032
    #   total             18,944,000 + 6*3,152,384 + 6*4,204,032             = 63,082,496
    cfg = load_config(ROOT / "configs" / "transformer-base.yaml").model
    assert count(cfg) == 18_944_000 + 6 * 3_152_384 + 6 * 4_204_032 == 63_082_496


def test_transformer_big_parameter_count():
    # d=1024, d_ff=4096, V=37000:
    #   embeddings 37000*1024 = 37,888,000; attention 4*(1024*1024 + 1024) = 4,198,400;
    #   FFN 2*1024*4096 + 4096 + 1024 = 8,393,728;
    #   encoder layer 4,198,400 + 8,393,728 + 2*2048 = 12,596,224;
    #   decoder layer 2*4,198,400 + 8,393,728 + 3*2048 = 16,796,672;
    #   total 37,888,000 + 6*12,596,224 + 6*16,796,672 = 214,245,376 (the paper's "213M")
    cfg = load_config(ROOT / "configs" / "transformer-big.yaml").model
    assert count(cfg) == 37_888_000 + 6 * 12_596_224 + 6 * 16_796_672 == 214_245_376


def test_small_preset_shape():
    cfg = load_config(ROOT / "configs" / "small.yaml").model
    assert (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers) == (256, 1024, 4, 3, 3)


def test_heads_must_divide_d_model():
    with pytest.raises(MtrainError, match="n_heads"):
        Transformer(ModelConfig(d_model=30, n_heads=4))


def test_dropout_is_active_in_training_only():
    model = tiny(dropout=0.5)
    src, tgt = ids(2, 5), ids(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), model(src, tgt))
        model.train()
        assert not torch.allclose(model(src, tgt), model(src, tgt))


def test_activation_dropout_defaults_to_dropout_and_zero_turns_it_off():
    """model.activation_dropout < 0 keeps mtrain's old FFN-hidden dropout (= model.dropout); 0 is the
    paper's and fairseq's FFN: in training mode the FFN is then deterministic while the residual
    dropout around it is not."""
    same, none = tiny(dropout=0.3), tiny(dropout=0.3, activation_dropout=0.0)
    hidden = lambda model: [layer.ffn[2].p for layer in [*model.encoder, *model.decoder]]  # noqa: E731
    assert hidden(same) == [0.3] * 4 and hidden(none) == [0.0] * 4
    assert hidden(tiny(dropout=0.3, activation_dropout=0.1)) == [0.1] * 4
    ffn = none.encoder[0].ffn.train()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ffn(x), ffn(x))
    assert not torch.equal(*(same.encoder[0].ffn.train()(x) for _ in range(2)))
    assert all(layer.dropout.p == 0.3 for layer in none.encoder)


def test_runs_under_bf16_autocast_with_float32_parameters():
    """Mixed precision (train.amp) keeps fp32 weights; the model must not assume one dtype."""
    model = tiny()
    src, tgt = padded([5, 2], 5), ids(2, 4, seed=10)
    with torch.no_grad():
        full = model(src, tgt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(src, tgt)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low.float()).all()
    assert (low.float() - full).abs().max().item() < 0.25  # bf16 keeps ~3 significant digits


@pytest.mark.fast_paths
def test_bf16_queries_over_float32_keys_attend_in_float32_on_cpu():
    """A bfloat16 decoding copy's cache keeps keys and values in float32: attend upcasts q to
    PyTorch's float32 kernel (autocast must not cast it back) and rounds the result once to bfloat16,
    bit for bit."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 8, generator=gen).bfloat16()
    k, v = (torch.randn(2, 4, 7, 8, generator=gen) for _ in range(2))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attend(q, k, v, mask, 0.0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected.bfloat16())
    assert torch.equal(attend(q, k, v, mask, 0.0), expected.bfloat16())  # a bfloat16 model, no autocast


def _every_attention_path(q, k, v, mask):
    """Each way mtrain attends on a CPU, by name: the entry point with the stand-ins on and off,
    and each stand-in called directly."""
    from mtrain.cpu import native
    from mtrain.cpu.ops import heads_attention

    paths = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)}
    paths["attend"] = lambda: attend(q, k, v, mask, 0.0)
    paths["attend, stand-ins off"] = lambda: _plain(lambda: attend(q, k, v, mask, 0.0))
    B, H = q.shape[:2]
    heads = lambda x: x.float().transpose(0, 1).reshape(H * B, x.size(2), x.size(3))  # noqa: E731
    paths["heads_attention"] = lambda: heads_attention(heads(q)[None], torch.stack([heads(k), heads(v)]), mask,
                                                       False).view(H, B, *q.shape[2:]).transpose(0, 1)
    paths["bfloat16_attention"] = lambda: bfloat16_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.0, False)
    paths["attend, bfloat16 over float32 keys"] = lambda: attend(q.bfloat16(), k.float(), v.float(), mask, 0.0)
    if native.library() is not None and q.size(-1) in native.HEAD_SIZES:
        paths["C kernel"] = lambda: native.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    return {name: path().float() for name, path in paths.items()}


def _plain(call):
    """call() with every CPU stand-in off (MTRAIN_CPU_FAST=0)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"MTRAIN_CPU_FAST": "0"}):
        return call()


@pytest.mark.fast_paths
@pytest.mark.parametrize("masking", ["none", "padding", "all keys"])
def test_every_attention_path_keeps_one_mask_rule(masking):
    """One rule for every path (mtrain.attention): True = may attend, broadcast over heads and
    queries; a query whose every key is masked gets zeros, never NaN. Each path agrees with
    PyTorch's float32 kernel to its precision (bfloat16 paths: a few bfloat16 roundings)."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 2, 32, generator=gen)
    k, v = (torch.randn(3, 4, 5, 32, generator=gen) for _ in range(2))
    mask = None
    if masking == "padding":
        mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] + [False] * 4])[:, None, None, :]
    elif masking == "all keys":
        mask = torch.tensor([[True] * 5, [False] * 5, [True] * 2 + [False] * 3])[:, None, None, :]
    outputs = _every_attention_path(q, k, v, mask)
    want = outputs.pop("sdpa")
    for name, got in outputs.items():
        assert not got.isnan().any(), name
        tolerance = 1e-5 if "bfloat16" not in name and "C kernel" not in name else 3e-2
        assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), name
        if masking == "all keys":
            assert torch.equal(got[1], torch.zeros_like(got[1])), name


def bf16_qkv(seed: int, shape=(3, 4, 9, 16)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).bfloat16().requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("masking", ["padding", "causal", "prefix"])
def test_bf16_attention_is_float32_attention_to_bfloat16_precision(masking):
    """bfloat16 q, k, v (training under autocast): the output and the gradients of q, k and v are
    PyTorch's float32 attention of the same values, to within bfloat16 rounding of the scores and
    the weights."""
    q, k, v = bf16_qkv(4)
    mask, causal = None, masking == "causal"
    if masking == "padding":
        mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4, [True] * 2 + [False] * 7])[:, None, None, :]
    elif masking == "prefix":  # 9 queries after 0 cached positions, as causal_mask builds it
        mask = torch.ones(9, 9, dtype=torch.bool).tril()
    got = attend(q, k, v, mask, 0.0, causal)
    assert got.dtype == torch.bfloat16
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, is_causal=causal)
    assert (got.float() - want).abs().max().item() < 0.05
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    got.backward(upstream.bfloat16())
    want.backward(upstream)
    for low, high in ((q, q32), (k, k32), (v, v32)):
        scale = high.grad.abs().max().item()
        assert (low.grad.float() - high.grad).abs().max().item() < 0.05 * scale


def test_bf16_attention_ignores_masked_keys_and_the_future_exactly():
    """Masked keys and values (padding) and later positions (causal) change nothing, bit for bit."""
    q, k, v = (x.detach() for x in bf16_qkv(6))
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4, [True] * 2 + [False] * 7])[:, None, None, :]
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 5:], v2[1, :, 5:], k2[2, :, 2:], v2[2, :, 2:] = 7.0, -7.0, 3.0, 3.0
    assert torch.equal(attend(q, k, v, mask, 0.0), attend(q, k2, v2, mask, 0.0))
    k3, v3 = k.clone(), v.clone()
    k3[:, :, 6:], v3[:, :, 6:] = 5.0, -5.0
    assert torch.equal(attend(q, k, v, None, 0.0, True)[:, :, :6], attend(q, k3, v3, None, 0.0, True)[:, :, :6])


@pytest.mark.parametrize("masking", ["padding", "causal", "cross"])
def test_heads_attention_is_sdpa_in_value_and_gradient(masking):
    """A packed CPU training step's attention (ops.heads_attention, on heads laid out heads before
    sentences) gives PyTorch's attention: values and the gradients of q, k and v, in float64 to
    1e-12; a row with every key masked gets zeros; and its backward passes gradcheck."""
    from mtrain.cpu.ops import heads_attention

    gen = torch.Generator().manual_seed(12)
    B, H, T, D = 3, 4, 9, 16
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    keys = 6 if masking == "cross" else T
    k, v = (torch.randn(B, H, keys, D, generator=gen, dtype=torch.float64) for _ in range(2))
    mask, causal, cross = None, masking == "causal", masking == "cross"
    if masking != "causal":  # the third row masks every key
        mask = torch.tensor([[True] * keys, [True] * 4 + [False] * (keys - 4), [False] * keys])[:, None, None, :]

    def heads(x: torch.Tensor) -> torch.Tensor:  # (B, H, n, D) -> (H * B, n, D)
        return x.transpose(0, 1).reshape(H * B, x.size(2), D)

    if cross:
        ours = [heads(q)[None].clone().requires_grad_(), torch.stack([heads(k), heads(v)]).requires_grad_()]
    else:
        ours = [torch.stack([heads(q), heads(k), heads(v)]).requires_grad_(), None]
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    got = heads_attention(*ours, mask, causal)
    want = heads(torch.nn.functional.scaled_dot_product_attention(*theirs, attn_mask=mask, is_causal=causal))
    if mask is not None:  # the third sentence's rows, one per head
        third = torch.arange(H * B) % B == 2
        assert (got[third] == 0).all()
        want = want.masked_fill(third[:, None, None], 0.0)  # whatever SDPA gives for nothing to attend to
    assert (got - want).abs().max().item() < 1e-12
    upstream = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got.backward(upstream)
    want.backward(upstream)
    grads = [*ours[0].grad[:1], *ours[1].grad] if cross else list(ours[0].grad)
    for ours_grad, reference in zip(grads, theirs):
        assert (ours_grad - heads(reference.grad)).abs().max().item() < 1e-12
    small_q = torch.randn(3, 4, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    small_mask = None if mask is None else torch.tensor([[True] * 5, [True] * 2 + [False] * 3])[:, None, None, :]
    assert torch.autograd.gradcheck(lambda x: heads_attention(x, None, small_mask, causal), [small_q])


@pytest.mark.parametrize("masking", ["padding", "causal", "cross"])
def test_bf16_heads_attention_is_bf16_attention_bit_for_bit(masking):
    """A packed bfloat16 step's attention (ops.heads_attention on the heads-before-sentences
    layout) does bfloat16_attention's arithmetic: the same bfloat16 matmuls around the same
    float32 softmax, forward and backward. Values and the gradients of q, k and v are equal bit
    for bit to autograd's through bfloat16_attention on the (B, H, T, d_head) grid."""
    from mtrain.cpu.ops import heads_attention

    gen = torch.Generator().manual_seed(14)
    heads, batch, length, d_head = 4, 3, 7, 8
    cross = masking == "cross"
    keys = 5 if cross else length
    q = torch.randn(1 if cross else 3, heads * batch, length, d_head, generator=gen).bfloat16().requires_grad_()
    kv = torch.randn(2, heads * batch, keys, d_head, generator=gen).bfloat16().requires_grad_()
    mask = None if masking == "causal" else torch.tensor(
        [[True] * keys, [True] * 3 + [False] * (keys - 3), [True] + [False] * (keys - 1)])[:, None, None, :]
    got = heads_attention(q, kv if cross else None, mask, masking == "causal")
    upstream = torch.randn(got.shape, generator=gen).bfloat16()
    got.backward(upstream)

    def grid(x: torch.Tensor) -> torch.Tensor:  # (H * B, n, d) -> a (B, H, n, d) leaf
        return x.detach().view(heads, batch, -1, d_head).transpose(0, 1).clone().requires_grad_()

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # (B, H, n, d) -> (H * B, n, d)
        return x.transpose(0, 1).reshape(heads * batch, -1, d_head)

    mine = [q[0], kv[0], kv[1]] if cross else list(q.unbind(0))
    theirs = [grid(x) for x in mine]
    want = bfloat16_attention(*theirs, mask, 0.0, masking == "causal")
    want.backward(upstream.view(heads, batch, length, d_head).transpose(0, 1))
    assert got.dtype == torch.bfloat16 and torch.equal(got, heads_first(want))
    grads = [q.grad[0], kv.grad[0], kv.grad[1]] if cross else list(q.grad.unbind(0))
    for ours, reference in zip(grads, theirs):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, heads_first(reference.grad))


def test_bf16_attention_dropout_drops_weights_in_training_only():
    q, k, v = (x.detach() for x in bf16_qkv(8, shape=(64, 4, 9, 16)))
    ones = torch.ones_like(v)  # each output = the sum of its row's kept weights
    torch.manual_seed(0)
    kept = attend(q, k, ones, None, 0.5)[..., 0].float()
    assert 0.3 < (kept < 0.9).float().mean().item() < 1.0  # rows lost some weight ...
    assert abs(kept.mean().item() - 1.0) < 0.05  # ... and the survivors are scaled by 1 / (1 - p)
    assert torch.allclose(attend(q, k, ones, None, 0.0)[..., 0].float(), torch.ones(64, 4, 9), atol=1e-2)


@pytest.mark.fast_paths
def test_bf16_cpu_dropout_scales_each_element_in_float32():
    """bf16 has no exact 1/0.9: kept elements are round_bf16(x * 32768/29491) (p rounded to
    3277/2^15), dropped ones 0, and the gradient is 0 exactly where the output was dropped."""
    torch.manual_seed(0)
    x = (torch.rand(400_000) + 0.5).bfloat16().requires_grad_()  # nonzero, so y == 0 means dropped
    y = Dropout(0.1).train()(x)
    assert y.dtype == torch.bfloat16
    kept = y != 0
    assert kept.float().mean().item() == pytest.approx(0.9, abs=0.005)
    scale = 32768 / (32768 - 3277)
    assert torch.equal(y[kept], (x.detach().float()[kept] * scale).bfloat16())
    y.float().sum().backward()
    assert torch.equal(x.grad == 0, ~kept)


@pytest.mark.fast_paths
def test_cpu_dropout_drops_p_of_every_position_and_keeps_the_mean():
    torch.manual_seed(0)
    x = torch.ones(400_000, requires_grad=True)
    y = Dropout(0.1).train()(x)
    kept = 1 / (1 - 3277 / 32768)  # p rounded to 3277 / 2^15
    assert torch.unique(y).tolist() == [0.0, pytest.approx(kept)]
    for k in range(4):  # each of the four 15-bit uniforms cut from one 64-bit draw
        assert (y[k::4] == 0).float().mean().item() == pytest.approx(0.1, abs=0.005)
    assert y.mean().item() == pytest.approx(1.0, abs=0.005)
    y.sum().backward()  # the gradient goes through the same mask
    assert torch.equal(x.grad, y.detach())
    assert torch.equal(Dropout(0.1).eval()(x), x)


def test_split_heads_gives_views_and_a_backward_in_the_projections_layout():
    """Q, K and V are views of the fused projection's output, head h of part i reading columns
    i * D + h * d_head onwards; their gradients land back in those columns, stacked by the
    backward without a second copy (no clone)."""
    from torch.profiler import ProfilerActivity, profile

    from mtrain.model import split_heads

    B, T, H, d_head = 2, 5, 2, 4
    y = torch.randn(B, T, 3 * H * d_head, requires_grad=True)
    parts = split_heads(y, 3, H)
    for i, part in enumerate(parts):
        assert part.shape == (B, H, T, d_head) and part.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        for h in range(H):
            start = (i * H + h) * d_head
            assert torch.equal(part[:, h], y[:, :, start:start + d_head])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sum((i + 1) * part for i, part in enumerate(parts)).sum().backward()
    expected = torch.cat([torch.full((B, T, H * d_head), float(i + 1)) for i in range(3)], dim=-1)
    assert torch.equal(y.grad, expected)
    assert not [e.name for e in prof.events() if e.name == "aten::clone"]
