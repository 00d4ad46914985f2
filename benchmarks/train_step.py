"""Training speed side by side: forward + backward + Adam step of mtrain, a `torch.nn.Transformer`
build and Hugging Face `MarianMTModel` at one shape on the same token batches, plus the machine's
fp32 matmul peak measured in the same run. A table goes to stderr; `--json` prints one JSON object.

    python benchmarks/train_step.py --quick --json

Throughput is real (non-pad) target tokens per second, wall clock. GFLOP/s counts the matmuls
actually run (see train_flops), so "of peak" is the hardware efficiency. Why it sits well below
the 2048^3 matmul peak on a CPU: this model's matmuls are skinny (inner size 256), which BLAS runs
at roughly half its square-matrix rate; and about half of a step is not matmuls: dropout masks
(random number generation), log-softmax over N x vocab, attention over ~15-token sequences,
LayerNorm, bias and embedding gradients, Adam.

Each model trains in a process of its own, one round at a time, the models taking turns round by
round, so load from other processes on a shared machine falls on all of them alike. Sharing one
process biased the comparison: on the 2-core AMX host `nn.Transformer`, taking turns batch by batch
with mtrain, took 1.32-2.46 s for batches it takes in 1.26-1.38 s alone, while mtrain stayed within
6 % of its own speed alone. `--together` keeps the one-process, batch-by-batch order.

Every process keeps freed memory on the heap as `mtrain train` does (mtrain.memory.
reuse_freed_memory), the peers' included, so all models run on the same allocator settings and
the ratios compare the models' code alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from mtrain.cpu import mkl

mkl.enable()  # before torch, as the CLI does: every model here multiplies with the same MKL

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from mtrain.config import ModelConfig
from mtrain.data import make_batches
from mtrain.hardware import cpu_has_native_bf16, machine_record
from mtrain.loss import Objective
from mtrain.memory import reuse_freed_memory
from mtrain.cpu.model import accelerate
from mtrain.model import Transformer, sinusoids

try:
    from mtrain.cpu.packing import Packing
except ImportError:  # an older mtrain on PYTHONPATH, for before/after runs: its step ran padded
    Packing = None

ROOT = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = 0, 2, 3
LABEL_SMOOTHING = 0.1
Batch = tuple[Tensor, Tensor, Tensor]  # src, tgt_in, tgt_out, padded with PAD
SHAPES = {  # --shape: the Multi30k recipe's model, and the paper's base model with a 32k vocabulary
    "small": ModelConfig(d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                         vocab_size=8000, dropout=0.1),
    "base": ModelConfig(d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                        vocab_size=32000, dropout=0.1),
}


# ---------------------------------------------------------------- the data: real lengths, random ids

def sample_lengths(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Source/target lengths (without EOS) of n sentence pairs: subword lengths from a tokenized
    Multi30k folder if one exists, else whitespace-token lengths of raw Multi30k train (a subword
    vocabulary makes them ~10-30% longer), else synthetic 13 +- 4."""
    rng = np.random.default_rng(seed)
    for folder in sorted(ROOT.glob("data/*")) + sorted(ROOT.parent.glob("shared/corpora/*")):
        if (folder / "train.src.offsets.npy").is_file() and (folder / "train.tgt.offsets.npy").is_file():
            src = np.diff(np.load(folder / "train.src.offsets.npy"))
            tgt = np.diff(np.load(folder / "train.tgt.offsets.npy"))
            pick = rng.choice(len(src), size=n, replace=len(src) < n)
            return src[pick], tgt[pick], f"subword lengths of {folder.relative_to(ROOT.parent)}"
    for folder in (ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"):
        if (folder / "train.de").is_file():
            de = [len(line.split()) for line in (folder / "train.de").read_text(encoding="utf-8").splitlines()]
            en = [len(line.split()) for line in (folder / "train.en").read_text(encoding="utf-8").splitlines()]
            pick = rng.choice(len(de), size=n, replace=len(de) < n)
            return np.maximum(np.asarray(de)[pick], 1), np.maximum(np.asarray(en)[pick], 1), \
                f"whitespace lengths of {folder.relative_to(ROOT.parent)}/train.de-en"
    src = np.clip(rng.normal(13, 4, n).round(), 1, None).astype(np.int64)
    tgt = np.clip(src + rng.integers(-2, 3, n), 1, None)
    return src, tgt, "synthetic 13 +- 4"


def to_batch(src_lens: np.ndarray, tgt_lens: np.ndarray, vocab: int, gen: torch.Generator) -> Batch:
    """Random ids at the given lengths, laid out as mtrain.data.collate does."""
    B = len(src_lens)
    src = torch.full((B, int(src_lens.max()) + 1), PAD)
    tgt_in = torch.full((B, int(tgt_lens.max()) + 1), PAD)
    tgt_out = tgt_in.clone()
    for i, (s, t) in enumerate(zip(src_lens, tgt_lens)):
        src[i, :s] = torch.randint(4, vocab, (s,), generator=gen)
        src[i, s] = EOS
        words = torch.randint(4, vocab, (t,), generator=gen)
        tgt_in[i, 0], tgt_in[i, 1:t + 1] = BOS, words
        tgt_out[i, :t], tgt_out[i, t] = words, EOS
    return src, tgt_in, tgt_out


def bucketed_batches(src_lens, tgt_lens, max_tokens: int, n: int, vocab: int, seed: int) -> list[Batch]:
    """n of mtrain's own length-bucketed batches (mtrain.data.make_batches), skipping the few tiny
    ones at the length extremes so every timed batch is near the token budget."""
    index_batches = make_batches(src_lens, tgt_lens, max_tokens, seed=seed, epoch=0)
    cost = lambda b: len(b) * (max(src_lens[b].max(), tgt_lens[b].max()) + 1)  # noqa: E731
    full = [b for b in index_batches if cost(b) >= 0.9 * max_tokens]
    gen = torch.Generator().manual_seed(seed)
    return [to_batch(src_lens[b], tgt_lens[b], vocab, gen) for b in full[:n]]


def random_batches(src_lens, tgt_lens, max_tokens: int, n: int, vocab: int, seed: int) -> list[Batch]:
    """Batches in corpus order (no bucketing) under the same budget rule: what a plain DataLoader
    with a token budget gives, padding each batch to its longest sentence."""
    gen = torch.Generator().manual_seed(seed)
    batches, start = [], 0
    while len(batches) < n and start < len(src_lens):
        end = start + 1
        while end < len(src_lens):
            longest = max(src_lens[start:end + 1].max(), tgt_lens[start:end + 1].max()) + 1
            if (end + 1 - start) * longest > max_tokens:
                break
            end += 1
        batches.append(to_batch(src_lens[start:end], tgt_lens[start:end], vocab, gen))
        start = end
    return batches


# ---------------------------------------------------------------- the three models, one step each

class TorchTransformer(nn.Module):
    """The usual `torch.nn.Transformer` build (the PyTorch tutorial's): embeddings * sqrt(d_model)
    + sinusoids, post-norm nn.Transformer with padding and causal masks, vocabulary projection at
    every position. Embeddings and projection are tied three ways as in mtrain, so both have the
    same parameters and matmuls."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.d_model ** -0.5)  # as mtrain: unit-scale logits
        self.register_buffer("pe", sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        self.scale, self.dropout = math.sqrt(cfg.d_model), nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers,
                                          cfg.d_ff, cfg.dropout, batch_first=True, norm_first=False)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        x = self.dropout(self.embed(src) * self.scale + self.pe[:src.shape[1]])
        y = self.dropout(self.embed(tgt_in) * self.scale + self.pe[:tgt_in.shape[1]])
        T = tgt_in.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).triu(1)  # True = blocked (nn.MultiheadAttention)
        states = self.transformer(x, y, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src == PAD,
                                  tgt_key_padding_mask=tgt_in == PAD, memory_key_padding_mask=src == PAD)
        return states @ self.embed.weight.T  # (B, T, V)


def full_logits_loss(logits: Tensor, tgt_out: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD,
                           label_smoothing=LABEL_SMOOTHING, reduction="sum")


def mtrain_step_fn(cfg: ModelConfig, compile_: bool) -> tuple[Callable[[Batch], Tensor], nn.Module]:
    model = accelerate(Transformer(cfg)).train()  # the CPU training version `mtrain train` runs (mtrain.cpu.model)
    objective = Objective(model, LABEL_SMOOTHING)  # what `mtrain train` runs: projection at real positions only
    if compile_:
        objective = torch.compile(objective, dynamic=True)
    return lambda b: objective(*b)[0], model


def mtrain_optimizer(model: nn.Module, device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    """The Adam `mtrain train` makes on `device` (fused); an mtrain without that choice (an older
    checkout on PYTHONPATH, for before/after runs) made the default one, as the peers do."""
    try:
        from mtrain.trainer import new_optimizer
    except ImportError:
        return torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    settings = argparse.Namespace(adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-9, weight_decay=0.0)
    optimizer = new_optimizer(model, settings, device)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    return optimizer


def nn_step_fn(cfg: ModelConfig) -> tuple[Callable[[Batch], Tensor], nn.Module]:
    model = TorchTransformer(cfg).train()
    return lambda b: full_logits_loss(model(b[0], b[1]), b[2]), model


def marian_step_fn(cfg: ModelConfig) -> tuple[Callable[[Batch], Tensor], nn.Module] | None:
    try:
        from transformers import MarianConfig, MarianMTModel
    except ImportError:
        return None
    config = MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.n_encoder_layers, decoder_layers=cfg.n_decoder_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function="relu",
        dropout=cfg.dropout, attention_dropout=0.0, activation_dropout=cfg.dropout,
        max_position_embeddings=cfg.max_len, scale_embedding=True, pad_token_id=PAD,
        decoder_start_token_id=BOS, eos_token_id=EOS, forced_eos_token_id=EOS,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    model = MarianMTModel(config).train()  # post-norm, sinusoidal positions, SDPA attention

    def loss(b: Batch) -> Tensor:
        src, tgt_in, tgt_out = b
        out = model(input_ids=src, attention_mask=src != PAD, decoder_input_ids=tgt_in,
                    decoder_attention_mask=tgt_in != PAD, use_cache=False)
        return full_logits_loss(out.logits, tgt_out)

    return loss, model


# ---------------------------------------------------------------- measuring

def matmul_peak_gflops(n: int = 2048, reps: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """Best GFLOP/s of an n x n x n torch.matmul (2 n^3 FLOPs) in dtype: the practical ceiling here."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up the BLAS threads
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def train_flops(batch: Batch, cfg: ModelConfig, as_mtrain: bool) -> float:
    """Matmul FLOPs of one training step as run, counted explicitly: 2*m*n*k per (m x k) @ (k x n)
    product; backward does two products per forward one, so a step is 3 x forward. The peers'
    linear layers and projection run on the padded shapes; mtrain's linear layers on the packed
    rows (mtrain.cpu.packing; padded in a checkout without it) and its projection on the real target
    positions. Attention counts the full S x S (T x T) score and value products. Element-wise work
    (softmax, LayerNorm, dropout, Adam) is not counted: it is memory-bound and small next to the
    matmuls."""
    src, tgt_in, tgt_out = batch
    (B, S), T = src.shape, tgt_in.shape[1]
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    enc_tokens, dec_tokens = B * S, B * T
    if as_mtrain and Packing is not None:
        enc_tokens, dec_tokens = (Packing.of(ids, PAD).index.numel() for ids in (src, tgt_out))
    encoder = 2 * enc_tokens * (4 * d * d + 2 * d * f) + 4 * B * S * S * d  # QKV+out, FFN; QK^T and AV
    decoder = (2 * dec_tokens * (6 * d * d + 2 * d * f)  # self QKV+out, cross Q+out, FFN
               + 2 * enc_tokens * 2 * d * d  # cross-attention K, V from the memory
               + 4 * B * T * T * d + 4 * B * T * S * d)  # self and cross attention products
    projected = int((tgt_out != PAD).sum()) if as_mtrain else dec_tokens
    forward = cfg.n_encoder_layers * encoder + cfg.n_decoder_layers * decoder + 2 * projected * d * V
    return 3.0 * forward


def time_models(steps: dict[str, tuple[Callable, nn.Module, list[Batch]]], rounds: int, warmup: int,
                bf16: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Seconds of each step, (rounds, batches) per model; the models named in bf16 run under
    bfloat16 autocast. Models take turns batch by batch, so load from other processes on a shared
    machine hits all of them alike."""
    optimizers = {name: (mtrain_optimizer(model) if name.startswith("mtrain") else
                         torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9))
                  for name, (_, model, _) in steps.items()}

    def step(name: str, batch: Batch) -> None:
        loss_fn, _, _ = steps[name]
        optimizers[name].zero_grad(set_to_none=True)
        tokens = int((batch[2] != PAD).sum())
        with torch.autocast("cpu", dtype=torch.bfloat16) if name in bf16 else contextlib.nullcontext():
            loss = loss_fn(batch) / tokens
        loss.backward()
        optimizers[name].step()

    for name, (_, _, batches) in steps.items():
        for batch in batches[:warmup]:
            step(name, batch)
    seconds = {name: np.zeros((rounds, len(batches))) for name, (_, _, batches) in steps.items()}
    for r in range(rounds):
        for i in range(max(len(batches) for _, _, batches in steps.values())):
            for name, (_, _, batches) in steps.items():
                if i < len(batches):
                    start = time.perf_counter()
                    step(name, batches[i])
                    seconds[name][r, i] = time.perf_counter() - start
    return seconds


# ---------------------------------------------------------------- where a step's time goes

# Anchors: an op under one of these (by name, anywhere up its call tree) counts as that part.
# Names are compared lowercased without underscores (forward ops and their backward nodes alike).
# Attention is SDPA, or (bfloat16 on a CPU, mtrain.attention.bfloat16_attention) batched matmuls and a
# softmax, which nothing else in a step uses: the linear layers run oneDNN's linear (its bias and the
# FFN's ReLU fused in; mtrain.cpu.ops) or addmm, their backward and the projection mm.
ATTENTION = "attention (SDPA; bf16: bmm, softmax)"
ANCHORS = [("optimizer.step", "Adam step"), ("smoothedcrossentropy", "loss: softmax, exp, sums (N x V)"),
           ("scaleddotproduct", ATTENTION), ("bmm", ATTENTION), ("softmax", ATTENTION), ("layernorm", "layer norm")]
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
# Ops outside an anchor, by name.
OPS = [(MATMULS, "matmuls (linear layers)"),
       (("aten::copy_", "aten::_to_copy"), "dtype casts (autocast, mixed-dtype sums)"),
       (("aten::random_", "mtrain::keep_mask", "aten::bitwise_and", "aten::bitwise_right_shift", "aten::bitwise_not", "aten::bitwise_and_",
         "aten::bitwise_right_shift_", "aten::bitwise_not_", "aten::bernoulli_", "aten::ge"), "dropout masks"),
       (("aten::embedding_dense_backward", "aten::embedding", "aten::index_select", "aten::index", "aten::_index_put_impl_"),
        "embeddings, gathers"),
       (("aten::clamp_min", "aten::threshold_backward", "aten::relu"), "ReLU")]


def profile_step(step: Callable[[Batch], None], batches: list[Batch], rounds: int) -> dict[str, float]:
    """ms per step by part: each op's self time, attributed to the first anchor up its call
    tree, else by its name; 'outside ops' is wall time not spent in any op (Python, autograd's
    bookkeeping, the profiler itself)."""
    from torch.profiler import ProfilerActivity, profile

    for batch in batches[:1]:
        step(batch)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            for batch in batches:
                step(batch)
    wall = time.perf_counter() - start
    parts: dict[str, float] = {}
    main = None
    for event in prof.events():
        if event.cpu_parent is None and main is None:
            main = event.thread
        if event.thread != main:  # other threads' records (autograd workers) are inside main's ops
            continue
        name, node = "other element-wise ops", event
        while node is not None:
            label = next((label for key, label in ANCHORS if key in node.name.lower().replace("_", "")), None)
            if label is not None:
                name = label
                if label.startswith("loss") and event.name in MATMULS:
                    name = "vocabulary projection matmuls (N x d x V)"
                break
            node = node.cpu_parent
        if node is None:
            name = next((label for keys, label in OPS if event.name in keys), name)
        parts[name] = parts.get(name, 0.0) + event.self_cpu_time_total / 1e3
    steps = rounds * len(batches)
    result = {name: ms / steps for name, ms in sorted(parts.items(), key=lambda kv: -kv[1])}
    result["outside ops (Python, autograd)"] = max(0.0, wall * 1e3 / steps - sum(result.values()))
    result["step (wall, profiled)"] = wall * 1e3 / steps
    return result


def padding_fraction(batches: list[Batch]) -> float:
    cells = sum(b[0].numel() + b[2].numel() for b in batches)
    return 1 - sum(int((b[0] != PAD).sum() + (b[2] != PAD).sum()) for b in batches) / cells


def model_batches(name: str, bucketed: list[Batch], unbucketed: list[Batch]) -> list[Batch]:
    """The batches a named model trains on: length-bucketed, but for the unbucketed baseline."""
    return unbucketed if name == "nn.Transformer unbucketed" else bucketed


def build_steps(names: list[str], cfg: ModelConfig, args: argparse.Namespace, bucketed: list[Batch],
                unbucketed: list[Batch]) -> dict[str, tuple[Callable, nn.Module, list[Batch]]]:
    """The named models' (loss function, model, batches), built in the order given."""
    makers = {"mtrain": lambda: mtrain_step_fn(cfg, args.compile),
              "mtrain bf16": lambda: mtrain_step_fn(cfg, args.compile),
              "nn.Transformer": lambda: nn_step_fn(cfg),
              "nn.Transformer unbucketed": lambda: nn_step_fn(cfg),
              "HF Marian": lambda: marian_step_fn(cfg)}
    return {name: (*makers[name](), model_batches(name, bucketed, unbucketed)) for name in names}


def time_in_processes(names: list[str], argv: list[str], rounds: int, log: Callable) -> dict[str, np.ndarray]:
    """Seconds of each step, (rounds, batches) per model, each model timed in a fresh process of its
    own (this script with --only), one round per process, the models taking turns round by round."""
    base = [a for a in argv if a != "--json"]
    for flag in ("--rounds", "--only"):  # drop a flag and its value
        while flag in base:
            i = base.index(flag)
            del base[i : i + 2]
    seconds: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            command = [sys.executable, str(Path(__file__).resolve()), *base, "--rounds", "1", "--only", name]
            run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if run.returncode != 0:
                sys.exit(f"{name} failed in its own process:\n{run.stderr[-2000:]}")
            seconds[name].append(json.loads(run.stdout.strip().splitlines()[-1])["seconds"][0])
            log(f"round {r + 1}/{rounds} {name}: {sum(seconds[name][-1]):.1f} s")
    return {name: np.array(rows) for name, rows in seconds.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 batches, 1 round (about two minutes)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per batch and side (padding included)")
    p.add_argument("--batches", type=int, default=6, help="timed batches per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--compile", action="store_true", help="torch.compile mtrain's objective (as train.compile)")
    p.add_argument("--bf16", action="store_true",
                   help="add mtrain under bfloat16 autocast (train.amp=bf16; fast on CPUs with AMX) and the bf16 matmul peak")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face Marian even if installed")
    p.add_argument("--profile", action="store_true",
                   help="only mtrain (under bf16 autocast with --bf16): where a step's time goes, by part, with torch.profiler")
    p.add_argument("--together", action="store_true",
                   help="all models in this process, taking turns batch by batch (biased: see the module docstring)")
    p.add_argument("--only", help=argparse.SUPPRESS)  # one model's seconds, as JSON: the child of a run
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small",
                   help="small: the Multi30k recipe's model; base: the paper's base model with a 32k vocabulary")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.rounds = 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    reuse_freed_memory()  # as `mtrain train` sets it; for every model alike (module docstring)
    torch.manual_seed(args.seed)
    cfg = SHAPES[args.shape]

    src_lens, tgt_lens, source = sample_lengths(8000, args.seed)
    bucketed = bucketed_batches(src_lens, tgt_lens, args.max_tokens, args.batches, cfg.vocab_size, args.seed)
    unbucketed = random_batches(src_lens, tgt_lens, args.max_tokens, args.batches, cfg.vocab_size, args.seed)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    log(f"shape: d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.n_heads} heads, "
        f"{cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, vocab {cfg.vocab_size}; "
        f"{args.max_tokens}-token batches; lengths: {source}; threads {torch.get_num_threads()}")
    log(f"mkl: {mkl.status}")

    if args.profile:
        return run_profile(cfg, bucketed, args, log)
    bf16_native = cpu_has_native_bf16()
    if args.bf16 and not bf16_native:  # emulated bf16 matmuls: minutes per step, and no number worth having
        log("--bf16 skipped: this CPU has no native bfloat16 (AMX or AVX512-BF16); mtrain trains in float32 here")
        args.bf16 = False
    names = ["mtrain", "nn.Transformer", "nn.Transformer unbucketed"]
    names += [] if args.no_hf or importlib.util.find_spec("transformers") is None else ["HF Marian"]
    names += ["mtrain bf16"] if args.bf16 else []
    if args.only:  # a warm-up pass over every batch: timed steps meet shapes already seen, as in a long run
        # (bfloat16 on a CPU compiles a oneDNN kernel for each new matmul shape; a fresh process has none)
        seconds = time_models(build_steps([args.only], cfg, args, bucketed, unbucketed), args.rounds,
                              warmup=len(bucketed), bf16=frozenset({"mtrain bf16"}))
        print(json.dumps({"seconds": seconds[args.only].tolist()}))
        return {}
    peak_before = matmul_peak_gflops()
    if args.together:
        steps = build_steps(names, cfg, args, bucketed, unbucketed)
        seconds = time_models(steps, args.rounds, warmup=2 if args.compile else 1, bf16=frozenset({"mtrain bf16"}))
    else:
        seconds = time_in_processes(names, argv if argv is not None else sys.argv[1:], args.rounds, log)
    peak = max(peak_before, matmul_peak_gflops())
    bf16_peak = matmul_peak_gflops(dtype=torch.bfloat16) if args.bf16 else None

    rows = {}
    for name in names:
        batches = model_batches(name, bucketed, unbucketed)
        tokens = args.rounds * sum(int((b[2] != PAD).sum()) for b in batches)
        flops = args.rounds * sum(train_flops(b, cfg, as_mtrain=name.startswith("mtrain")) for b in batches)
        total, best = seconds[name].sum(), args.rounds * seconds[name].min(axis=0).sum()
        rows[name] = {"tok_s": tokens / total, "best_tok_s": tokens / best, "gflops": flops / total / 1e9,
                      "pad": padding_fraction(batches), "tokens_per_batch": tokens / args.rounds / len(batches)}

    def tok_s(name: str, key: str = "tok_s") -> float | None:
        return round(rows[name][key], 1) if name in rows else None

    def by_round(name: str) -> list[float]:
        """Each round's speed of `name` against nn.Transformer float32 (their summed seconds)."""
        return [round(float(r), 3) for r in seconds["nn.Transformer"].sum(axis=1) / seconds[name].sum(axis=1)]

    result = {
        "mtrain_tok_s": tok_s("mtrain"),
        "nn_transformer_tok_s": tok_s("nn.Transformer"),
        "nn_transformer_unbucketed_tok_s": tok_s("nn.Transformer unbucketed"),
        "hf_marian_tok_s": tok_s("HF Marian"),
        # each batch's fastest round: less sensitive to other processes' load (equal to the above with 1 round)
        "mtrain_best_tok_s": tok_s("mtrain", "best_tok_s"),
        "nn_transformer_best_tok_s": tok_s("nn.Transformer", "best_tok_s"),
        "hf_marian_best_tok_s": tok_s("HF Marian", "best_tok_s"),
        "mtrain_gflops": round(rows["mtrain"]["gflops"], 1),
        "nn_transformer_gflops": round(rows["nn.Transformer"]["gflops"], 1),
        "matmul_peak_gflops": round(peak, 1),
        "mtrain_peak_fraction": round(rows["mtrain"]["gflops"] / peak, 3),
        "speedup_vs_nn_transformer": round(rows["mtrain"]["tok_s"] / rows["nn.Transformer"]["tok_s"], 3),
        # each round's ratio: the two models ran minutes apart at most, so drift on a shared host
        # moves these less than the ratio of the totals; their spread shows how far to trust one run
        "speedup_vs_nn_transformer_by_round": by_round("mtrain"),
        "speedup_vs_nn_transformer_unbucketed":
            round(rows["mtrain"]["tok_s"] / rows["nn.Transformer unbucketed"]["tok_s"], 3),
        "padding_fraction_bucketed": round(rows["mtrain"]["pad"], 3),
        "padding_fraction_unbucketed": round(rows["nn.Transformer unbucketed"]["pad"], 3),
        "target_tokens_per_batch": round(rows["mtrain"]["tokens_per_batch"], 1),
        "mtrain_bf16_tok_s": tok_s("mtrain bf16"),
        "bf16_speedup": round(rows["mtrain bf16"]["tok_s"] / rows["mtrain"]["tok_s"], 3) if args.bf16 else None,
        # the bfloat16 step against the float32 baseline (the target's ratio), in total and round by round
        "bf16_speedup_vs_nn_transformer":
            round(rows["mtrain bf16"]["tok_s"] / rows["nn.Transformer"]["tok_s"], 3) if args.bf16 else None,
        "bf16_speedup_vs_nn_transformer_by_round": by_round("mtrain bf16") if args.bf16 else None,
        "bf16_matmul_peak_gflops": round(bf16_peak, 1) if bf16_peak else None,
        "bf16_native": bf16_native,
        "batches": args.batches, "rounds": args.rounds, "compile": args.compile, "lengths": source,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "hardware": machine_record(),  # the CPU by name and signature: results are compared within one host only
        "shape": {"name": args.shape, "d_model": cfg.d_model, "d_ff": cfg.d_ff, "n_heads": cfg.n_heads,
                  "layers": f"{cfg.n_encoder_layers}+{cfg.n_decoder_layers}",
                  "vocab_size": cfg.vocab_size, "max_tokens": args.max_tokens},
    }
    log(f"\n{'model':<28}{'tgt tok/s':>11}{'best':>7}{'GFLOP/s':>10}{'of peak':>9}{'pad':>7}{'tgt tok/batch':>15}")
    for name, row in rows.items():
        log(f"{name:<28}{row['tok_s']:>11.0f}{row['best_tok_s']:>7.0f}{row['gflops']:>10.1f}{row['gflops'] / peak:>9.1%}"
            f"{row['pad']:>7.1%}{row['tokens_per_batch']:>15.0f}")
    if bf16_peak:
        log(f"bf16 matmul peak (2048^3): {bf16_peak:.1f} GFLOP/s; mtrain bf16 / mtrain fp32: {result['bf16_speedup']:.2f}x "
            "('of peak' is against the fp32 peak)")
        log(f"mtrain bf16 / nn.Transformer fp32: {result['bf16_speedup_vs_nn_transformer']:.2f}x; by round: "
            + ratios_text(result["bf16_speedup_vs_nn_transformer_by_round"]))
    log(f"fp32 matmul peak (2048^3): {peak:.1f} GFLOP/s; mtrain / nn.Transformer (same batches): "
        f"{result['speedup_vs_nn_transformer']:.2f}x, / nn.Transformer unbucketed: "
        f"{result['speedup_vs_nn_transformer_unbucketed']:.2f}x")
    log("mtrain / nn.Transformer by round: " + ratios_text(result["speedup_vs_nn_transformer_by_round"]))
    if args.json:
        print(json.dumps(result))
    return result


def ratios_text(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}x" for r in ratios)


def run_profile(cfg: ModelConfig, batches: list[Batch], args: argparse.Namespace, log: Callable) -> dict:
    loss_fn, model = mtrain_step_fn(cfg, args.compile)
    optimizer = mtrain_optimizer(model)
    bf16 = args.bf16 and cpu_has_native_bf16()

    def step(batch: Batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = loss_fn(batch) / int((batch[2] != PAD).sum())
        loss.backward()
        optimizer.step()

    parts = profile_step(step, batches, args.rounds)
    total = parts["step (wall, profiled)"]
    log(f"\nmtrain {'bfloat16 autocast' if bf16 else 'float32'} training step, ms per step "
        f"({args.rounds} x {len(batches)} batches, {torch.get_num_threads()} threads)")
    for name, ms in parts.items():
        log(f"  {name:<44}{ms:>8.1f}{'' if name.startswith('step') else f'{ms / total:>8.1%}'}")
    result = {"profile_ms_per_step": {k: round(v, 1) for k, v in parts.items()}, "bf16": bf16,
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
