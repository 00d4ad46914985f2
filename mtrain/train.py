"""The training loop: `Trainer` holds one run's parts (data, model, optimizer, TrainState) and does
the single jobs (resume, one update, validate, save); `Run` is the loop around them (logging
windows, validation and saving cadence, stopping). Exact resume: re-run the same command.

One trainer per run folder: `train` holds RUN/.lock (mtrain.lock) from before the first write to
the end of the run; under torchrun only rank 0 takes it, as rank 0 alone writes.

Every write of a run (checkpoints, metrics.jsonl, plot.png, config.yaml, the trackers, deleting
old step files, averaged.pt) that fails stops the run with one line naming the file and the
cause. Each write happens before the last.pt that follows it, so the last.pt on disk is always
the commit point of resume: the same command, once the cause is fixed, ends bit-identical to an
uninterrupted run. Under DDP a failure on rank 0 stops every rank at the next point where they
all meet, so none is left waiting in a collective."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mtrain import checkpoint, tracking
from mtrain import distributed as dist_utils
from mtrain.atomic import atomic_write, describe_write_error
from mtrain.config import Config, replace, to_dict, to_yaml
from mtrain.data import BatchStream, SubwordSampler, TokenizedData, collate, make_batches, stream_target_tokens, target_tokens
from mtrain.errors import MtrainError
from mtrain.evaluate import score
from mtrain.hardware import amp_note, resolve_amp, resolve_device
from mtrain.lock import RunLock
from mtrain.loss import Objective, forward_backward
from mtrain.model import Transformer
from mtrain.plot import MetricsLog, plot_metrics
from mtrain.resume import TrainState, empty_window, rng_state, set_rng_state
from mtrain.schedule import cooldown_patience_note, lr_at
from mtrain.tokenizer import PAD_ID, Tokenizer
from mtrain.translate import translate_lines

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


# ---------------------------------------------------------------- signals

class StopSignal:
    """SIGINT/SIGTERM set a flag that the loop checks after each update, so the step in flight
    finishes and last.pt is saved; a second signal aborts at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving last.pt "
              "(send it again to abort without saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


# ---------------------------------------------------------------- the trainer

class Trainer:
    """Holds one run's parts (data, model, optimizer, TrainState) and does the single jobs:
    resume, one update, validate, save. The loop around them is `Run`."""

    def __init__(self, cfg: Config, data_dir: Path, run_dir: Path, device: torch.device,
                 dist: dist_utils.DistInfo) -> None:
        self.data_dir, self.run_dir, self.device, self.dist = Path(data_dir), Path(run_dir), device, dist
        data = TokenizedData(data_dir)
        check_direction(cfg, data.meta, self.data_dir)
        self.tokenizer = data.tokenizer
        self.stats = data.stats
        self.cfg = model_config_for_data(cfg, self.tokenizer)
        self.tcfg = self.cfg.train
        self.train_split = data.split(self.cfg.data.train_split)
        self.valid_split = data.split(self.cfg.data.valid_split)
        self.state = TrainState()
        sampler = None
        if self.tcfg.sampling_alpha > 0:
            sampler = SubwordSampler(self.train_split, self.tokenizer, self.tcfg.sampling_alpha,
                                          self.tcfg.seed, self.tcfg.max_tokens)
        self.stream = BatchStream(self.train_split, self.tcfg.max_tokens, self.tcfg.seed, sampler=sampler)
        self._build_model()

    def _build_model(self) -> None:
        seed = self.tcfg.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        self.model = Transformer(self.cfg.model).to(self.device)
        if self.dist.rank > 0:
            torch.manual_seed(seed + 1000 * self.dist.rank)  # independent dropout masks per rank
        self.amp_dtype = resolve_amp(self.tcfg.amp, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        t = self.tcfg
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(t.adam_beta1, t.adam_beta2),
                                          eps=t.adam_eps, weight_decay=t.weight_decay, fused=fused or None)
        objective: nn.Module = Objective(self.model, t.label_smoothing, t.rdrop_alpha)
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            objective = nn.parallel.DistributedDataParallel(objective, device_ids=ids)
        if t.compile:  # after DDP, so compiled graphs see its bucketing hooks
            objective = torch.compile(objective, dynamic=True)
        self.objective = objective

    def autocast(self) -> Any:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

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
        self.optimizer.load_state_dict(ts["optimizer"])
        if self.scaler is not None and ts.get("scaler"):
            self.scaler.load_state_dict(ts["scaler"])
        self.state = TrainState.from_saved(ts["state"])
        self.stream.epoch, self.stream.index = self.state.epoch, self.state.batch_index
        self._note_train_changes(ckpt["config"].get("train", {}))
        rngs = ts["rng"]
        if len(rngs) == self.dist.world_size:
            set_rng_state(rngs[self.dist.rank])
        else:
            self.log(f"note: {path} was written by {len(rngs)} process(es), now {self.dist.world_size}; "
                     "dropout RNG is reseeded, so this run will not match an uninterrupted one bit for bit")
        self.log(f"resuming from {path}: step {self.state.step}, epoch {self.state.epoch}, "
                 f"batch {self.state.batch_index}/{len(self.stream.batches(self.state.epoch))}, "
                 f"best BLEU {max(self.state.best_bleu, 0.0):.2f}")
        return True

    def _check_same_model(self, ckpt: dict[str, Any], path: Path) -> None:
        stored, current = ckpt["config"].get("model", {}), to_dict(self.cfg)["model"]
        diffs = [f"{k}: {stored.get(k)!r} -> {v!r}" for k, v in current.items() if stored.get(k) != v]
        if diffs:
            raise MtrainError(f"{path}: the model config differs from the run being resumed ({'; '.join(diffs)}); "
                              "use the original config, or a new --out folder for a new model")
        if ckpt.get("tokenizer") != self.tokenizer.to_state():
            raise MtrainError(f"{path}: the run was trained with another SentencePiece model than {self.data_dir}'s; "
                              "pass the original --data folder, or a new --out folder")

    def _note_train_changes(self, stored: dict[str, Any]) -> None:
        current = to_dict(self.cfg)["train"]
        changed = [f"train.{k} {stored[k]!r} -> {v!r}" for k, v in current.items() if k in stored and stored[k] != v]
        if changed:
            self.log("note: changed since the last run: " + ", ".join(changed))

    # ------------------------------------------------------------ one update

    def train_step(self) -> dict[str, float] | None:
        """One optimizer update over update_freq micro-batches per rank. Returns stats, or None
        when the loss was non-finite and the update was skipped."""
        t, world = self.tcfg, self.dist.world_size
        batches = self.stream.take(world * t.update_freq)  # the same list on every rank
        total = stream_target_tokens(batches)
        mine = batches[self.dist.rank * t.update_freq:(self.dist.rank + 1) * t.update_freq]
        micro = [collate(b.split, b.indices, device=self.device) for b in mine]
        step = self.state.step + 1
        loss_sum, nll_sum = forward_backward(self.objective, micro, total, world, self.autocast, self.scaler)
        sums = dist_utils.all_reduce_sum(torch.tensor([loss_sum, nll_sum], dtype=torch.float64,
                                                      device=self.device), self.dist).tolist()
        if not math.isfinite(sums[0]):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        lr = lr_at(step, self.cfg.model.d_model, t.warmup_steps, t.lr_scale, t.max_steps, t.cooldown_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self._clip_and_step()
        if grad_norm is None:
            return None
        self.state.step = step
        return {"loss": sums[0], "nll": sums[1], "tokens": total, "lr": lr, "grad_norm": grad_norm}

    def _clip_and_step(self) -> float | None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.tcfg.clip_norm if self.tcfg.clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if self.scaler is not None:
            # fp16 overflow: the scaler skips the step and lowers its scale; not a loss problem.
            self.scaler.step(self.optimizer)
            self.scaler.update()
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
        """Valid loss, then BLEU/chrF of translations of the raw valid source against the raw
        references. The RNG is forked so dropout after validation is what it would be without it."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self.model.eval()
            try:
                loss, nll = self._valid_loss()
                sources, refs = self.valid_split.src_text(), self.valid_split.tgt_text()
                if self.tcfg.eval_max_sentences > 0:
                    sources, refs = sources[:self.tcfg.eval_max_sentences], refs[:self.tcfg.eval_max_sentences]
                decode = dataclasses.replace(self.cfg.decode, beam=self.tcfg.eval_beam, nbest=1)
                with self.autocast():
                    hyps = translate_lines(self.model, self.tokenizer, sources, decode, self.device, stats=self.stats)
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
                "state": dataclasses.asdict(self.state), "rng": rngs, "world_size": self.dist.world_size}

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
        state = rng_state()
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


# ---------------------------------------------------------------- the loop

class Run:
    """The loop around a Trainer: logging windows, validation/saving cadence, stopping."""

    def __init__(self, trainer: Trainer) -> None:
        self.tr = trainer
        self.metrics: MetricsLog | None = None
        self.trackers = tracking.Trackers()  # train.log_to, on the main rank once open_trackers ran
        self.resume_step: int | None = None
        self.started = time.perf_counter()
        self.failure: MtrainError | None = None  # a failed write on rank 0, waiting for the ranks to meet (DDP)

    # ------------------------------------------------------------ failed writes

    def fail(self, err: MtrainError) -> None:
        """A write failed on the main rank. One process stops at once; under DDP the error waits
        for the next point where every rank meets (check_failure, the per-step flags, save_last),
        so that all stop together and none is left waiting in a collective."""
        if not self.tr.dist.enabled:
            raise err
        if self.failure is None:
            self.failure = err

    def check_failure(self) -> None:
        """Every rank: stop if rank 0 met a failed write."""
        if self.tr.dist.enabled and dist_utils.any_rank(self.failure is not None, self.tr.dist, self.tr.device):
            raise self._failure_error()

    def _failure_error(self) -> MtrainError:
        return self.failure or MtrainError(f"rank 0 failed to write to {self.tr.run_dir}; see its error line, fix the "
                                           "cause and re-run the same command to resume")

    def _flags(self, *flags: bool) -> list[bool]:
        """Each flag raised on any rank (one collective for all of them)."""
        if not self.tr.dist.enabled:
            return list(flags)
        values = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.tr.device)
        return [v > 0 for v in dist_utils.all_reduce_sum(values, self.tr.dist).tolist()]

    def start(self) -> None:
        tr = self.tr
        tracking.check_available(tr.tcfg.log_to)  # a missing package fails here, before any update
        resumed = tr.resume()
        self.resume_step = tr.state.step if resumed else None
        if tr.dist.is_main:
            try:
                self._prepare_folder(resumed)
            except MtrainError as err:
                self.fail(err)
        self.check_failure()
        if not resumed:
            tr.log(f"training {sum(p.numel() for p in tr.model.parameters()):,} parameters on {tr.device} "
                   f"({tr.dist.world_size} process(es)); run folder {tr.run_dir}")
        tr.log(amp_note(tr.tcfg.amp, tr.amp_dtype, tr.device))  # also on resume: the host may differ
        note = cooldown_patience_note(tr.tcfg.max_steps, tr.tcfg.cooldown_steps, tr.tcfg.patience)
        if note and not resumed:
            tr.log(note)

    def _prepare_folder(self, resumed: bool) -> None:
        """Rank 0: clear what killed writes left, write config.yaml, open metrics.jsonl."""
        tr = self.tr
        with tr.writing(tr.run_dir, "creating the run folder"):
            tr.run_dir.mkdir(parents=True, exist_ok=True)
        # A write killed by kill -9 or a crash leaves its temp file (a checkpoint's size each time).
        for pattern in (".*.pt.*.tmp", ".config.yaml.*.tmp", ".metrics.jsonl.*.tmp", ".plot.png.*.tmp",
                        f".{tracking.WANDB_ID_FILE}.*.tmp"):
            for stale in tr.run_dir.glob(pattern):
                with tr.writing(stale, "deleting a killed write's temp file"):
                    stale.unlink(missing_ok=True)
        with tr.writing(tr.run_dir / "config.yaml", "config write"):
            with atomic_write(tr.run_dir / "config.yaml") as handle:  # a kill never leaves half a file
                handle.write(to_yaml(tr.cfg))
        with tr.writing(tr.run_dir / "metrics.jsonl", "metrics write"):
            self.metrics = MetricsLog(tr.run_dir / "metrics.jsonl", resume_step=tr.state.step if resumed else None,
                                      last_eval_step=tr.state.last_eval_step if resumed else None)

    def open_trackers(self) -> None:
        """TensorBoard / W&B (train.log_to), on the main rank; they continue the series on resume."""
        if self.metrics is not None and self.tr.tcfg.log_to:
            try:
                self.trackers = tracking.open_trackers(self.tr.tcfg.log_to, self.tr.run_dir, self.tr.cfg,
                                                       self.resume_step, self.metrics.records)
            except MtrainError as err:
                self.fail(err)
        self.check_failure()

    def record(self, event: dict[str, Any]) -> None:
        """One metrics record: metrics.jsonl, then the trackers (rank 0; a failure stops the run)."""
        if self.metrics is None or self.failure is not None:
            return
        try:
            with self.tr.writing(self.metrics.path, "metrics write"):
                self.metrics.write(event)
            self.trackers.log(event)
        except MtrainError as err:
            self.fail(err)

    def log_window(self, stats: dict[str, float], seconds: float) -> None:
        w = self.tr.state.window
        w["loss"] += stats["loss"]
        w["nll"] += stats["nll"]
        w["tokens"] += stats["tokens"]
        w["steps"] += 1
        w["seconds"] += seconds
        if self.tr.state.step % self.tr.tcfg.log_every:
            return
        nll = w["nll"] / max(1, w["tokens"])
        self.record({"event": "train", "step": self.tr.state.step, "epoch": self.tr.stream.epoch,
                     "loss": w["loss"] / max(1, w["tokens"]), "nll": nll, "ppl": math.exp(min(nll, 50.0)),
                     "lr": stats["lr"], "grad_norm": stats["grad_norm"], "tokens_per_s": w["tokens"] / max(w["seconds"], 1e-9),
                     "nonfinite": self.tr.state.nonfinite_total,
                     "elapsed_s": round(time.perf_counter() - self.started, 1)})  # since this process started
        self.tr.state.window = empty_window()

    def validate(self) -> bool:
        """Validate on rank 0; returns True when early stopping says stop (decided on rank 0)."""
        tr, s = self.tr, self.tr.state
        stop = False
        if tr.dist.is_main and self.failure is None:
            try:
                stop = self._validate_main()
            except MtrainError as err:
                self.fail(err)
        s.last_eval_step = s.step
        self.check_failure()
        # Only rank 0 keeps the early-stopping counters (it alone saves); everyone learns its decision.
        stop = dist_utils.broadcast_flag(stop, tr.dist, tr.device)
        return stop

    def _validate_main(self) -> bool:
        """Rank 0's part of a validation: score, best.pt, the record, the plot; True to stop early."""
        tr, s = self.tr, self.tr.state
        began = time.perf_counter()
        result = tr.validate()
        result["valid_s"] = round(time.perf_counter() - began, 1)
        improved = result["bleu"] > s.best_bleu
        if improved:
            s.best_bleu, s.best_step, s.bad_evals = result["bleu"], s.step, 0
            tr.save_best()
        else:
            s.bad_evals += 1
        self.record({"event": "valid", "step": s.step, **result, "best_bleu": s.best_bleu, "best_step": s.best_step})
        tr.log(f"step {s.step}: valid loss {result['loss']:.3f} ppl {result['ppl']:.2f} BLEU {result['bleu']:.2f} "
               f"chrF {result['chrf']:.2f}" + (" (best)" if improved else f" (best {s.best_bleu:.2f} at {s.best_step})"))
        tr.log("\n".join(f"  src: {x['src']}\n  ref: {x['ref']}\n  hyp: {x['hyp']}" for x in result["samples"]))
        if self.failure is not None:  # the record failed (DDP: it waits for the ranks to meet)
            return False
        self.trackers.flush()
        self.plot()
        stop = 0 < tr.tcfg.patience <= s.bad_evals
        if stop:
            tr.log(f"early stopping: no BLEU gain in {s.bad_evals} validations (best {s.best_bleu:.2f} at step {s.best_step})")
        return stop

    def plot(self) -> None:
        """RUN/plot.png (rank 0; a failure stops the run)."""
        if self.metrics is None or self.failure is not None:
            return
        path = self.tr.run_dir / "plot.png"
        try:
            with self.tr.writing(path, "plot write"):
                plot_metrics(self.metrics.records, path)
        except MtrainError as err:
            self.fail(err)

    def save_last(self, with_step_file: bool, average: bool = False) -> None:
        """Flush the trackers, then write last.pt: whatever a resume from it keeps is on disk.
        A write that failed on rank 0 since the last save stops every rank here instead."""
        if self.failure is None:
            try:
                self.trackers.flush()
            except MtrainError as err:
                self.fail(err)
        self.tr.save_last(with_step_file, average, failure=self.failure)

    def loop(self, stop_signal: StopSignal) -> str:
        """Updates until max_steps, early stopping or a signal. Returns why it stopped."""
        tr, t = self.tr, self.tr.tcfg
        # Redirected to a file (nohup, SLURM), redraw rarely instead of ten times a second.
        bar = tqdm(total=t.max_steps, initial=tr.state.step, unit="step", file=sys.stderr, dynamic_ncols=True,
                   mininterval=0.5 if sys.stderr.isatty() else 30.0, disable=not tr.dist.is_main)
        reason = "max_steps"
        try:
            while tr.state.step < t.max_steps:
                start = time.perf_counter()
                stats = tr.train_step()
                if stats is None:
                    tr.count_nonfinite()
                    continue
                tr.state.nonfinite_run = 0
                seconds = time.perf_counter() - start
                self.log_window(stats, seconds)
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss'] / stats['tokens']:.3f}", lr=f"{stats['lr']:.2e}",
                                tok_s=f"{stats['tokens'] / seconds:.0f}", refresh=False)
                step = tr.state.step
                # The last update validates here too, before its last.pt: a validation after the
                # last.pt of its own step would be redone, and logged twice, by a resumed run.
                if step % t.eval_every == 0 or step == t.max_steps:
                    early = self.validate()
                    if early and step % t.eval_every == 0:  # the end's own validation stops nothing early
                        reason = "early_stopping"
                        break
                interrupted, failed = self._flags(stop_signal.signum is not None, self.failure is not None)
                if failed:
                    raise self._failure_error()
                if interrupted:
                    self.plot()  # before last.pt, like every write
                if step % t.save_every == 0 or interrupted:
                    self.save_last(with_step_file=step % t.save_every == 0)
                if interrupted:
                    return "interrupted"
        finally:
            bar.close()
        return reason

    def finish(self, reason: str) -> None:
        """Final validation (if the last step had none: the loop validates at max_steps, so only a
        run resumed at a lowered max_steps), plot, then step file, averaged.pt and last.pt: a
        last.pt that says the run finished comes after every other file of the run."""
        tr, s = self.tr, self.tr.state
        if s.last_eval_step != s.step:
            self.validate()
        self.plot()
        # Always rewrite last.pt: the final validation changed best/early-stopping state.
        s.finished = reason
        self.save_last(with_step_file=not (tr.run_dir / f"step-{s.step}.pt").is_file(),
                       average=tr.tcfg.average_last > 0)


def summarize(trainer: Trainer) -> dict[str, Any]:
    """The --dry-run report: model size and what the batches look like."""
    split = trainer.stream.split_of(1)  # sampled segmentations when train.sampling_alpha > 0
    batches = trainer.stream.batches(1)
    padded = [len(b) * (max(int(split.src.lengths[b].max()), int(split.tgt.lengths[b].max())) + 1) for b in batches]
    real = [target_tokens(split.tgt.lengths, [b]) for b in batches]
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "device": str(trainer.device),
        "train_sentences": len(split.src),
        "valid_sentences": len(trainer.valid_split.src),
        "batches_per_epoch": len(batches),
        "updates_per_epoch": math.ceil(len(batches) / (trainer.tcfg.update_freq * trainer.dist.world_size)),
        "tokens_per_batch": {"mean": round(float(np.mean(padded)), 1), "max": int(max(padded))},
        "target_tokens_per_batch": {"mean": round(float(np.mean(real)), 1), "max": int(max(real))},
        "max_tokens": trainer.tcfg.max_tokens,
        "model": to_dict(trainer.cfg)["model"],
    }


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path | None, device: str = "auto",
          dry_run: bool = False) -> dict[str, Any]:
    """Train (or resume, when run_dir holds last.pt) and return a summary dict."""
    info = dist_utils.from_env()
    torch_device = resolve_device(device)
    if torch_device.type == "cuda" and info.enabled:
        torch_device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(torch_device)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    dist_utils.setup(info, torch_device)
    try:
        with contextlib.ExitStack() as stack:
            if not dry_run:  # a dry run writes nothing
                lock_run_folder(stack, Path(run_dir or "."), info, torch_device)
            trainer = Trainer(cfg, Path(data_dir), Path(run_dir or "."), torch_device, info)
            if dry_run:
                summary = summarize(trainer)
                if info.is_main:
                    print(json.dumps(summary, indent=2))
                return summary
            return _run(trainer)
    finally:
        dist_utils.teardown(info)


def lock_run_folder(stack: contextlib.ExitStack, run_dir: Path, info: dist_utils.DistInfo,
                    device: torch.device) -> None:
    """Rank 0 takes RUN/.lock (held until `stack` closes, at the end of the run) before anything is
    written there; the other ranks of the job never try (rank 0 alone writes), and stop with it
    when the folder is in use."""
    error: MtrainError | None = None
    if info.is_main:
        try:
            stack.enter_context(RunLock(run_dir))
        except MtrainError as err:
            error = err
    if dist_utils.any_rank(error is not None, info, device):
        raise error or MtrainError(f"{run_dir}: rank 0 could not lock the run folder; see its error line")


def _run(trainer: Trainer) -> dict[str, Any]:
    run = Run(trainer)
    run.start()
    s, t = trainer.state, trainer.tcfg
    early_stopped = s.finished == "early_stopping" and 0 < t.patience <= s.bad_evals
    if s.finished and (early_stopped or s.step >= t.max_steps):
        trainer.log(f"{trainer.run_dir / 'last.pt'}: this run already ended at step {s.step} ({s.finished}); "
                    "raise train.max_steps (or train.patience) to train further")
        return _summary(trainer, "done", None)
    s.finished = ""
    trainer.model.train()
    run.open_trackers()
    failed = True
    try:
        with StopSignal() as stop_signal:
            # A run killed during finish() resumes straight into it (step == max_steps, not finished).
            reason = run.loop(stop_signal) if s.step < t.max_steps else "max_steps"
            if reason == "interrupted":
                trainer.log(f"stopped at step {s.step}; {trainer.run_dir / 'last.pt'} saved; "
                            "re-run the same command to resume")
            else:
                run.finish(reason)
        failed = False
    finally:  # also on an error or a second Ctrl-C: the trackers write what they hold
        run.trackers.close(failed)
    return _summary(trainer, reason, stop_signal.signum)


def _summary(trainer: Trainer, reason: str, signum: int | None) -> dict[str, Any]:
    s = trainer.state
    summary = {"stopped": reason, "step": s.step, "best_bleu": s.best_bleu if s.best_step else None,
               "best_step": s.best_step, "nonfinite": s.nonfinite_total, "run_dir": str(trainer.run_dir)}
    if signum is not None:
        summary["signal"] = int(signum)
    return summary
