"""Metrics trackers besides RUN/metrics.jsonl (`train.log_to`): TensorBoard and Weights & Biases.

Every record the training loop writes to metrics.jsonl goes to each tracker as well: its numeric
fields as scalars tagged `EVENT/FIELD` (`train/loss`, `valid/bleu`) at the record's step, its
validation samples as text (`valid/samples`). The resolved config goes once: as text (TensorBoard)
or as the run's config (W&B). Only the main process opens trackers.

Exact resume holds for the trackers too: a run resumed from last.pt at step S (after a stop, or a
kill -9 at any moment) continues the same series, with nothing after S left from the process that
was stopped and nothing missing up to S: the loop flushes the trackers before it writes last.pt.
A tracker that a resumed run enables for the first time catches up from metrics.jsonl.

A tracker that fails (a full disk under RUN/tensorboard/, a W&B error) stops the run with one line,
like any other failed write of a run, rather than being reported and switched off: a tracker left
off would keep a hole in its series that no resume fills (only a tracker new to a run catches up
from metrics.jsonl), while a stop leaves last.pt and the tracker at the same point, and the same
command, once the cause is fixed, continues both exactly. A full disk would stop the run at its
next checkpoint anyway.
"""

from __future__ import annotations

import importlib
import os
import re
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from mtrain.atomic import atomic_write, describe_write_error
from mtrain.config import Config, to_dict, to_yaml
from mtrain.errors import MtrainError

WANDB_ID_FILE = "wandb-run-id"  # RUN/wandb-run-id: the W&B run that a resumed run continues
TENSORBOARD_DIR = "tensorboard"  # RUN/tensorboard/: the event files


class Tracker(Protocol):
    """What the loop calls: log(record) per metrics record; flush() after each validation and before
    each last.pt; close(failed) once, at the end, on a stop or on an error. `where` is what it
    writes (a folder of the run), for error messages."""

    where: Path

    def log(self, record: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self, failed: bool) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """`EVENT/FIELD` -> value for every numeric field of a metrics record but its step."""
    event = record.get("event", "event")
    return {f"{event}/{key}": value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def samples_markdown(samples: list[dict[str, str]]) -> str:
    """Validation samples as a Markdown table (TensorBoard renders text summaries as Markdown)."""
    def cell(text: str) -> str:
        return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

    rows = [f"| {cell(s.get('src', ''))} | {cell(s.get('ref', ''))} | {cell(s.get('hyp', ''))} |" for s in samples]
    return "\n".join(["| src | ref | hyp |", "|---|---|---|", *rows])


# ---------------------------------------------------------------- availability

def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def check_available(targets: tuple[str, ...] | list[str]) -> None:
    """Import each tracker's package now, so a missing one is a one-line error before training."""
    modules = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb",)}
    for target in targets:
        try:
            for module in modules[target]:
                importlib.import_module(module)
        except ImportError:
            raise MtrainError(f"train.log_to={target} needs the {target} package; "
                              f"pip install 'mtrain[{target}]' (or drop {target} from train.log_to)") from None
        except Exception as err:  # installed but broken (e.g. a protobuf version clash)
            raise MtrainError(f"train.log_to={target}: the {target} package fails to import ({_first_line(err)}); "
                              f"reinstall it with pip install --force-reinstall 'mtrain[{target}]'") from None


# ---------------------------------------------------------------- TensorBoard

class TensorBoardTracker:
    """Event files under RUN/tensorboard/, one per process, through torch's SummaryWriter.

    Resume: the writer starts its file with a restart marker at step S + 1 (SummaryWriter's
    purge_step), and TensorBoard's readers drop every event of earlier files from that step on:
    what a killed process logged after last.pt is replaced by the resumed run's values. A fresh
    start marks step 0, hiding whatever an earlier attempt without last.pt left. Readers take the
    files in name order, which starts with the creation second, so a new file waits for a second
    later than the newest file's."""

    def __init__(self, run_dir: Path, cfg: Config, resume_step: int | None, history: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self.where = run_dir / TENSORBOARD_DIR
        existing = sorted(self.log_dir.glob("events.out.tfevents.*"))
        _wait_past(existing)
        _quiet_writer_threads()
        self.writer = SummaryWriter(str(self.log_dir), purge_step=0 if resume_step is None else resume_step + 1,
                                    flush_secs=30)
        if resume_step is None or not existing:  # a new series: the config, then what metrics.jsonl holds
            try:
                self.writer.add_text("config", "\n".join("    " + line for line in to_yaml(cfg).splitlines()), 0)
                for record in history:
                    self.log(record)
                self.flush()
            except BaseException:
                try:
                    self.writer.close()
                except Exception:
                    pass  # the first error is the one to report
                raise

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        if record.get("samples"):
            self.writer.add_text(f"{record.get('event', 'event')}/samples", samples_markdown(record["samples"]), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


def _quiet_writer_threads() -> None:
    """TensorBoard writes from a thread of its own; a failed write ends that thread with a traceback
    on stderr, and the same error comes back from the writer's next call in the training process,
    which stops the run with one line. Keep the thread's traceback off stderr (once per process)."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard layout: its tracebacks stay
        return
    previous = threading.excepthook
    if getattr(previous, "mtrain_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.thread, _AsyncWriterThread):
            previous(args)

    hook.mtrain_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _wait_past(files: list[Path]) -> None:
    """Sleep until the clock's second is past the creation second in the newest event file's name."""
    seconds = [int(m.group(1)) for f in files if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", f.name))]
    if seconds:
        delay = max(seconds) + 1 - time.time()
        if 0 < delay <= 2:  # a clock far behind the file (another host) cannot be waited out
            time.sleep(delay)


# ---------------------------------------------------------------- Weights & Biases

class WandbTracker:
    """One W&B run per training run: its id is kept in RUN/wandb-run-id, and a resumed run
    continues it (wandb.init(id=..., resume="allow")). Local files go under RUN/wandb/.
    WANDB_MODE=offline needs no account (upload later with `wandb sync`); the project is
    $WANDB_PROJECT, else "mtrain"."""

    def __init__(self, run_dir: Path, cfg: Config, resume_step: int | None, history: list[dict[str, Any]]) -> None:
        import wandb

        self.wandb = wandb
        self.where = run_dir / "wandb"
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text(encoding="utf-8").strip() if resume_step is not None and id_file.is_file() else ""
        new = not run_id
        if new:  # a fresh start begins a new W&B run, as metrics.jsonl begins anew
            run_id = secrets.token_hex(8)
            try:
                with atomic_write(id_file) as handle:
                    handle.write(run_id + "\n")
            except OSError as err:
                raise tracker_error("wandb", id_file, err, run_dir) from None
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "mtrain", dir=str(run_dir), id=run_id,
                                  name=run_dir.resolve().name, resume="allow", config=to_dict(cfg))
        except Exception as err:  # no API key, no network, a bad WANDB_* setting
            raise MtrainError(f"train.log_to=wandb: wandb.init failed ({_first_line(err)}); run `wandb login`, "
                              "or set WANDB_MODE=offline to log without an account") from None
        if new:
            for record in history:
                self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        values: dict[str, Any] = dict(scalars(record))
        if record.get("samples"):
            values[f"{record.get('event', 'event')}/samples"] = self.wandb.Table(
                columns=["src", "ref", "hyp"], data=[[s.get("src"), s.get("ref"), s.get("hyp")] for s in record["samples"]])
        # W&B ignores the steps a run already has (at or below its last logged step): after a
        # kill, the resumed run re-logs the steps since last.pt and W&B keeps the killed process's
        # values of them. Resume is bit-exact, so those are the same values (wall-clock fields
        # aside) and the series stays the uninterrupted run's.
        self.run.log(values, step=int(record["step"]))

    def flush(self) -> None:
        pass  # the W&B service writes as it receives

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


# ---------------------------------------------------------------- the set of trackers

TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def tracker_error(name: str, where: Path | None, err: BaseException, run_dir: Path | None = None) -> MtrainError:
    """The line that stops a run whose tracker failed: what it writes, the cause, what to do."""
    where = where or run_dir or f"train.log_to={name}"
    cause, remedy = describe_write_error(err)
    folder = f"the checkpoints in {run_dir}" if run_dir is not None else "the checkpoints"
    return MtrainError(f"{where}: the {name} tracker failed ({cause}); metrics.jsonl and {folder} are intact; "
                       f"{remedy or 'fix the cause'} and re-run the same command to resume "
                       f"(or drop {name} from train.log_to)")


class Trackers:
    """The trackers of train.log_to, used as one (none: every call does nothing). A tracker whose
    call fails is closed and dropped, and the failure comes back as one MtrainError line."""

    def __init__(self, trackers: list[tuple[str, Tracker]] | None = None, run_dir: Path | None = None) -> None:
        self.trackers = trackers or []
        self.run_dir = run_dir

    def _each(self, call: str, *args: Any) -> None:
        for name, tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as err:
                self.trackers.remove((name, tracker))
                try:
                    tracker.close(True)
                except Exception:
                    pass  # the error below says what failed
                raise tracker_error(name, getattr(tracker, "where", None), err, self.run_dir) from None

    def log(self, record: dict[str, Any]) -> None:
        self._each("log", record)

    def flush(self) -> None:
        self._each("flush")

    def close(self, failed: bool = False) -> None:
        """Close every tracker; a failure to close is reported, never raised over the run's outcome."""
        trackers, self.trackers = self.trackers, []
        for name, tracker in trackers:
            try:
                tracker.close(failed)
            except Exception as err:
                print(f"note: closing the {name} tracker failed ({_first_line(err)}); "
                      "metrics.jsonl holds every record", file=sys.stderr)


def open_trackers(targets: tuple[str, ...] | list[str], run_dir: Path, cfg: Config, resume_step: int | None,
                  history: list[dict[str, Any]]) -> Trackers:
    """Open the trackers of train.log_to for a run starting fresh (resume_step None) or resumed
    at resume_step; history is what metrics.jsonl keeps, for a tracker new to the run."""
    check_available(targets)
    opened = Trackers(run_dir=Path(run_dir))
    try:
        for target in dict.fromkeys(targets):
            try:
                tracker = TRACKERS[target](Path(run_dir), cfg, resume_step, history)
            except MtrainError:
                raise
            except Exception as err:  # its folder cannot be written, its first records fail
                where = Path(run_dir) / (TENSORBOARD_DIR if target == "tensorboard" else "wandb")
                raise tracker_error(target, where, err, Path(run_dir)) from None
            opened.trackers.append((target, tracker))
    except BaseException:
        opened.close(failed=True)
        raise
    return opened
