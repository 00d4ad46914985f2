"""Greedy and beam search on token ids (no text). Both share the model's KV cache: the encoder runs
once per batch, cross-attention K/V once per sentence, and each step feeds only the newest token.

Conventions. Outputs never contain BOS or EOS. A sentence with `max_len[i] = n` gets at most n
tokens: at step n only EOS may follow (its log-probability still counts). Beam scores are
`sum log p(y_t) / lp(len)` with the GNMT penalty lp(len) = ((5 + len) / 6) ** alpha, where
len counts every scored token, EOS included: n tokens + EOS have len = n + 1.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from mtrain.kernels import NEG_INF, logsumexp_, topk_rows
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID


@runtime_checkable
class DecoderCache(Protocol):
    """What the searches do with a decoding cache (mtrain.cache.KVCache is the model's)."""

    def expand_beams(self, group: int) -> "DecoderCache":
        """After one step with one row per source: `group` identical beams per source."""

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Target row i becomes old row index[i]; cross=False: sources stay as they are."""


@runtime_checkable
class Decoder(Protocol):
    """What greedy and beam search need of a model. mtrain.model.Transformer, mtrain.ensemble.Ensemble
    and the scripted models of the tests all have it.

    `memory` is whatever encode returns; the searches only index its rows (memory[rows]) and pass
    it back to decode. decode takes (B, t) new target ids, returns (B, t, V) logits (or
    log-probabilities: a log_softmax of them changes nothing) and extends the cache by t tokens."""

    cfg: Any  # .max_len: the longest input the model takes

    def encode(self, src: Tensor) -> Any: ...

    def new_cache(self, group: int = 1) -> DecoderCache: ...

    def decode(self, tgt: Tensor, memory: Any, src: Tensor, cache: DecoderCache | None = None) -> Tensor: ...


def length_penalty(length: Tensor | int, alpha: float) -> Tensor:
    """GNMT length penalty (Wu et al. 2016, eq. 14): ((5 + len) / 6) ** alpha, as float32."""
    return ((5.0 + torch.as_tensor(length, dtype=torch.float32)) / 6.0) ** alpha


def topk_step(scores: Tensor, top: Tensor, top_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Best k extensions of each sentence's beams.

    scores (B, K) cumulative log-probs; top, top_ids (B, K, k') each beam's k' best next-token
    log-probs and ids -> (values (B, k) sorted descending, parent beam (B, k), token (B, k)).
    Only a beam's own best tokens can be among the sentence's best, so scores are added to K*k'
    candidates, not to K*V."""
    B, K, kk = top.shape
    values, flat = (scores.unsqueeze(-1) + top).view(B, K * kk).topk(k, dim=1)
    return values, flat // kk, top_ids.reshape(B, K * kk).gather(1, flat)


def next_token_topk(model: Decoder, tokens: Tensor, memory: Tensor, src: Tensor, cache, at_max: Tensor,
                    k: int) -> tuple[Tensor, Tensor]:
    """Feed one new token per row; the k most probable next tokens of each row: float32
    log-probs (N, k), best first, and their ids (N, k). PAD/BOS never, only EOS at max length.

    On a CPU, log_softmax over the whole vocabulary and then top-k cost more than the output
    projection. Here the logits are read twice (chunked top-k, then logsumexp in place) and never
    copied; the masking happens on the k + 2 best, which hold the k best other than PAD and BOS."""
    logits = model.decode(tokens.unsqueeze(1), memory, src, cache)[:, -1].float()
    eos = logits[:, EOS_ID].clone()
    top, ids = topk_rows(logits, min(k + 2, logits.size(1)))
    lse = logsumexp_(logits, peak=top[:, :1].clone())  # over every token; overwrites the logits
    top = top.sub_(lse).masked_fill_((ids == PAD_ID) | (ids == BOS_ID), NEG_INF)
    top, pick = top.topk(min(k, top.size(1)), dim=1)
    ids = ids.gather(1, pick)
    if at_max.any():  # only EOS may follow, with its own log-prob
        top[at_max] = NEG_INF
        top[at_max, 0] = (eos - lse.squeeze(1))[at_max]
        ids[at_max, 0] = EOS_ID
    return top, ids


def mask_scores(scores: Tensor, at_max: Tensor) -> Tensor:
    """In place on (N, V) logits or log-probs: PAD and BOS are never generated; rows at their
    maximum length (`at_max`, (N,) bool) may only end, and EOS keeps its own score there."""
    scores[:, PAD_ID] = NEG_INF
    scores[:, BOS_ID] = NEG_INF
    if at_max.any():
        eos = scores[:, EOS_ID].clone()
        scores.masked_fill_(at_max.unsqueeze(1), NEG_INF)
        scores[:, EOS_ID] = eos
    return scores


def _until_eos(row: list[int]) -> list[int]:
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


@torch.inference_mode()
def greedy_search(model: Decoder, src: Tensor, max_len: Tensor) -> list[list[int]]:
    """Most probable next token at each step. src (B, S) ids padded with PAD and ending in EOS;
    max_len (B,) maximum output lengths. Finished sentences leave the batch (and the cache)."""
    B = src.size(0)
    max_len = max_len.to(src.device)
    memory, cache = model.encode(src), model.new_cache()
    out = src.new_full((B, int(max_len.max()) + 1), EOS_ID)
    active = torch.arange(B, device=src.device)  # original index of each row still decoding
    tokens = src.new_full((B,), BOS_ID)
    for t in range(out.size(1)):
        at_max = max_len[active] <= t
        logits = model.decode(tokens.unsqueeze(1), memory, src, cache)[:, -1]
        tokens = mask_scores(logits.float(), at_max).argmax(dim=-1)  # log_softmax keeps the argmax
        out[active, t] = tokens
        going = tokens != EOS_ID
        if not going.any():
            break
        if not going.all():  # drop finished rows so later steps cost less
            keep = going.nonzero().squeeze(1)
            active, tokens, memory, src = active[keep], tokens[keep], memory[keep], src[keep]
            cache.reorder(keep)
    return [_until_eos(row) for row in out.tolist()]


@torch.inference_mode()
def beam_search(model: Decoder, src: Tensor, beam: int, lenpen: float, max_len: Tensor,
                nbest: int = 1) -> list[list[tuple[list[int], float]]]:
    """Beam search over a flattened (sentences x beam) batch. Returns per sentence the `nbest`
    best (ids, score) pairs, best first; scores are length-normalised (see the module docstring).

    Each step takes the 2*beam best extensions per sentence: EOS among the top `beam` finishes a
    hypothesis (its score is then frozen), the best `beam` others stay alive. A sentence is done
    when it has `beam` finished hypotheses that no alive one can beat, or at its max_len; done
    sentences leave the batch."""
    if not 1 <= nbest <= beam:
        raise ValueError(f"need 1 <= nbest <= beam, got nbest={nbest}, beam={beam}")
    B, K, device = src.size(0), beam, src.device
    max_len = max_len.to(device)
    steps = int(max_len.max()) + 1  # the last step can only add EOS
    memory = model.encode(src)
    # Step 0 feeds BOS once per sentence (all K beams would be the same prefix), so it starts from a
    # plain cache; expand_beams then makes rows b*K .. b*K+K-1 sentence b's beams, with one
    # cross-attention K/V per sentence.
    cache = model.new_cache()
    history = src.new_full((B * K, steps), EOS_ID)  # tokens of the alive hypotheses
    scores = src.new_zeros((B, 1), dtype=torch.float32)  # the one beam of step 0
    fin_scores = torch.full((B, K), NEG_INF, device=device)  # normalised, sorted descending
    fin_tokens = src.new_full((B, K, steps), EOS_ID)
    active = torch.arange(B, device=device)
    tokens = src.new_full((B,), BOS_ID)
    for t in range(steps):
        A = active.numel()
        at_max = max_len[active] <= t
        if t == 0:  # one beam: its 2K best tokens are the candidates
            top, ids = next_token_topk(model, tokens, memory, src, cache, at_max, 2 * K)
            cache = cache.expand_beams(K)
        else:  # K + 1 per beam hold the sentence's K best and its K best non-EOS (one EOS per beam)
            top, ids = next_token_topk(model, tokens, memory, src, cache, at_max.repeat_interleave(K), K + 1)
        values, parent, token = topk_step(scores, top.view(A, scores.size(1), -1), ids.view(A, scores.size(1), -1), 2 * K)
        parent += torch.arange(A, device=device).unsqueeze(1) * K  # flat row of each parent
        ended = (token[:, :K] == EOS_ID) & values[:, :K].isfinite()
        if ended.any():
            new = (values[:, :K] / length_penalty(t + 1, lenpen)).masked_fill(~ended, NEG_INF)
            candidates = history[parent[:, :K]]  # (A, K, steps); column t already holds EOS
            fin_scores[active], fin_tokens[active] = _merge(fin_scores[active], fin_tokens[active], new, candidates)
        scores, pick = values.masked_fill(token == EOS_ID, NEG_INF).topk(K, dim=1)
        parent, token = parent.gather(1, pick), token.gather(1, pick)
        done = (max_len[active] <= t) | (fin_scores[active, -1] >= _best_possible(scores, t, max_len[active], lenpen))
        if done.all():
            break
        keep = (~done).nonzero().squeeze(1)
        pruned = keep.numel() < A
        if pruned:  # drop done sentences: fewer rows for every later step
            active, scores, parent, token = active[keep], scores[keep], parent[keep], token[keep]
            memory, src = memory[keep], src[keep]
        rows = parent.flatten()
        # Moving beams within their sentence leaves the per-sentence cross-attention K/V as they
        # are; only dropping sentences has to touch them.
        cache.reorder(rows, cross=pruned)
        history = history[rows]
        tokens = token.flatten()
        history[:, t] = tokens
    return _results(fin_scores, fin_tokens, nbest)


def _merge(fin_scores: Tensor, fin_tokens: Tensor, new_scores: Tensor, new_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the K best of K finished + K new hypotheses per sentence, sorted by score."""
    K = fin_scores.size(1)
    merged, pick = torch.cat([fin_scores, new_scores], dim=1).topk(K, dim=1)
    tokens = torch.cat([fin_tokens, new_tokens], dim=1)
    return merged, tokens.gather(1, pick.unsqueeze(-1).expand(-1, -1, tokens.size(-1)))


def _best_possible(scores: Tensor, t: int, max_len: Tensor, lenpen: float) -> Tensor:
    """Upper bound (A,) on the final normalised score of any alive hypothesis after step t.

    Log-probs only fall as tokens are added, and a score <= 0 divided by lp(len) is largest for
    the largest lp over the lengths still reachable (t + 2 .. max_len + 1): lp is monotone in len."""
    lp = torch.maximum(length_penalty(t + 2, lenpen).to(scores.device), length_penalty(max_len + 1, lenpen))
    return scores[:, 0] / lp


def _results(fin_scores: Tensor, fin_tokens: Tensor, nbest: int) -> list[list[tuple[list[int], float]]]:
    scores, tokens = fin_scores[:, :nbest].tolist(), fin_tokens[:, :nbest].tolist()
    return [[(_until_eos(ids), score) for ids, score in zip(row_ids, row_scores)]
            for row_ids, row_scores in zip(tokens, scores)]
