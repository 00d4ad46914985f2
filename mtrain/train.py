"""The training loop: `Run` drives a Trainer (mtrain.trainer) through logging windows,
validation and saving cadence and stopping; `train` sets up devices, processes and the run folder.
Exact resume: re-run the same command.

One trainer per run folder: `train` holds RUN/.lock (mtrain.lock) from before the first write to
the end of the run; under torchrun only rank 0 takes it, as rank 0 alone writes.

Every write of a run (checkpoints, metrics.jsonl, plot.png, config.yaml, the trackers, deleting
old step files, averaged.pt) that fails stops the run with one line naming the file and the
cause, and the same command resumes once the cause is fixed. Under DDP a failure on rank 0 stops
every rank at the next point where they all meet, so none is left waiting in a collective."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from mtrain import tracking
from mtrain import distributed as dist_utils
from mtrain import cpu, init
from mtrain.atomic import atomic_write
from mtrain.config import Config, to_dict, to_yaml
from mtrain.data import TokenizedData, target_tokens
from mtrain.errors import MtrainError, first_line, is_lost_peer
from mtrain.init import Start
from mtrain.hardware import amp_note, precision_name, resolve_device
from mtrain.lock import RunLock
from mtrain.memory import release_free_memory
from mtrain.plot import MetricsLog, plot_metrics
from mtrain.resume import empty_window
from mtrain.schedule import cooldown_patience_note, format_duration, time_cooldown_start
from mtrain.trainer import Trainer


# The clock train.max_time reads (tests replace it with one that advances a fixed time per update).
clock = time.perf_counter


def peak_memory(device: torch.device) -> dict[str, float]:
    """The most device memory tensors held since the last train record, validation included (CUDA's
    caching allocator counts it; a CPU has no such counter, so its records have no field): the
    figure to compare with the GPU's memory when choosing train.max_tokens. The counter restarts
    for the next window. Under DDP the record is rank 0's."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_memory_gib": round(peak, 3)}


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


# ---------------------------------------------------------------- the loop

class Run:
    """The loop around a Trainer: logging windows, validation/saving cadence, stopping."""

    def __init__(self, trainer: Trainer) -> None:
        self.tr = trainer
        self.metrics: MetricsLog | None = None
        self.trackers = tracking.Trackers()  # train.log_to, on the main rank once open_trackers ran
        self.resume_step: int | None = None
        self.started = time.perf_counter()
        self.mark = clock()  # the clock when state.train_seconds was last brought up to date
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

    def _meet(self, seconds: float, *flags: bool) -> tuple[float, list[bool]]:
        """Once per update, one collective: the seconds this update took averaged over the ranks
        (so that every rank's train.max_time schedule reads the same time) and each flag raised on
        any rank."""
        if not self.tr.dist.enabled:
            return seconds, list(flags)
        values = torch.tensor([seconds, *(1.0 if f else 0.0 for f in flags)], dtype=torch.float64, device=self.tr.device)
        summed = dist_utils.all_reduce_sum(values, self.tr.dist).tolist()
        return summed[0] / self.tr.dist.world_size, [v > 0 for v in summed[1:]]

    def account(self, *flags: bool) -> list[bool]:
        """Add the training time since the last call to state.train_seconds (the same on every
        rank) and return each flag raised on any rank."""
        now = clock()
        spent, raised = self._meet(now - self.mark, *flags)
        self.mark = now
        self.tr.state.train_seconds += spent
        return raised

    def train_time(self) -> float:
        """Training seconds so far, the time since the last update's end included."""
        return self.tr.state.train_seconds + clock() - self.mark

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
            if tr.start is not None:
                tr.log(f"starting from {tr.start.path} (SHA-256 {tr.start.sha256[:12]}...): its weights and model "
                       "section; a fresh optimizer and lr schedule")
        log_precision(tr)  # also on resume: the host may differ
        note = cooldown_patience_note(tr.tcfg.max_steps, tr.tcfg.cooldown_steps, tr.tcfg.patience,
                                      tr.budget, tr.tcfg.cooldown_fraction)
        if note and not resumed:
            tr.log(note)
        if tr.budget:
            cool = time_cooldown_start(tr.budget, tr.tcfg.cooldown_fraction)
            tr.log(f"time budget train.max_time={tr.tcfg.max_time}: the lr cools down from {format_duration(cool)} of "
                   f"training and updates stop at {format_duration(tr.budget)} "
                   f"({format_duration(tr.state.train_seconds)} trained so far)")

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
        if tr.start is not None and not resumed:
            with tr.writing(tr.run_dir / init.RECORD, "init_from.json write"):
                init.write_record(tr.run_dir, tr.start)
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
                     "elapsed_s": round(time.perf_counter() - self.started, 1),  # since this process started
                     "train_s": round(self.train_time(), 1),  # training time over all invocations (train.max_time)
                     **peak_memory(self.tr.device)})
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
        result["train_s"] = round(self.train_time(), 1)  # training time at the end of this validation
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

    def progress_bar(self) -> tqdm:
        """Updates out of max_steps, or with train.max_time, training seconds out of the budget."""
        tr = self.tr
        total, done, unit = ((round(tr.budget), round(tr.state.train_seconds), "s") if tr.budget
                             else (tr.tcfg.max_steps, tr.state.step, "step"))
        # Training seconds are floats: shown whole, without tqdm's own rate (seconds per second).
        shape = "{l_bar}{bar}| {n:.0f}/{total} s of training [{elapsed}<{remaining}{postfix}]" if tr.budget else None
        # Redirected to a file (nohup, SLURM), redraw rarely instead of ten times a second.
        return tqdm(total=total, initial=min(done, total), unit=unit, file=sys.stderr, dynamic_ncols=True,
                    bar_format=shape, mininterval=0.5 if sys.stderr.isatty() else 30.0, disable=not tr.dist.is_main)

    def loop(self, stop_signal: StopSignal) -> str:
        """Updates until max_steps, the time budget, early stopping or a signal. Returns why it stopped."""
        tr, t = self.tr, self.tr.tcfg
        bar = self.progress_bar()
        reason = "max_steps"
        self.mark = clock()  # time before the loop (start-up, a resume's restart) is not training time
        try:
            while tr.state.step < t.max_steps:
                if tr.budget and tr.state.train_seconds >= tr.budget:
                    reason = "max_time"
                    break
                start = time.perf_counter()
                stats = tr.train_step()
                if stats is None:
                    tr.count_nonfinite()
                    continue
                if not stats:  # float16 overflow: the scaler lowered its scale and skipped the update
                    continue
                tr.state.nonfinite_run = 0
                seconds = time.perf_counter() - start
                self.log_window(stats, seconds)
                if not tr.budget:
                    bar.update(1)
                bar.set_postfix(loss=f"{stats['loss'] / stats['tokens']:.3f}", lr=f"{stats['lr']:.2e}",
                                tok_s=f"{stats['tokens'] / seconds:.0f}", refresh=False)
                step, early = tr.state.step, False
                # The last update validates here too, before its last.pt: a validation after the
                # last.pt of its own step would be redone, and logged twice, by a resumed run.
                if step % t.eval_every == 0 or step == t.max_steps:
                    # the end's own validation stops nothing early
                    early = self.validate() and step % t.eval_every == 0
                interrupted, failed = self.account(stop_signal.signum is not None, self.failure is not None)
                if tr.budget:
                    bar.update(min(tr.state.train_seconds, bar.total) - bar.n)
                if failed:
                    raise self._failure_error()
                if early:
                    reason = "early_stopping"
                    break
                if interrupted:
                    self.plot()  # before last.pt, like every write
                if step % t.save_every == 0 or interrupted:
                    self.save_last(with_step_file=step % t.save_every == 0)
                if step % t.eval_every == 0 or step % t.save_every == 0:
                    release_free_memory()  # what validation and saving freed, and the steps' holes since
                if interrupted:
                    return "interrupted"
                # Saving is not training time: last.pt cannot hold the time of its own write, so
                # counting it would give a resumed run less time than an uninterrupted one.
                self.mark = clock()
        finally:
            bar.close()
        return reason

    def finish(self, reason: str) -> None:
        """Final validation (if the last step had none: after train.max_time, or a run resumed at
        a lowered max_steps; the loop validates at max_steps itself), plot, then step file,
        averaged.pt and last.pt: a last.pt that says the run finished comes after every other file
        of the run."""
        tr, s = self.tr, self.tr.state
        if s.last_eval_step != s.step:
            self.validate()
        self.account()  # the final validation is training time too
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
        "max_tokens": trainer.tcfg.max_tokens,  # resolved: a number also for train.max_tokens=auto
        "precision": precision_name(trainer.amp_dtype),
        "model": to_dict(trainer.cfg)["model"],
    }


def log_precision(trainer: Trainer) -> None:
    """The precision the run trains in and, on a CPU, which fast paths run (mtrain.cpu), the C
    kernels built first if they are not yet."""
    trainer.log(amp_note(trainer.tcfg.amp, trainer.amp_dtype, trainer.device))
    if trainer.device.type == "cpu":
        cpu.prepare()  # any build happens here, before the first step
        trainer.log(cpu.describe(cpu.acceleration()))


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path | None, device: str = "auto",
          dry_run: bool = False, start: Start | None = None) -> dict[str, Any]:
    """Train (or resume, when run_dir holds last.pt) and return a summary dict. start: the
    checkpoint a new run takes its weights from (mtrain.init)."""
    info = dist_utils.from_env()
    torch_device = resolve_device(device)
    if torch_device.type == "cuda" and info.enabled:
        torch_device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(torch_device)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    if start is not None:  # before the run folder is made: a refusal leaves nothing behind
        init.check_vocabulary(start, Path(data_dir), TokenizedData(data_dir).tokenizer.to_state())
        if run_dir is not None:
            init.check_resume(Path(run_dir), start)
    dist_utils.setup(info, torch_device)
    try:
        with contextlib.ExitStack() as stack:
            if not dry_run:  # a dry run writes nothing
                lock_run_folder(stack, Path(run_dir or "."), info, torch_device)
            trainer = Trainer(cfg, Path(data_dir), Path(run_dir or "."), torch_device, info, start)
            if dry_run:
                summary = summarize(trainer)
                log_precision(trainer)
                if info.is_main:
                    print(json.dumps(summary, indent=2))
                return summary
            return _run(trainer)
    except RuntimeError as err:
        if info.enabled and is_lost_peer(err):
            raise lost_peer_error(err, info, Path(run_dir or ".")) from None
        raise
    finally:
        dist_utils.teardown(info)


def lost_peer_error(err: RuntimeError, info: dist_utils.DistInfo, run_dir: Path) -> MtrainError:
    """The line a rank prints when another rank of the job stopped (out of memory, killed, a
    failed write) while this one waited for it in a collective: the other rank's own line says why."""
    cause = re.sub(r"^\[[^\]]*\]\s*", "", first_line(err)).split(". ")[0]  # gloo prefixes its source file and line
    last = run_dir / "last.pt"
    resume = (f"{last} holds the last save: fix the cause and re-run the same command to resume from it"
              if last.is_file() else "nothing was saved yet: fix the cause and re-run the same command")
    return MtrainError(f"rank {info.rank}: another rank of this job stopped ({cause}); its own error line says why. "
                       + resume)


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
    spent = bool(trainer.budget) and s.train_seconds >= trainer.budget
    if s.finished and (early_stopped or s.step >= t.max_steps or spent):
        trainer.log(f"{trainer.run_dir / 'last.pt'}: this run already ended at step {s.step} ({s.finished}, "
                    f"{format_duration(s.train_seconds)} of training); raise train.max_steps, train.max_time or "
                    "train.patience to train further")
        return _summary(trainer, "done", None)
    if spent:
        trainer.log(f"train.max_time={t.max_time} is spent ({format_duration(s.train_seconds)} trained, to step "
                    f"{s.step}): no more updates; the run ends with its final validation"
                    + (" and averaged.pt" if t.average_last > 0 else ""))
    s.finished = ""
    trainer.model.train()
    run.open_trackers()
    failed = True
    try:
        with StopSignal() as stop_signal:
            # A run killed during finish() resumes straight into it (step == max_steps, not finished).
            if spent:
                run.mark = clock()  # start-up is not training time
                reason = "max_time"
            else:
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
