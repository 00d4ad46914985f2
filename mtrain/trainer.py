"""One training run's parts and single jobs: `Trainer` holds the data, model, optimizer and
TrainState, and resumes, makes one update, validates and saves; the loop around it is
mtrain.train.Run.

Every write it makes (checkpoints, deleting old step files, averaged.pt) that fails raises one
MtrainError naming the file and the cause. Each write happens before the last.pt that follows it,
so the last.pt on disk is always the commit point of resume: the same command, once the cause is
fixed, ends bit-identical to an uninterrupted run on a CPU (on a GPU, equal to rounding: its kernels
need not add in the same order twice)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import random
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mtrain import checkpoint, probe
from mtrain import cpu
from mtrain.cpu import mkl
from mtrain import distributed as dist_utils
from mtrain.atomic import describe_write_error
from mtrain.config import Config, replace, to_dict
from mtrain.data import Batch, BatchStream, SubwordSampler, TokenizedData, collate, make_batches, stream_target_tokens, target_tokens
from mtrain.errors import MtrainError, is_out_of_memory
from mtrain.evaluate import score
from mtrain.hardware import cuda_index, resolve_amp
from mtrain.loss import Objective, forward_backward
from mtrain.cpu.model import accelerate
from mtrain.model import Transformer
from mtrain.init import Start
from mtrain.prefetch import Prefetcher, pin, to_device
from mtrain.cpu.quantize import check_quantize
from mtrain.resume import TrainState, rng_state, set_rng_state
from mtrain.schedule import lr_at, parse_duration
from mtrain.tokenizer import PAD_ID, Tokenizer
from mtrain.translate import decoding_model, translate_lines

N_SAMPLES = 3  # sample translations shown at each validation


# ---------------------------------------------------------------- set-up

def model_config_for_data(cfg: Config, tokenizer: Tokenizer) -> Config:
    """Vocabulary sizes come from the tokenized data, not from the config file."""
    joint = bool(tokenizer.joint)
    return replace(cfg, model={
        "vocab_size": int(tokenizer.tgt.vocab_size),
        "src_vocab_size": 0 if joint else int(tokenizer.src.vocab_size),
        "share_embeddings": cfg.model.share_embeddings and joint,
        "pad_id": PAD_ID,
    })


def check_direction(cfg: Config, meta: dict[str, Any], data_dir: Path) -> None:
    """An en->de config on de->en data would silently train the other direction: refuse it."""
    want, have = (cfg.data.src, cfg.data.tgt), (meta.get("src"), meta.get("tgt"))
    if want != have:
        raise MtrainError(
            f"{data_dir}: tokenized as {have[0]}->{have[1]} but the config says data.src={want[0]} "
            f"data.tgt={want[1]}; pass --set data.src={have[0]} --set data.tgt={have[1]} or re-tokenize with this config"
        )


def new_optimizer(model: nn.Module, t: Any, device: torch.device) -> torch.optim.Optimizer:
    """Adam with lr 0 (each update sets it). Fused on CUDA and CPU: one kernel over all
    parameters instead of a dozen multi-tensor ops (on a CPU, 4 ms instead of 12-15 ms per step for
    the 7.5M parameters of d_model 256 3+3, one core)."""
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                            weight_decay=t.weight_decay, fused=device.type in ("cuda", "cpu") or None)


# Adam's settings that choose its kernels, not its arithmetic's inputs.
KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def with_own_kernels(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A saved optimizer state whose groups take this optimizer's kernel choices. load_state_dict
    copies every group setting from the file, so a checkpoint written without fused Adam
    (fused=None) would turn it off here; on a float16 GPU run GradScaler then hands the unfused
    step the scale it gives only a fused one, and the step fails."""
    ours = optimizer.param_groups[0]
    groups = [{**group, **{flag: ours[flag] for flag in KERNEL_FLAGS if flag in ours}} for group in saved["param_groups"]]
    return {**saved, "param_groups": groups}


def release_memory(device: torch.device) -> None:
    """Free what a failed update left: its reference cycles, and on a GPU the allocator's cached
    blocks, so that the memory goes back to the device. A GPU in a sticky error state refuses even
    that; the error line that follows matters more, so that refusal is ignored."""
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):
            torch.cuda.empty_cache()


def forget_half_made_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop the parameters' optimizer state that an error inside Adam's first step left half made
    (a step count, no moments), which the next step would fail on with KeyError('exp_avg'). Complete
    state stays: the memory probe measures later budgets with the moments in place, as training
    holds them."""
    for param in [p for p, state in optimizer.state.items() if not {"exp_avg", "exp_avg_sq"} <= state.keys()]:
        del optimizer.state[param]


def forked_rng(device: torch.device) -> Any:
    """torch's generators forked: the CPU's and, on a GPU, that GPU's (plain "cuda" included), so
    that what runs inside leaves the run's random stream as it was."""
    return torch.random.fork_rng(devices=[cuda_index(device)] if device.type == "cuda" else [])


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """A fresh autocast context for dtype (None: float32, no autocast)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def stored_max_tokens(path: Path) -> int | None:
    """train.max_tokens of the run a last.pt holds (None without one). The file is memory-mapped,
    so its tensors are not read; a damaged file is left for the resume to report."""
    if not path.is_file():
        return None
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["config"]["train"]["max_tokens"]
    except Exception:  # the resume's checkpoint.load says what is wrong, in one line
        return None
    return value if isinstance(value, int) and value > 0 else None


def smallest_over_ranks(value: int, dist: dist_utils.DistInfo, device: torch.device) -> int:
    if not dist.enabled:
        return value
    tensor = torch.tensor([value], device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())


def suggest_max_tokens(max_tokens: int, floor: int) -> int | None:
    """A smaller budget to try after `max_tokens` ran out of memory: three quarters of it, in
    multiples of 64 where that leaves one, but no less than `floor`, the longest pair's cost, which
    every batch must hold (a smaller budget is refused before training). None when nothing smaller
    holds the longest pair."""
    three_quarters = int(max_tokens * 0.75)
    smaller = max(three_quarters // 64 * 64 or three_quarters, -(-floor // 64) * 64)
    if smaller >= max_tokens:  # the floor rounded up is no smaller: without rounding
        smaller = max(three_quarters, floor)
    return smaller if smaller < max_tokens else None


# ---------------------------------------------------------------- the trainer

class Trainer:
    """Holds one run's parts (data, model, optimizer, TrainState) and does the single jobs:
    resume, one update, validate, save. The loop around them is `Run`."""

    def __init__(self, cfg: Config, data_dir: Path, run_dir: Path, device: torch.device,
                 dist: dist_utils.DistInfo, start: Start | None = None) -> None:
        self.data_dir, self.run_dir, self.device, self.dist = Path(data_dir), Path(run_dir), device, dist
        self.start = start  # a new run's weights come from this checkpoint (mtrain.init); resume() overrides them
        check_quantize(cfg.decode.quantize, cfg.decode.amp, device)  # validation decodes with cfg.decode
        data = TokenizedData(data_dir)
        check_direction(cfg, data.meta, self.data_dir)
        self.tokenizer = data.tokenizer
        self.stats = data.stats
        self.cfg = model_config_for_data(cfg, self.tokenizer)
        self.tcfg = self.cfg.train
        self.train_split = data.split(self.cfg.data.train_split)
        self.valid_split = data.split(self.cfg.data.valid_split)
        self.cfg = self._resolve_max_tokens(self.cfg)  # train.max_tokens=auto: a number from here on
        self.tcfg = self.cfg.train
        self.budget = parse_duration(self.tcfg.max_time)  # seconds; 0 = no time budget
        self.state = TrainState()
        sampler = None
        if self.tcfg.sampling_alpha > 0:
            sampler = SubwordSampler(self.train_split, self.tokenizer, self.tcfg.sampling_alpha,
                                          self.tcfg.seed, self.tcfg.max_tokens)
        self.stream = BatchStream(self.train_split, self.tcfg.max_tokens, self.tcfg.seed, sampler=sampler,
                                  mixer=data.mixer(self.cfg.data, self.tcfg.seed, self.train_split))
        self._build_model()
        if start is not None:  # its vocabulary was checked against the data by mtrain.train.train
            self.model.load_state_dict(start.weights)
        # Each update's batches are collated (pinned, on a GPU) while the previous update computes.
        self.prefetch = Prefetcher(self.stream, self.dist.world_size * self.tcfg.update_freq, self._prepare)

    def _build_model(self) -> None:
        seed = self.tcfg.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        self.model = accelerate(Transformer(self.cfg.model), self.device).to(self.device)
        if self.dist.rank > 0:
            torch.manual_seed(seed + 1000 * self.dist.rank)  # independent dropout masks per rank
        self.amp_dtype = resolve_amp(self.tcfg.amp, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        t = self.tcfg
        self.optimizer = new_optimizer(self.model, t, self.device)
        objective: nn.Module = Objective(self.model, t.label_smoothing, t.rdrop_alpha)
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            # No buffer broadcast: the one buffer, the sinusoid table, is the same function on every rank,
            # and rank 0's validation can grow it (inside inference mode) past the other ranks' size.
            objective = nn.parallel.DistributedDataParallel(objective, device_ids=ids, broadcast_buffers=False)
        if t.compile:  # after DDP, so compiled graphs see its bucketing hooks
            objective = torch.compile(objective, dynamic=True)
        self.objective = objective

    def autocast(self) -> Any:
        return autocast(self.device, self.amp_dtype)

    # ------------------------------------------------------------ train.max_tokens=auto

    def _resolve_max_tokens(self, cfg: Config) -> Config:
        """cfg with train.max_tokens a number: as given; for auto, the value last.pt was trained
        with (a resume keeps its batches), else the probe's on a GPU, else probe.CPU_DEFAULT."""
        if cfg.train.max_tokens != "auto":
            return cfg
        stored = stored_max_tokens(self.run_dir / "last.pt")
        gauge = probe.memory_gauge(self.device)
        if stored is not None:
            tokens, why = stored, f"the value {self.run_dir / 'last.pt'} was trained with"
        elif gauge is None:
            tokens, why = probe.CPU_DEFAULT, f"the default on {self.device.type}, where memory does not limit a batch"
        else:
            tokens, why = self._probe_on_every_rank(cfg, gauge), (
                f"the largest budget whose steps on the longest pairs and on the longest targets fit in "
                f"{self.device}'s memory with {probe.MARGIN:.0%} left free")
        self.log(f"train.max_tokens=auto: {tokens} ({why})")
        return replace(cfg, train={"max_tokens": tokens})

    def _probe_on_every_rank(self, cfg: Config, gauge: probe.MemoryGauge) -> int:
        """The probe's budget, the smallest over ranks so that all cut the same batches. Where the
        probe fails on one rank (not even the longest pair fits), every rank stops with an error,
        instead of the others waiting for it in the all-reduce."""
        failure = None
        try:
            tokens = self._probe_max_tokens(cfg, gauge)
        except MtrainError as err:
            failure, tokens = err, 0
        if dist_utils.any_rank(failure is not None, self.dist, self.device):
            raise failure or MtrainError("train.max_tokens=auto: the memory probe failed on another process; "
                                         "its log says why")
        return smallest_over_ranks(tokens, self.dist, self.device)

    def _probe_max_tokens(self, cfg: Config, gauge: probe.MemoryGauge) -> int:
        """Run the probe on a throw-away model and optimizer like the run's, with the RNG forked,
        so the run itself starts exactly as it would with the budget given by hand."""
        split, t, device = self.train_split, cfg.train, self.device
        if t.sampling_alpha > 0:  # training cuts its batches from sampled segmentations, longer than the cached ids
            split = SubwordSampler(split, self.tokenizer, t.sampling_alpha, t.seed, probe.CEILING)(1)
        with forked_rng(device):
            torch.manual_seed(t.seed)
            model = accelerate(Transformer(cfg.model), device).to(device).train()
            optimizer = new_optimizer(model, t, device)
            objective = Objective(model, t.label_smoothing, t.rdrop_alpha)
            amp_dtype = resolve_amp(t.amp, device)

            batches = probe.ProbeBatches(split.src.lengths, split.tgt.lengths)

            def step(budget: int) -> None:
                for rows in batches(budget):
                    batch = collate(split, rows, device=device)
                    try:
                        forward_backward(objective, [batch], target_tokens(split.tgt.lengths, [rows]),
                                         autocast=lambda: autocast(device, amp_dtype))
                        optimizer.step()
                    except BaseException:
                        forget_half_made_state(optimizer)
                        raise
                    finally:
                        optimizer.zero_grad(set_to_none=True)

            floor = probe.longest_cost(split.src.lengths, split.tgt.lengths)
            tokens = probe.search(probe.Probe(step, gauge, self.log), gauge.capacity(), floor)
            del model, optimizer, objective
        gauge.reset()  # give the probe's memory back before the run's model is built
        return tokens

    # ------------------------------------------------------------ resume

    def resume(self) -> bool:
        """Restore everything from RUN/last.pt when it exists; say so on stderr."""
        path = self.run_dir / "last.pt"
        if not path.is_file():
            return False
        ckpt = checkpoint.load(path)
        self._check_same_model(ckpt, path)
        ts = ckpt.get("train_state")
        if ts is None:
            raise MtrainError(f"{path}: holds no training state; pass a new --out folder to start a fresh run")
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(with_own_kernels(ts["optimizer"], self.optimizer))
        if self.scaler is not None and ts.get("scaler"):
            self.scaler.load_state_dict(ts["scaler"])
        self.state = TrainState.from_saved(ts["state"])
        self.stream.epoch, self.stream.index = self.state.epoch, self.state.batch_index
        self._note_train_changes(ckpt["config"].get("train", {}))
        rngs = ts["rng"]
        if len(rngs) == self.dist.world_size:
            why = set_rng_state(rngs[self.dist.rank], self.device)
        else:
            why = f"{path} was written by {len(rngs)} process(es), now {self.dist.world_size}"
        if why:
            self.log(f"note: {why}, so this run's dropout masks differ from an uninterrupted run's and "
                     "it will not match one bit for bit")
        self._note_kernel_change(ts)
        self.log(f"resuming from {path}: step {self.state.step}, epoch {self.state.epoch}, "
                 f"batch {self.state.batch_index}/{len(self.stream.batches(self.state.epoch))}, "
                 f"best BLEU {max(self.state.best_bleu, 0.0):.2f}")
        return True

    def _check_same_model(self, ckpt: dict[str, Any], path: Path) -> None:
        stored, current = ckpt["config"].get("model", {}), to_dict(self.cfg)["model"]
        defaults = to_dict(Config())["model"]  # a key newer than the checkpoint: its default, which it had
        diffs = [f"{k}: {stored.get(k, defaults[k])!r} -> {v!r}" for k, v in current.items()
                 if stored.get(k, defaults[k]) != v]
        if diffs:
            raise MtrainError(f"{path}: the model config differs from the run being resumed ({'; '.join(diffs)}); "
                              "use the original config, or a new --out folder for a new model")
        if ckpt.get("tokenizer") != self.tokenizer.to_state():
            raise MtrainError(f"{path}: the run was trained with another SentencePiece model than {self.data_dir}'s; "
                              "pass the original --data folder, or a new --out folder")

    def _note_kernel_change(self, ts: dict[str, Any]) -> None:
        """A note when other CPU fast paths ran before the resume (mtrain.cpu.acceleration, or for
        older checkpoints MKL's kernels alone): other sums' rounding, so no bit-for-bit match with
        an uninterrupted run."""
        if self.device.type != "cpu":
            return
        cpu.prepare()
        if "acceleration" in ts:
            changed = cpu.differences(ts["acceleration"], cpu.acceleration())
            if changed:
                self.log(f"note: the CPU fast paths differ from those that wrote last.pt ({', '.join(changed)}), "
                         "so sums round differently and this run will not match an uninterrupted one bit for bit")
            return
        fast_before, now = ts.get("mkl_intel_path"), mkl.loaded()
        if fast_before is None or fast_before == now:
            return
        kernels = {True: "its fast kernels", False: "its generic kernels"}
        self.log(f"note: MKL ran {kernels[fast_before]} before this resume and runs {kernels[now]} now "
                 f"({mkl.status}), so this run will not match an uninterrupted one bit for bit")

    def _note_train_changes(self, stored: dict[str, Any]) -> None:
        current = to_dict(self.cfg)["train"]
        changed = [f"train.{k} {stored[k]!r} -> {v!r}" for k, v in current.items() if k in stored and stored[k] != v]
        if changed:
            self.log("note: changed since the last run: " + ", ".join(changed))

    # ------------------------------------------------------------ one update

    def train_step(self) -> dict[str, float] | None:
        """One optimizer update over update_freq micro-batches per rank. Returns stats, None when
        the loss was non-finite and the update was skipped, or {} when float16 gradients overflowed
        and the gradient scaler skipped it (lowering its scale, as it does early in a run)."""
        update = self.prefetch.next()  # the stream's next batches (the same list on every rank); moves the stream
        total, host = update.prepared
        step, micro = self.state.step + 1, []
        try:  # the optimizer's step can run out of memory too: its first call allocates Adam's moments
            micro = [to_device(tensors, self.device) for tensors in host]
            return self._update(step, micro, total)
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
        # Raised outside the except clause, so the error does not carry the failed update's frames
        # (its activations) as context: a caller that catches it and retries has the memory back.
        del micro
        self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.device)
        raise self._out_of_memory(step, host)

    def _update(self, step: int, micro: list[tuple[torch.Tensor, ...]], total: int) -> dict[str, float] | None:
        """train_step on micro-batches already on the device."""
        t = self.tcfg
        loss_sum, nll_sum = forward_backward(self.objective, micro, total, self.dist.world_size, self.autocast,
                                             self.scaler)
        sums = [loss_sum, nll_sum]
        if self.dist.enabled:  # one process needs no device round trip (on a GPU, a copy and a sync)
            sums = dist_utils.all_reduce_sum(torch.tensor(sums, dtype=torch.float64, device=self.device),
                                             self.dist).tolist()
        if not math.isfinite(sums[0]):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        lr = lr_at(step, self.cfg.model.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.cooldown_steps,
                   self.state.train_seconds, self.budget, t.cooldown_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self._clip_and_step()
        if grad_norm is None:
            return None
        if not math.isfinite(grad_norm):  # the float16 scaler skipped the update: no step, nothing to log
            return {}
        self.state.step = step
        return {"loss": sums[0], "nll": sums[1], "tokens": total, "lr": lr, "grad_norm": grad_norm}

    def _prepare(self, batches: list[Batch]) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
        """Host side of an update (the prefetch thread runs it): the update's target tokens over all
        ranks, and this rank's micro-batches collated (pinned on a GPU)."""
        t = self.tcfg
        mine = batches[self.dist.rank * t.update_freq:(self.dist.rank + 1) * t.update_freq]
        return stream_target_tokens(batches), [pin(collate(b.split, b.indices), self.device) for b in mine]

    def _out_of_memory(self, step: int, host: list[tuple[torch.Tensor, ...]]) -> MtrainError:
        """The one line that ends a run whose update ran out of device memory: where, on what, and
        the budget to resume with. last.pt is not touched: it holds the last save, and the run
        resumes from it (the updates since are redone)."""
        shapes = " and ".join(f"{src.shape[0]} x {src.shape[1]} source / {tgt.shape[0]} x {tgt.shape[1]} target tokens"
                              for src, tgt, _ in host)
        last = self.run_dir / "last.pt"
        floor = probe.longest_cost(self.train_split.src.lengths, self.train_split.tgt.lengths)
        smaller = suggest_max_tokens(self.tcfg.max_tokens, floor)
        if smaller is None:
            then = (f"the budget is already the longest pair's {floor} tokens: lower data.max_len and re-tokenize, "
                    "or train on a device with more memory")
        elif last.is_file():
            then = f"{last} is intact, and re-running the same command with --set train.max_tokens={smaller} resumes from it"
        else:
            then = f"nothing was saved yet: re-run the same command with --set train.max_tokens={smaller} to start again"
        return MtrainError(f"step {step}: out of {self.device} memory in a batch of {shapes} "
                           f"(train.max_tokens={self.tcfg.max_tokens}); {then}")

    def _clip_and_step(self) -> float | None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.tcfg.clip_norm if self.tcfg.clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if self.scaler is not None:
            # float16 overflow: the scaler skips the step and lowers its scale; not a loss problem,
            # and not an update (train_step does not count it).
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if not math.isfinite(grad_norm):
                self.log(f"step {self.state.step + 1}: float16 gradients overflowed at loss scale {scale:g}; "
                         f"update skipped, the scale is now {self.scaler.get_scale():g}")
        elif not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def count_nonfinite(self) -> None:
        s = self.state
        s.nonfinite_run += 1
        s.nonfinite_total += 1
        self.log(f"step {s.step + 1}: non-finite loss, update skipped ({s.nonfinite_run} in a row)")
        if s.nonfinite_run >= self.tcfg.max_nonfinite:
            raise MtrainError(
                f"step {s.step + 1}: {s.nonfinite_run} non-finite losses in a row (train.max_nonfinite="
                f"{self.tcfg.max_nonfinite}); training stopped, {self.run_dir / 'last.pt'} holds the last good state; "
                "lower train.lr_scale, raise train.warmup_steps or set train.clip_norm, then re-run")

    # ------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Valid loss (in the training precision), then BLEU/chrF of translations of the raw valid
        source against the raw references, decoded as `mtrain translate` decodes with the run's decode
        settings (float32 unless decode.amp or decode.quantize says otherwise): the score is that of
        the translations the checkpoint will give. Decoding under bfloat16 autocast instead grew the
        trainer by ~50 MB per validation on a CPU (oneDNN keeps a kernel for every row count a search
        meets, and greedy search's row count falls as sentences finish) and scored other translations
        than `translate` would. The RNG is forked so dropout after validation is what it would be
        without it."""
        with forked_rng(self.device):
            self.model.eval()
            try:
                loss, nll = self._valid_loss()
                sources, refs = self.valid_split.src_text(), self.valid_split.tgt_text()
                if self.tcfg.eval_max_sentences > 0:
                    sources, refs = sources[:self.tcfg.eval_max_sentences], refs[:self.tcfg.eval_max_sentences]
                decode = dataclasses.replace(self.cfg.decode, beam=self.tcfg.eval_beam, nbest=1)
                model = decoding_model(self.model, decode, self.device, keep_original=True)
                hyps = translate_lines(model, self.tokenizer, sources, decode, self.device, stats=self.stats)
                scores = score(hyps, [refs])
            finally:
                self.model.train()
        samples = [{"src": s, "ref": r, "hyp": h} for s, r, h in list(zip(sources, refs, hyps))[:N_SAMPLES]]
        return {"loss": loss, "nll": nll, "ppl": math.exp(min(nll, 50.0)), "bleu": scores["bleu"],
                "chrf": scores["chrf"], "samples": samples}

    def _valid_loss(self) -> tuple[float, float]:
        split = self.valid_split
        # Valid/test are kept exactly as given (not cleaned): a pair longer than max_tokens gets a
        # batch of its own instead of failing the run at its first validation, and each side is cut
        # to the model's max_len positions, as translation cuts its input.
        limit = self.cfg.model.max_len
        batches = make_batches(np.minimum(split.src.lengths, limit - 1), np.minimum(split.tgt.lengths, limit - 1),
                               self.tcfg.max_tokens, seed=self.tcfg.seed, epoch=0, shuffle=False, allow_oversize=True)
        loss = nll = 0.0
        objective = Objective(self.model, self.tcfg.label_smoothing)
        for batch in batches:
            with self.autocast():
                loss_sum, nll_sum = objective(*collate(split, batch, device=self.device, max_len=limit))
            loss, nll = loss + loss_sum.item(), nll + nll_sum.item()
        tokens = max(1, target_tokens(split.tgt.lengths, batches, max_len=limit))
        return loss / tokens, nll / tokens

    # ------------------------------------------------------------ checkpoints

    def _ckpt(self, train_state: dict[str, Any] | None) -> dict[str, Any]:
        return checkpoint.make(to_dict(self.cfg), self.model.state_dict(), self.tokenizer.to_state(),
                               self.stats, self.state.step, train_state)

    def save_best(self) -> None:
        """RUN/best.pt: the model only (rank 0 calls it after a validation with a new best BLEU)."""
        self._save(self._ckpt(None), self.run_dir / "best.pt")

    def _save(self, obj: dict[str, Any], path: Path) -> None:
        # Any exception: disk full, a file size limit, permissions, a vanished folder, torch's wrapping of them.
        with self.writing(path, "checkpoint write", Exception):
            checkpoint.save_atomic(obj, path)

    @contextlib.contextmanager
    def writing(self, path: Path, what: str, catch: type[BaseException] = OSError) -> Iterator[None]:
        """Turn a failed write of `path` into the one line that stops the run: the file, the cause
        (ENOSPC, EFBIG, EIO, ...) and what to do."""
        try:
            yield
        except MtrainError:
            raise
        except catch as err:
            cause, remedy = describe_write_error(err)
            raise MtrainError(f"{path}: {what} failed ({cause}); the previous checkpoints in {self.run_dir} are "
                              f"intact; {remedy or 'fix the cause'} and re-run the same command to resume") from None

    def train_state(self, rngs: list[dict[str, Any]]) -> dict[str, Any]:
        self.state.epoch, self.state.batch_index = self.stream.epoch, self.stream.index
        return {"optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else {},
                "state": dataclasses.asdict(self.state), "rng": rngs, "world_size": self.dist.world_size,
                "mkl_intel_path": mkl.loaded(), "acceleration": cpu.acceleration()}

    def save_last(self, with_step_file: bool, average: bool = False, failure: MtrainError | None = None) -> None:
        """RUN/step-N.pt (model only, pruned to keep_last and keep_every), RUN/averaged.pt at the end of a run
        (average), then RUN/last.pt, the commit point of resume. Rank 0 writes; a failure there, or one rank 0
        met since the last save (failure), stops every rank, and last.pt stays the previous one."""
        rngs = self._gather_rngs()
        error = failure
        if self.dist.is_main and error is None:
            try:
                if with_step_file:
                    self._save(self._ckpt(None), self.run_dir / f"step-{self.state.step}.pt")
                    self._prune_step_files()
                if average:
                    self._average()
                self._save(self._ckpt(self.train_state(rngs)), self.run_dir / "last.pt")
            except MtrainError as err:
                error = err
        if dist_utils.any_rank(error is not None, self.dist, self.device):
            raise error or MtrainError(f"step {self.state.step}: rank 0 failed to write a checkpoint; "
                                       "see its message, fix it and re-run the same command to resume")

    def _gather_rngs(self) -> list[dict[str, Any]]:
        state = rng_state(self.device)
        if not self.dist.enabled:
            return [state]
        gathered: list[Any] = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, state)
        return gathered

    def step_files(self) -> list[Path]:
        return [p for _, p in checkpoint.step_checkpoints(self.run_dir)]

    def _prune_step_files(self) -> None:
        """Keep the newest max(keep_last, average_last) step files, and those on the keep_every grid."""
        keep, every = max(self.tcfg.keep_last, self.tcfg.average_last), self.tcfg.keep_every
        files = checkpoint.step_checkpoints(self.run_dir)
        for step, path in files[:-keep] if keep > 0 else files:
            if not (every > 0 and step % every == 0):
                with self.writing(path, "deleting an old step checkpoint"):
                    path.unlink(missing_ok=True)

    def _average(self) -> None:
        """RUN/averaged.pt: the mean of the last average_last step files; written before the last.pt
        that marks the run finished, so a finished run always has it."""
        files = self.step_files()[-self.tcfg.average_last:]
        out = self.run_dir / "averaged.pt"
        with self.writing(out, "checkpoint write", Exception):
            checkpoint.average_checkpoints(files, out)
        self.log(f"averaged {len(files)} checkpoints -> {out}")

    # ------------------------------------------------------------ logging

    def log(self, message: str) -> None:
        if self.dist.is_main:
            tqdm.write(message, file=sys.stderr)
