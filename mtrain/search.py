"""Greedy search, beam search and sampling on token ids (no text). All share the model's KV cache:
the encoder runs once per batch, cross-attention K/V once per sentence, and each step feeds only
the newest token. All honour the same `Constraints`: a forced prefix per sentence, a maximum
length, and optionally no repeated n-gram.

Conventions. Outputs never contain BOS or EOS. A sentence with `max_len[i] = n` gets at most n
tokens: at step n only EOS may follow (its log-probability still counts). Beam scores are
`sum log p(y_t) / lp(len)` with the GNMT penalty lp(len) = ((5 + len) / 6) ** alpha, where
len counts every scored token, EOS included: n tokens + EOS have len = n + 1. A forced or banned
token does not renormalise the others: log p is always the model's own (as fairseq does it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from mtrain import splitmix
from mtrain.reductions import NEG_INF, PLAIN, Reductions, reductions_of
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID


@runtime_checkable
class DecoderCache(Protocol):
    """What the searches do with a decoding cache (mtrain.cache.KVCache is the model's)."""

    def expand_beams(self, group: int) -> "DecoderCache":
        """After one step with one row per source: `group` identical beams per source."""

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Target row i becomes old row index[i]; cross=False: sources stay as they are."""

    # Optional: reserve(length), room for `length` tokens per row before the first step (see reserve).


@runtime_checkable
class Decoder(Protocol):
    """What greedy and beam search need of a model. mtrain.model.Transformer, mtrain.ensemble.Ensemble
    and the scripted models of the tests all have it.

    `memory` is whatever encode returns; the searches only index its rows (memory[rows]) and pass
    it back to decode. decode takes (B, t) new target ids, returns (B, t, V) logits (or
    log-probabilities: a log_softmax of them changes nothing) and extends the cache by t tokens.
    A model that also has decode_states and project (Transformer, Ensemble) is projected to the vocabulary
    in blocks of rows instead (see step_logits)."""

    cfg: Any  # .max_len: the longest input the model takes

    def encode(self, src: Tensor) -> Any: ...

    def new_cache(self, group: int = 1) -> DecoderCache: ...

    def decode(self, tgt: Tensor, memory: Any, src: Tensor, cache: DecoderCache | None = None) -> Tensor: ...


NO_BANS = (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))


class Constraints:
    """What each sentence may produce at step t, besides what the model prefers: its forced prefix
    (PAD/BOS/EOS never inside it), EOS only once it reaches max_len (at least the prefix's length:
    the prefix counts toward the limit), and with no_repeat_ngram = n no n-gram twice."""

    def __init__(self, max_len: Tensor, prefixes: Sequence[Sequence[int]] | None = None,
                 no_repeat_ngram: int = 0) -> None:
        device = max_len.device
        lengths = [len(p) for p in prefixes] if prefixes is not None else []
        self.prefix_len = torch.tensor(lengths, dtype=torch.long, device=device) if lengths else None
        self.prefix = None
        if lengths and max(lengths) > 0:
            table = torch.full((len(lengths), max(lengths)), PAD_ID, dtype=torch.long)
            for row, ids in enumerate(prefixes):
                table[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
            self.prefix = table.to(device)
            max_len = torch.maximum(max_len, self.prefix_len)
        self.max_len = max_len
        self.no_repeat_ngram = no_repeat_ngram

    def forced(self, sentence: Tensor, t: int) -> Tensor:
        """(N,) the token each row (of the given sentences) must take at step t, or -1 if free."""
        forced = torch.where(self.max_len[sentence] <= t, EOS_ID, -1)
        if self.prefix is not None and t < self.prefix.size(1):
            forced = torch.where(self.prefix_len[sentence] > t, self.prefix[sentence, t], forced)
        return forced

    def bans(self, history: Tensor) -> tuple[Tensor, Tensor]:
        """(rows, tokens) that would repeat an n-gram of history (N, t), the tokens so far."""
        n, t = self.no_repeat_ngram, history.size(1)
        if n <= 0 or t < n:
            return NO_BANS[0].to(history.device), NO_BANS[1].to(history.device)
        windows = history.unfold(1, n, 1)  # (N, t - n + 1, n): every n-gram so far
        key = history[:, t - n + 1:]  # the last n - 1 tokens, which the next token would extend
        rows, starts = (windows[:, :, : n - 1] == key.unsqueeze(1)).all(dim=2).nonzero(as_tuple=True)
        return rows, windows[rows, starts, n - 1]


def restrict_(scores: Tensor, forced: Tensor, bans: tuple[Tensor, Tensor]) -> Tensor:
    """In place on (N, V) logits or log-probs: PAD and BOS are never generated, banned tokens
    neither; a row with a forced token (forced >= 0) may only take it, with its own score."""
    rows = (forced >= 0).nonzero().squeeze(1)
    keep = scores[rows, forced[rows]].clone()
    scores[:, PAD_ID] = NEG_INF
    scores[:, BOS_ID] = NEG_INF
    scores[bans] = NEG_INF
    if rows.numel():
        scores[rows] = NEG_INF
        scores[rows, forced[rows]] = keep
    return scores


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


# Rows of logits handled at once: 8 MiB of float32 (262 rows at an 8k vocabulary). One (N, V) array
# for all rows (44 MB at beam 5 x 273 sentences) is a fresh mapping at every step whose pages fault
# in (10 ms of 14 for its float32 upcast alone, 1365 x 8000 on 2 cores); small blocks pay the
# per-op cost of the projection, top-k and logsumexp many times over. On the 2-core AMX host, with
# a bfloat16 model: 4 to 16 MiB decoded greedy 15% and beam 5 7% faster than 2 MiB, 64 MiB beam 5
# 9% slower (benchmarks/decode.py's batches).
BLOCK_BYTES = 2 ** 23


class Float32Blocks:
    """One float32 buffer that a search upcasts every block of a bfloat16 model's logits into, step
    after step. A fresh 5-10 MB float32 block per step is memory whose pages fault in again (the
    copy took 1.1 ms in place of 0.14 ms for 154 x 8000); reusing one buffer decoded bfloat16
    greedy 1.08-1.10x and beam 5 1.03-1.05x as fast (2-core AMX host, benchmarks/results/intel-xeon-amx/NOTES.md). Float32
    blocks pass through as they are."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None

    def upcast(self, block: Tensor) -> Tensor:
        if block.dtype == torch.float32:
            return block
        n = block.numel()
        if self.buffer is None or self.buffer.numel() < n or self.buffer.device != block.device:
            self.buffer = torch.empty(n, dtype=torch.float32, device=block.device)
        return self.buffer[:n].view(block.shape).copy_(block)


def step_logits(model: Decoder, tokens: Tensor, memory: Any, src: Tensor, cache,
                blocks: Float32Blocks | None = None, bfloat16: bool = False) -> Iterator[tuple[int, Tensor]]:
    """Feed one new token per row; yield (first row, float32 logits (n, V) of rows first..first+n-1),
    block after block. The blocks are the caller's to overwrite, until it asks for the next one (with
    `blocks`, each is upcast into that one buffer; with bfloat16, a bfloat16 block comes as it is
    where the model's reductions take it so: Reductions.keeps_bfloat16). A model with decode_states
    and project runs the decoder once and the output projection block by block; any other, one block
    of all rows."""
    tgt = tokens.unsqueeze(1)
    if not projects_in_blocks(model):
        yield 0, model.decode(tgt, memory, src, cache)[:, -1].float()
        return
    upcast = blocks.upcast if blocks is not None else Tensor.float
    if bfloat16:
        upcast = _float_unless_kept(upcast, reductions_of(model))
    for first, logits in projected_blocks(model, model.decode_states(tgt, memory, src, cache)[:, -1]):
        yield first, upcast(logits)


def _float_unless_kept(upcast, reductions: Reductions):
    """upcast, except for the bfloat16 blocks the reductions take as they are (asked only when one
    comes: float32 decoding never asks)."""
    def cast(block: Tensor) -> Tensor:
        kept = block.dtype == torch.bfloat16 and reductions.keeps_bfloat16(block)
        return block if kept else upcast(block)

    return cast


def projects_in_blocks(model: Any) -> bool:
    """Whether the model splits decode into decode_states and project (Transformer, Ensemble)."""
    return hasattr(model, "decode_states") and hasattr(model, "project")


def projected_blocks(model: Any, states: Any) -> Iterator[tuple[int, Tensor]]:
    """(first row, the model's logits of rows first..first+n-1) for (N, d_model) states, a block of
    at most BLOCK_BYTES of float32 logits at a time."""
    rows = max(1, BLOCK_BYTES // (4 * model.cfg.vocab_size))
    for first in range(0, states.size(0), rows):
        yield first, model.project(states[first : first + rows])


def bans_in(bans: tuple[Tensor, Tensor], first: int, n: int) -> tuple[Tensor, Tensor]:
    """The (rows, tokens) bans of rows first..first+n-1, rows counted from first."""
    rows, tokens = bans
    if not rows.numel():
        return bans
    inside = (rows >= first) & (rows < first + n)
    return rows[inside] - first, tokens[inside]


def next_token_topk(model: Decoder, tokens: Tensor, memory: Tensor, src: Tensor, cache, forced: Tensor,
                    k: int, bans: tuple[Tensor, Tensor] = NO_BANS,
                    blocks: Float32Blocks | None = None) -> tuple[Tensor, Tensor]:
    """Feed one new token per row; the k most probable next tokens of each row: float32
    log-probs (N, k), best first, and their ids (N, k). PAD/BOS and banned tokens never; a row
    with forced[row] >= 0 gets that token alone (the others -inf). Rows are handled in blocks
    (step_logits); each row's result depends on that row alone. A bfloat16 model's blocks stay
    bfloat16 where its reductions take them so (topk_of_logits)."""
    tops, ids = [], []
    reductions = reductions_of(model)
    for first, logits in step_logits(model, tokens, memory, src, cache, blocks, bfloat16=True):
        n = logits.size(0)
        top, top_ids = topk_of_logits(logits, forced[first : first + n], k, bans_in(bans, first, n), reductions)
        tops.append(top)
        ids.append(top_ids)
    return (tops[0], ids[0]) if len(tops) == 1 else (torch.cat(tops), torch.cat(ids))


def topk_of_logits(logits: Tensor, forced: Tensor, k: int, bans: tuple[Tensor, Tensor],
                   reductions: Reductions = PLAIN) -> tuple[Tensor, Tensor]:
    """next_token_topk on one block of (n, V) float32 or bfloat16 logits, which it overwrites.

    On a CPU, log_softmax over the whole vocabulary and then top-k cost more than the output
    projection. Here the logits are never normalised: the k + 2 best and the row's log-sum-exp
    (Reductions.topk_logsumexp) are all it takes, and the masking happens on the k + 2 best, which
    hold the k best other than PAD and BOS. Banned tokens leave the top-k as -inf logits; the
    normaliser still counts them."""
    rows = (forced >= 0).nonzero().squeeze(1)
    kept = logits[rows, forced[rows]].float()  # indexing copies: the logits are overwritten below
    banned = logits[bans].float()
    logits[bans] = NEG_INF
    top, ids, lse = reductions.topk_logsumexp(logits, min(k + 2, logits.size(1)))
    if banned.numel():
        lse = _add_to_normaliser(lse, bans[0], banned)
    top = top.sub_(lse).masked_fill_((ids == PAD_ID) | (ids == BOS_ID), NEG_INF)
    top, pick = top.topk(min(k, top.size(1)), dim=1)
    ids = ids.gather(1, pick)
    if rows.numel():  # only the forced token may follow, with its own log-prob
        top[rows] = NEG_INF
        top[rows, 0] = kept - lse[rows].squeeze(1)
        ids[rows, 0] = forced[rows]
    return top, ids


def _add_to_normaliser(lse: Tensor, rows: Tensor, values: Tensor) -> Tensor:
    """(N, 1) log sum exp of each row, with logits `values` (of rows `rows`) added to its sum.
    Rows without any are returned unchanged, bit for bit."""
    lse = lse.squeeze(1)
    shift = lse.scatter_reduce(0, rows, values, "amax")  # per row max(lse, its values): exp cannot overflow
    total = (lse - shift).exp().index_add_(0, rows, (values - shift[rows]).exp())
    return (shift + total.log()).unsqueeze(1)


def _until_eos(row: list[int]) -> list[int]:
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


@torch.inference_mode()
def greedy_search(model: Decoder, src: Tensor, max_len: Tensor, prefixes: Sequence[Sequence[int]] | None = None,
                  no_repeat_ngram: int = 0) -> list[list[int]]:
    """Most probable next token at each step. src (B, S) ids padded with PAD and ending in EOS;
    max_len (B,) maximum output lengths; prefixes, no_repeat_ngram: see Constraints. Finished
    sentences leave the batch (and the cache)."""
    return [ids for ids, _ in _decode_token_by_token(model, src, Constraints(max_len.to(src.device), prefixes,
                                                                             no_repeat_ngram), pick=None)]


@dataclass(frozen=True)
class Sampling:
    """How sampling draws each token: from softmax(logits / temperature), cut to the `topk` most
    probable (0 = all) and to the smallest most-probable set whose probability reaches `topp`."""

    topk: int = 0
    topp: float = 1.0
    temperature: float = 1.0


@torch.inference_mode()
def sample(model: Decoder, src: Tensor, max_len: Tensor, sampling: Sampling, streams: Sequence[int],
           prefixes: Sequence[Sequence[int]] | None = None, no_repeat_ngram: int = 0) -> list[tuple[list[int], float]]:
    """One sample per row: (ids, sum of the model's log-probabilities of its tokens and EOS).

    Row i's random numbers come from its own counter-based stream (streams[i], a 64-bit id, and
    the step), never from a shared generator: a row's sample does not depend on which other rows
    share its batch, how many there are, or in which order they come."""
    keys = torch.as_tensor(np.asarray(streams, dtype=np.uint64).view(np.int64), device=src.device)

    def pick(scores: Tensor, rows: Tensor, t: int) -> Tensor:
        return draw(scores, uniforms(keys[rows], t), sampling)

    return _decode_token_by_token(model, src, Constraints(max_len.to(src.device), prefixes, no_repeat_ngram), pick)


def _decode_token_by_token(model: Decoder, src: Tensor, rules: Constraints, pick) -> list[tuple[list[int], float]]:
    """Greedy search (pick None: the most probable token) or sampling (pick(scores, rows, t) draws
    a token per row), one token per step. Returns per sentence (ids, sum of log-probs); greedy
    leaves the sum at 0.0 (it never needs a log_softmax). Finished sentences leave the batch (in
    steps of row_sizes: until then a finished row feeds EOS and its results are ignored)."""
    B = src.size(0)
    memory, cache = model.encode(src), model.new_cache()
    out = src.new_full((B, int(rules.max_len.max()) + 1), EOS_ID)
    reserve(cache, out.size(1))
    logprob = torch.zeros(B, dtype=torch.float64, device=src.device)
    active = torch.arange(B, device=src.device)  # original index of each row
    ended = torch.zeros(B, dtype=torch.bool, device=src.device)  # per row: its sentence has its EOS
    tokens = src.new_full((B,), BOS_ID)
    blocks, sizes = Float32Blocks(), row_sizes(model, src.device)
    reductions = reductions_of(model)
    fused = pick is None  # bfloat16 blocks for the argmax; sampling's log_softmax wants float32
    for t in range(out.size(1)):
        forced, bans = rules.forced(active, t), rules.bans(out[active, :t])
        picked = []
        for first, logits in step_logits(model, tokens, memory, src, cache, blocks, bfloat16=fused):
            n = logits.size(0)
            rows = active[first : first + n]
            full = None if pick is None else torch.log_softmax(logits, dim=-1)  # the model's own, for the score
            scores = restrict_(logits, forced[first : first + n], bans_in(bans, first, n))
            chosen = reductions.argmax(scores) if pick is None else pick(scores, rows, t)  # log_softmax keeps the argmax
            if full is not None:
                gained = full.gather(1, chosen.unsqueeze(1)).squeeze(1).double()
                logprob[rows] += gained.masked_fill_(ended[first : first + n], 0.0)
            picked.append(chosen)
        tokens = (picked[0] if len(picked) == 1 else torch.cat(picked)).masked_fill_(ended, EOS_ID)
        out[active, t] = tokens  # an ended row writes EOS after its EOS, which _until_eos cuts
        ended = tokens == EOS_ID
        if ended.all():
            break
        keep = rows_to_keep(ended, sizes)
        if keep is not None:  # drop finished rows so later steps cost less
            active, tokens, ended, memory, src = active[keep], tokens[keep], ended[keep], memory[keep], src[keep]
            cache.reorder(keep)
    return [(_until_eos(row), score) for row, score in zip(out.tolist(), logprob.tolist())]


# The most steps a search reserves cache room for; longer outputs grow the cache by doubling from
# there. Positions never written cost address space rather than memory, since the kernel maps a page
# when it is first written: a 438 MB buffer for 224 positions, 25 of them written, added 65 MB to
# the resident set. The bound keeps a max_len far beyond the sentences (a large decode.max_len_b)
# from reserving address space without limit.
MAX_RESERVED = 256


def reserve(cache, steps: int) -> None:
    """Tell a cache that can be told (mtrain.cache.KVCache.reserve) how many steps a search may
    take, up to MAX_RESERVED."""
    if hasattr(cache, "reserve"):
        cache.reserve(min(steps, MAX_RESERVED))


def rows_to_keep(done: Tensor, sizes) -> Tensor | None:
    """The rows (or sentences) to go on with when the `done` ones may leave: every other one, then
    done ones up to sizes(others); None when that is all of them."""
    going = (~done).nonzero().squeeze(1)
    size = sizes(going.numel())
    if size >= done.numel():
        return None
    return torch.cat([going, done.nonzero().squeeze(1)[: size - going.numel()]])


def kept_rows(n: int) -> int:
    """How many rows a search keeps for n unfinished ones where new shapes are costly (see
    row_sizes): n rounded up to a multiple of 2^(floor(log2 n) - 3), so at most 1/8 more (n itself
    below 16), and at most 8 row counts per doubling."""
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


def row_sizes(model: Any, device: torch.device):
    """The rows a search keeps for n unfinished ones: kept_rows where the model's matmuls are
    bfloat16 on a CPU, otherwise n (exact_rows).

    There they run through oneDNN, which compiles a kernel for each new shape (~1 ms) and keeps
    1024. Dropping each finished row at once gave the matmuls a new row count at nearly every step:
    translating 6000 lines with bfloat16 weights made ~1000 new kernels in every pass, and each
    pass took 1.4x as long as with kept_rows (2-core AMX host, benchmarks/results/intel-xeon-amx/NOTES.md). Float32 on a
    CPU has no such cache, and there the kept rows cost up to 1/8 more work: a float32 greedy run
    of the same lines took 8% longer with them."""
    bfloat16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    bfloat16 = bfloat16 or weights_dtype(model) == torch.bfloat16
    return kept_rows if device.type == "cpu" and bfloat16 else exact_rows


def exact_rows(n: int) -> int:
    """n itself: every finished row leaves at once."""
    return n


def stream_key(seed: int, line: int, sample: int) -> int:
    """The 64-bit id of one sample's random stream: SplitMix64's finalizer over (seed, line, sample)."""
    key = 0
    for part in (seed, line, sample):
        key = splitmix.mix_int((key ^ part) + splitmix.GAMMA)
    return key


def uniforms(keys: Tensor, t: int) -> Tensor:
    """(N,) float64 uniforms on [0, 1), a pure function of (key, t): SplitMix64 (Steele et al. 2014)
    of the key advanced by t + 1 golden-ratio increments, top 53 bits."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2^64, as SplitMix64 wants
        z = splitmix.mix(keys.cpu().numpy().view(np.uint64) + np.uint64((t + 1) * splitmix.GAMMA & splitmix.MASK))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53).to(keys.device)


def draw(scores: Tensor, u: Tensor, sampling: Sampling) -> Tensor:
    """(N,) tokens drawn by inverse transform with uniforms u from the rows of (N, V) restricted
    logits, after temperature, top-k and top-p (module Sampling). Ties sort by token id, so
    topk 1 picks exactly greedy's argmax."""
    probs = torch.softmax(scores.double() / sampling.temperature, dim=-1)
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if sampling.topk > 0:
        probs[:, sampling.topk:] = 0.0
    if sampling.topp < 1.0:  # keep a token while the ones before it sum to less than p (the first always)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= sampling.topp, 0.0)
    cdf = probs.cumsum(dim=-1)
    index = (cdf < u.unsqueeze(1) * cdf[:, -1:]).sum(dim=1).clamp_(max=probs.size(1) - 1)
    return order.gather(1, index.unsqueeze(1)).squeeze(1)


@torch.inference_mode()
def beam_search(model: Decoder, src: Tensor, beam: int, lenpen: float, max_len: Tensor, nbest: int = 1,
                prefixes: Sequence[Sequence[int]] | None = None,
                no_repeat_ngram: int = 0) -> list[list[tuple[list[int], float]]]:
    """Beam search over a flattened (sentences x beam) batch. Returns per sentence the `nbest`
    best (ids, score) pairs, best first; scores are length-normalised (see the module docstring).

    Each step takes the 2*beam best extensions per sentence: EOS among the top `beam` finishes a
    hypothesis (its score is then frozen), the best `beam` others stay alive. A sentence is done
    when it has `beam` finished hypotheses that no alive one can beat, or at its max_len; done
    sentences leave the batch (in steps of row_sizes: until then their rows run on, and nothing
    they find is kept). Within a forced prefix only one extension is finite, so the sentence keeps
    one live beam until the prefix ends."""
    if not 1 <= nbest <= beam:
        raise ValueError(f"need 1 <= nbest <= beam, got nbest={nbest}, beam={beam}")
    B, K, device = src.size(0), beam, src.device
    rules = Constraints(max_len.to(device), prefixes, no_repeat_ngram)
    max_len = rules.max_len
    steps = int(max_len.max()) + 1  # the last step can only add EOS
    memory = model.encode(src)
    # Step 0 feeds BOS once per sentence (all K beams would be the same prefix), so it starts from a
    # plain cache; expand_beams then makes rows b*K .. b*K+K-1 sentence b's beams, with one
    # cross-attention K/V per sentence.
    cache = model.new_cache()
    reserve(cache, steps)
    history = src.new_full((B * K, steps), EOS_ID)  # tokens of the alive hypotheses
    scores = src.new_zeros((B, 1), dtype=torch.float32)  # the one beam of step 0
    fin_scores = torch.full((B, K), NEG_INF, device=device)  # normalised, sorted descending
    fin_tokens = src.new_full((B, K, steps), EOS_ID)
    active = torch.arange(B, device=device)
    gone = torch.zeros(B, dtype=torch.bool, device=device)  # per sentence: done, kept only to keep the size
    tokens = src.new_full((B,), BOS_ID)
    blocks, sizes = Float32Blocks(), row_sizes(model, device)
    for t in range(steps):
        A = active.numel()
        if t == 0:  # one beam: its 2K best tokens are the candidates
            top, ids = next_token_topk(model, tokens, memory, src, cache, rules.forced(active, t), 2 * K,
                                       blocks=blocks)
            cache = cache.expand_beams(K)
        else:  # K + 1 per beam hold the sentence's K best and its K best non-EOS (one EOS per beam)
            forced = rules.forced(active.repeat_interleave(K), t)
            top, ids = next_token_topk(model, tokens, memory, src, cache, forced, K + 1, rules.bans(history[:, :t]),
                                       blocks=blocks)
        values, parent, token = topk_step(scores, top.view(A, scores.size(1), -1), ids.view(A, scores.size(1), -1), 2 * K)
        parent += torch.arange(A, device=device).unsqueeze(1) * K  # flat row of each parent
        ended = (token[:, :K] == EOS_ID) & values[:, :K].isfinite() & ~gone.unsqueeze(1)
        if ended.any():
            new = (values[:, :K] / length_penalty(t + 1, lenpen)).masked_fill(~ended, NEG_INF)
            candidates = history[parent[:, :K]]  # (A, K, steps); column t already holds EOS
            fin_scores[active], fin_tokens[active] = _merge(fin_scores[active], fin_tokens[active], new, candidates)
        scores, pick = values.masked_fill(token == EOS_ID, NEG_INF).topk(K, dim=1)
        parent, token = parent.gather(1, pick), token.gather(1, pick)
        done = gone | (max_len[active] <= t) | (fin_scores[active, -1] >= _best_possible(scores, t, max_len[active], lenpen))
        if done.all():
            break
        keep, gone = rows_to_keep(done, sizes), done
        pruned = keep is not None
        if pruned:  # drop done sentences: fewer rows for every later step
            active, scores, parent, token, gone = active[keep], scores[keep], parent[keep], token[keep], gone[keep]
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
    """The nbest finished hypotheses per sentence. A sentence with fewer possible outputs than
    nbest (a forced prefix as long as its max_len has one) fills the rest with ([], -inf)."""
    scores, tokens = fin_scores[:, :nbest].tolist(), fin_tokens[:, :nbest].tolist()
    return [[(_until_eos(ids) if score > NEG_INF else [], score) for ids, score in zip(row_ids, row_scores)]
            for row_ids, row_scores in zip(tokens, scores)]


def weights_dtype(model) -> torch.dtype | None:
    """The dtype of a model's (an ensemble's first member's) weights; None for an exported engine."""
    member = (getattr(model, "models", None) or [model])[0]
    embed = getattr(member, "tgt_embed", None)
    return None if embed is None else embed.weight.dtype
