"""Faults during training, proven by injecting them: kill -9 at any instant of a run's life (then
the same command again ends bit-identical to an uninterrupted run), failing checkpoint writes,
truncated, corrupted and hostile checkpoints (a pickle that would run code), and non-finite losses.

Run as a script, this file is `python -m mtrain` with a kill point installed (see KillPoint): the
process SIGKILLs itself at an exact place (mid-update, mid-validation, partway through writing a
checkpoint, a metrics line, the plot or averaged.pt, in the final summary), which no timer can hit
reliably. Timer kills from outside add truly random instants. The kill campaign (`-m slow`) draws
at least 20 of both from a seed it prints; MTRAIN_TEST_KILL_SEED=N replays one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.max_tokens=512", "train.warmup_steps=10", "train.log_every=1",
        "train.eval_max_sentences=4", "train.num_threads=1", "train.save_every=2", "train.eval_every=3"]
# The kill campaign's runs also average their last 3 step files into averaged.pt at the end.
CAMPAIGN = TINY + ["train.average_last=3"]
from mtrain.plot import (
    TIME_FIELDS,  # the only metrics that may differ between two identical runs
)

# ---------------------------------------------------------------- kill points (run in the child)

# The places a kill point can hit. In an update: the optimizer step, then its metrics.jsonl line.
# At a validation: the valid loss, the decoded sentences, best.pt, the valid line, the plot. At a
# save: the step file, then last.pt. At the end of the run: the final plot, reading the step files
# to average them, writing averaged.pt, and the summary the CLI prints. Where each falls in a run
# is not assumed here: a traced run lists them in the order it meets them (see `install`).
PHASES = ("step", "log-train", "validate", "decode", "best.pt", "log-valid", "plot", "step-N.pt", "last.pt",
          "final-plot", "average", "averaged.pt", "summary")
END_PHASES = ("final-plot", "average", "averaged.pt", "summary")


@dataclass(frozen=True)
class KillPoint:
    """SIGKILL the training process at `phase` of optimizer update `step`, the first time the
    process gets there. For the phases that write a file, `fraction` of the file's bytes reach it
    first (then fsync, then death), exactly what a kill during the write leaves on disk."""

    phase: str
    step: int
    fraction: float = 0.5

    def encode(self) -> str:
        return f"{self.phase},{self.step},{self.fraction}"

    @staticmethod
    def decode(text: str) -> KillPoint:
        phase, step, fraction = text.split(",")
        assert phase in PHASES, phase
        return KillPoint(phase, int(step), float(fraction))

    def torn_file(self) -> str | None:
        """The file this kill leaves partly written: as a temp file beside it, or (metrics.jsonl)
        as a last line without its end."""
        return {"log-train": "metrics.jsonl", "log-valid": "metrics.jsonl", "best.pt": "best.pt",
                "plot": "plot.png", "final-plot": "plot.png", "step-N.pt": f"step-{self.step}.pt",
                "last.pt": "last.pt", "averaged.pt": "averaged.pt"}.get(self.phase)

    def __str__(self) -> str:
        return f"{self.phase}@{self.step}" + (f" ({self.fraction:.0%} written)" if self.torn_file() else "")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: KillPoint | None = None, trace: Path | None = None) -> None:
    """Patch the trainer so that this process kills itself at `point`, or (trace) appends each
    place it passes to that file as a `phase,step` line. Every patch calls what it replaces; no
    result changes (the campaign checks that a traced run ends identical to a plain one)."""
    import contextlib
    import io

    from mtrain import checkpoint, plot
    from mtrain import train as train_mod
    from mtrain import trainer as trainer_mod

    now = {"run": None, "validating": False, "finishing": False, "averaging": False, "loads": 0}

    def hit(phase: str, step: int) -> bool:
        """True where this process must die (for a write: once part of the bytes is written)."""
        if trace is not None:
            with open(trace, "a", encoding="utf-8") as handle:
                handle.write(f"{phase},{step}\n")
        return point is not None and (phase, step) == (point.phase, point.step)

    def write_part_and_die(handle, data) -> None:
        handle.write(data[: int(len(data) * point.fraction)])
        handle.flush()
        os.fsync(handle.fileno())
        _die()

    def patch(owner, name: str):
        """Decorator: owner.name becomes the decorated function, which gets the original first."""
        original = getattr(owner, name)

        def apply(function):
            setattr(owner, name, lambda *args, **kwargs: function(original, *args, **kwargs))
            return function

        return apply

    @patch(train_mod.Run, "start")  # the run whose step the other places read
    def start(original, self):
        now["run"] = self
        return original(self)

    def flagged(flag: str):
        def wrapper(original, *args, **kwargs):
            now[flag] = True
            try:
                return original(*args, **kwargs)
            finally:
                now[flag] = False

        return wrapper

    patch(train_mod.Run, "validate")(flagged("validating"))
    patch(train_mod.Run, "finish")(flagged("finishing"))
    patch(checkpoint, "average_checkpoints")(flagged("averaging"))

    def step_now() -> int:
        return now["run"].tr.state.step

    @patch(trainer_mod.Trainer, "_clip_and_step")  # gradients computed, the optimizer update in progress
    def clip_and_step(original, self):
        if hit("step", self.state.step + 1):
            _die()
        return original(self)

    @patch(plot.MetricsLog, "write")  # part of the event's line appended to metrics.jsonl
    def metrics_write(original, self, record):
        if hit(f"log-{record.get('event')}", record.get("step")):
            with open(self.path, "a", encoding="utf-8") as handle:
                write_part_and_die(handle, json.dumps(record) + "\n")
        return original(self, record)

    @patch(trainer_mod.Trainer, "_valid_loss")  # valid loss done, translations not yet
    def valid_loss(original, self):
        result = original(self)
        if hit("validate", self.state.step):
            _die()
        return result

    @patch(trainer_mod, "translate_lines")  # the valid sentences translated, not yet scored
    def translate_lines(original, *args, **kwargs):
        hyps = original(*args, **kwargs)
        if hit("decode", step_now()):
            _die()
        return hyps

    torn_plot = []

    @patch(train_mod.Run, "plot")  # a validation's plot, or the one the end of the run writes
    def run_plot(original, self):
        phase = "final-plot" if now["finishing"] and not now["validating"] else "plot"
        if hit(phase, self.tr.state.step):
            torn_plot.append(True)
        return original(self)

    atomic_write = plot.atomic_write

    @contextlib.contextmanager
    def plot_atomic_write(path, *args, **kwargs):  # part of the PNG in plot.png's temp file
        if not torn_plot:
            with atomic_write(path, *args, **kwargs) as handle:
                yield handle
            return
        buffer = io.BytesIO()
        yield buffer
        with atomic_write(path, *args, **kwargs) as handle:
            write_part_and_die(handle, buffer.getvalue())

    plot.atomic_write = plot_atomic_write

    @patch(checkpoint, "load")  # averaging has read its first step file, not the others
    def load(original, *args, **kwargs):
        if now["averaging"]:
            now["loads"] += 1
            if now["loads"] == 2 and hit("average", step_now()):
                _die()
        return original(*args, **kwargs)

    torn_save, real_save = [], torch.save

    def save(obj, handle, *args, **kwargs):  # part of the checkpoint in its temp file
        if not torn_save:
            return real_save(obj, handle, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        write_part_and_die(handle, buffer.getvalue())

    checkpoint.torch.save = save

    @patch(checkpoint, "save_atomic")
    def save_atomic(original, obj, path):
        name = Path(path).name
        phase = "step-N.pt" if name.startswith("step-") else name
        if phase in PHASES and hit(phase, obj["step"]):
            torn_save.append(True)
        return original(obj, path)

    @patch(train_mod, "_summary")  # the run is over, the CLI has not printed its summary yet
    def summary(original, trainer, *args, **kwargs):
        result = original(trainer, *args, **kwargs)
        if hit("summary", trainer.state.step):
            _die()
        return result


def traced_order(trace: Path) -> list[tuple[KillPoint, bool]]:
    """The places a traced run met, each once, in the order it first met them; with each, whether
    it comes after the run's final last.pt (which records that the run ended: a re-run only
    reports that, so at most one such kill, the last, fits in one run folder). A kill point fires
    the first time its process gets there, and a resumed run replays the sequence from its
    last.pt on, so the points of any list in this order are reached one by one, each in the run
    that resumed after the previous one's kill."""
    events = []
    for line in trace.read_text(encoding="utf-8").splitlines():
        phase, step = line.split(",")
        events.append((phase, int(step)))
    final_save = max(i for i, (phase, _) in enumerate(events) if phase == "last.pt")
    order, seen = [], set()
    for i, event in enumerate(events):
        if event not in seen:
            seen.add(event)
            order.append((KillPoint(*event), i > final_save))
    return order


# ---------------------------------------------------------------- helpers (run in the test)

def train_args(data_dir: Path, run_dir: Path, max_steps: int, settings: list[str] = TINY) -> list[str]:
    args = ["train", "--data", str(data_dir), "--out", str(run_dir), "--device", "cpu", "--max-steps", str(max_steps)]
    for item in settings:
        args += ["--set", item]
    return args


def child_env() -> dict[str, str]:
    """One thread; this checkout's mtrain first (this file, run as a script, starts in tests/); MKL's
    own kernel choice, as in this test process, which imported torch before mtrain.cpu.mkl
    could load its stub: runs compared bit for bit must multiply with the same kernels."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": path,
            "MTRAIN_MKL_INTEL_PATH": "0"}


def start(args: list[str], point: KillPoint | None = None, trace: Path | None = None) -> subprocess.Popen:
    """`python -m mtrain ARGS`, or this file as the same CLI with a kill point (or a trace) installed."""
    if point is None and trace is None:
        command = [sys.executable, "-m", "mtrain", *args]
    else:
        command = [sys.executable, __file__, point.encode() if point else f"trace={trace}", *args]
    return subprocess.Popen(command, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, kill_after: float | None = None) -> tuple[int, str]:
    """Wait for the process (SIGKILL it after `kill_after` seconds); (exit code, stderr)."""
    try:
        _, err = proc.communicate(timeout=kill_after if kill_after is not None else 300)
    except subprocess.TimeoutExpired:
        if kill_after is None:
            proc.kill()
            raise
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err.decode("utf-8", "replace")


def reference_run(data_dir: Path, run_dir: Path, max_steps: int, settings: list[str] = TINY) -> None:
    """The uninterrupted run, in this process (no interpreter start-up): same config, one thread."""
    from mtrain.config import load_config
    from mtrain.train import train

    train(load_config(None, settings + [f"train.max_steps={max_steps}"]), data_dir, run_dir, device="cpu")


def metrics(run_dir: Path) -> list[dict]:
    from mtrain.plot import read_metrics

    return [{k: v for k, v in r.items() if k not in TIME_FIELDS} for r in read_metrics(run_dir / "metrics.jsonl")]


def assert_identical_runs(reference: Path, resumed: Path) -> None:
    """Every weight, Adam moment, step file, the best model, the loop state and the metrics log."""
    from mtrain import checkpoint

    names = sorted(p.name for p in reference.glob("*.pt"))
    assert names == sorted(p.name for p in resumed.glob("*.pt"))
    for name in names:
        a, b = checkpoint.load(reference / name), checkpoint.load(resumed / name)
        assert a["step"] == b["step"], name
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name
    a, b = checkpoint.load(reference / "last.pt")["train_state"], checkpoint.load(resumed / "last.pt")["train_state"]
    moments_a, moments_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert moments_a.keys() == moments_b.keys()
    for i in moments_a:
        assert all(torch.equal(moments_a[i][key], moments_b[i][key]) for key in ("exp_avg", "exp_avg_sq", "step"))
    assert without_wall_time(a["state"]) == without_wall_time(b["state"])
    assert metrics(reference) == metrics(resumed)


def without_wall_time(state: dict) -> dict:
    """A saved TrainState less its training seconds: wall time, the one field two identical runs differ in."""
    return {k: v for k, v in state.items() if k != "train_seconds"}


def _unequal(a, b, where: str) -> list[str]:
    """Where two loaded checkpoints differ: tensors bit for bit (dtype and shape too), the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} (keys {sorted(map(str, a.keys() ^ b.keys()))})"]
        return [d for k in a for d in _unequal(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _unequal(x, y, f"{where}[{i}]")]
    return [] if type(a) is type(b) and a == b else [where]


def differences(reference: Path, resumed: Path) -> list[str]:
    """What differs between the end of an uninterrupted run and the end of a killed-and-resumed
    one; empty when they are identical: the same files and no others (no temp file left); every
    checkpoint entry by entry, tensors bit for bit (weights, Adam moments, RNG states) and every
    other value equal (averaged.pt names its inputs by path: compared by file name; the bytes of a
    file may differ where pickle shares a string the original process happened to share);
    metrics.jsonl, every line whole and equal but for the wall-clock fields (and the training
    seconds in last.pt); plot.png and
    config.yaml byte for byte."""
    from mtrain import checkpoint

    found = []
    names, others = sorted(p.name for p in reference.iterdir()), sorted(p.name for p in resumed.iterdir())
    if others != names:
        found.append(f"files {others}, uninterrupted {names}")
    for name in sorted(set(names) & set(others) - {".lock"}):  # the folder lock's holder: who ran last
        a, b = reference / name, resumed / name
        if name.endswith(".pt"):
            x, y = checkpoint.load(a), checkpoint.load(b)
            for c in (x, y):
                if "averaged_from" in c:
                    c["averaged_from"] = [Path(p).name for p in c["averaged_from"]]
                if "train_state" in c:
                    c["train_state"]["state"] = without_wall_time(c["train_state"]["state"])
            found += [f"{name}{where}" for where in _unequal(x, y, "")][:5]
        elif name == "metrics.jsonl":
            try:
                [json.loads(line) for line in b.read_text(encoding="utf-8").splitlines()]
            except json.JSONDecodeError:
                found.append("metrics.jsonl: a torn line")
            if metrics(reference) != metrics(resumed):
                found.append("metrics.jsonl: other records")
        elif a.read_bytes() != b.read_bytes():
            found.append(f"{name} differs")
    return found


def kill_and_resume(data_dir: Path, run_dir: Path, max_steps: int, kills: list[KillPoint | float],
                    settings: list[str] = TINY, to_the_end: bool = True) -> list[str]:
    """Run the training command once per kill (a KillPoint, or seconds for a timer SIGKILL from
    outside), then (to_the_end) once more to the end. A kill point must be reached and leave its
    write torn; a timer may fire after the run has ended (exit 0), and the next kill still comes:
    re-running an ended run is a run too. Returns what each attempt did, for counts and failure
    messages."""
    args = train_args(data_dir, run_dir, max_steps, settings)
    history = []
    for kill in kills:
        if isinstance(kill, KillPoint):
            code, err = finish(start(args, kill))
        else:
            code, err = finish(start(args), kill_after=kill)
        history.append(f"{kill if isinstance(kill, KillPoint) else f'timer {kill:.2f}s'}: "
                       + ("killed" if code == -signal.SIGKILL else f"exit {code}"))
        assert code == -signal.SIGKILL or (code == 0 and not isinstance(kill, KillPoint)), f"{history}\n{err}"
        assert "Traceback" not in err, f"{history}\n{err}"
        torn = kill.torn_file() if isinstance(kill, KillPoint) else None
        if torn == "metrics.jsonl":
            assert not (run_dir / torn).read_bytes().endswith(b"\n"), f"{history}: no torn line in metrics.jsonl"
        elif torn:
            assert list(run_dir.glob(f".{torn}.*.tmp")), f"{history}: the kill left no half-written {torn}"
    if to_the_end:
        code, err = finish(start(args))
        history.append(f"to the end: exit {code}")
        assert code == 0 and "Traceback" not in err, f"{history}\n{err}"
    return history


# ---------------------------------------------------------------- kill -9

def resume_in_process(args: list[str]) -> str:
    """The same command again, through the CLI in this process (saves an interpreter start-up)."""
    from typer.testing import CliRunner

    from mtrain.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and result.exception is None, result.output
    return result.output


@pytest.fixture(scope="module")
def reference(tokenized_slice, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run: what every faulty run must end identical to."""
    run_dir = tmp_path_factory.mktemp("reference")
    reference_run(tokenized_slice, run_dir, 6)
    return run_dir


# Inside a validation, a checkpoint write, a metrics line and the write of averaged.pt, in the order
# one run meets them: each kill hits the run that resumed after the previous one.
SHORT_CAMPAIGN = [KillPoint("decode", 3), KillPoint("last.pt", 4, 0.4), KillPoint("log-valid", 6, 0.6),
                  KillPoint("averaged.pt", 7, 0.5)]


def test_kill9_in_validation_checkpoint_metrics_and_averaging_then_resume_is_bit_identical(tokenized_slice, tmp_path):
    """Four kills in one run folder, as repeated crashes would: while decoding the valid set,
    40% through writing last.pt, 60% through a metrics line, halfway through writing averaged.pt.
    Re-running the same command after each ends with every file as an uninterrupted run's (see
    `differences`) and no temp file left."""
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_and_resume, tokenized_slice, tmp_path / "killed", 7, SHORT_CAMPAIGN, CAMPAIGN, False)
        reference_run(tokenized_slice, tmp_path / "reference", 7, CAMPAIGN)  # while the children run
        history = killed.result()
    assert "resuming from" in resume_in_process(train_args(tokenized_slice, tmp_path / "killed", 7, CAMPAIGN))
    found = differences(tmp_path / "reference", tmp_path / "killed")
    assert not found, f"{history}\n{found}"


def test_kill9_after_the_final_validation_then_resume_logs_it_once(tokenized_slice, tmp_path):
    """8 updates, validation every 3, last.pt every 2: the run's last validation (at update 8)
    is off the validation grid and on the save grid. A kill after its metrics line (while its plot
    is written), then the same command: metrics.jsonl holds that validation once, as the
    uninterrupted run's does, whatever the order of that validation and update 8's last.pt."""
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(kill_and_resume, tokenized_slice, tmp_path / "killed", 8, [KillPoint("plot", 8, 0.5)],
                             CAMPAIGN, False)
        reference_run(tokenized_slice, tmp_path / "reference", 8, CAMPAIGN)
        history = killed.result()
    assert "resuming from" in resume_in_process(train_args(tokenized_slice, tmp_path / "killed", 8, CAMPAIGN))
    found = differences(tmp_path / "reference", tmp_path / "killed")
    assert not found, f"{history}\n{found}"


# ---------------------------------------------------------------- the kill campaign (slow)

CAMPAIGN_STEPS = (7, 8)  # 7: the run's end validates and writes step-7.pt; 8: the loop saved step 8 first


def campaign_plan(rng: random.Random, orders: dict[int, list[tuple[KillPoint, bool]]],
                  lifetimes: dict[int, float]) -> list[tuple[str, int, list[KillPoint | float]]]:
    """(folder, max_steps, kills): four folders of four exact kill points drawn from the whole run
    before one of the END_PHASES (each once), then a timer; one folder of three exact points, then
    two timers; two folders of five timers. Timer delays are drawn over the first 80% of an
    uninterrupted run's life (start-up included): a resumed run has less to do, and one that
    resumed late may still end first (counted, not a failure)."""
    def fraction(point: KillPoint) -> KillPoint:
        return replace(point, fraction=round(rng.uniform(0.05, 0.95), 3))

    def points_before(max_steps: int, end: int, n: int) -> list[KillPoint]:
        order = orders[max_steps]
        chosen = sorted(rng.sample([i for i, (_, ended) in enumerate(order[:end]) if not ended], n))
        return [fraction(order[i][0]) for i in chosen]

    def timers(max_steps: int, n: int) -> list[float]:
        return [round(rng.uniform(0.05, 0.8) * lifetimes[max_steps], 2) for _ in range(n)]

    plan = []
    for i, phase in enumerate(rng.sample(END_PHASES, len(END_PHASES))):
        max_steps = CAMPAIGN_STEPS[i % 2]
        order = [point for point, _ in orders[max_steps]]
        end = order.index(KillPoint(phase, max_steps))
        plan.append((f"exact-{i}", max_steps, points_before(max_steps, end, 4) + [fraction(order[end])]
                     + timers(max_steps, 1)))
    max_steps = rng.choice(CAMPAIGN_STEPS)
    plan.append(("mixed", max_steps, points_before(max_steps, len(orders[max_steps]), 3) + timers(max_steps, 2)))
    for i, max_steps in enumerate(CAMPAIGN_STEPS):
        plan.append((f"timers-{i}", max_steps, timers(max_steps, 5)))
    return plan


@pytest.mark.slow
def test_kill9_campaign_at_random_instants_then_resume_is_bit_identical(tokenized_slice, tmp_path):
    """At least 20 kill -9 instants drawn from a seed over the whole life of a run: exact kill
    points of every phase (an update, a metrics line, the valid loss, decoding, best.pt, the plot,
    a step file, last.pt, the final plot, reading the step files to average them, writing
    averaged.pt, the summary), the writes torn at random fractions, and timer SIGKILLs from outside
    at random delays (start-up and resume included). Several kills hit one folder before its
    last re-run, as a user's repeated crashes would; each folder must end as the uninterrupted run
    did (`differences`). Where each place falls is read from a traced run, itself checked to end
    identical to the plain one (the kill points change nothing else).

    The seed is printed; MTRAIN_TEST_KILL_SEED=N replays its exact kill points (a timer lands where
    the machine's speed puts it). Cached token ids only (train.sampling_alpha 0): the installed
    SentencePiece samples differently in two processes given the same seed, so a run that samples
    subwords cannot resume bit-identically."""
    seed = int(os.environ.get("MTRAIN_TEST_KILL_SEED") or random.SystemRandom().randrange(2**31))
    print(f"kill campaign seed {seed} (MTRAIN_TEST_KILL_SEED={seed} replays it)")
    rng = random.Random(seed)
    workers = max(1, min(2, os.cpu_count() or 1))
    references, lifetimes, orders = {}, {}, {}

    def reference(job: tuple[int, bool]) -> None:  # real processes: their time spans a whole run's life
        max_steps, traced = job
        run_dir = tmp_path / f"{'traced' if traced else 'reference'}-{max_steps}"
        began = time.perf_counter()
        trace = tmp_path / f"trace-{max_steps}.txt" if traced else None
        code, err = finish(start(train_args(tokenized_slice, run_dir, max_steps, CAMPAIGN), trace=trace))
        assert code == 0, err
        if traced:
            orders[max_steps] = traced_order(trace)
        else:
            references[max_steps], lifetimes[max_steps] = run_dir, time.perf_counter() - began

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(reference, [(n, traced) for n in CAMPAIGN_STEPS for traced in (False, True)]))
    for max_steps in CAMPAIGN_STEPS:
        assert not differences(references[max_steps], tmp_path / f"traced-{max_steps}"), "tracing changed the run"
        met = {point.phase for point, _ in orders[max_steps]}
        assert met == set(PHASES), f"a traced run of {max_steps} steps never met {set(PHASES) - met}"
    plan = campaign_plan(rng, orders, lifetimes)

    def attempt(entry: tuple[str, int, list]) -> tuple[list[str], list[str]]:
        folder, max_steps, kills = entry
        try:
            history = kill_and_resume(tokenized_slice, tmp_path / folder, max_steps, kills, CAMPAIGN)
        except AssertionError as err:
            return str(err).splitlines()[:1], [f"failed: {str(err)[-2000:]}"]
        return history, differences(references[max_steps], tmp_path / folder)

    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(attempt, plan))
    tried = sum(line.endswith(": killed") for history, _ in outcomes for line in history)
    exact = sum(isinstance(kill, KillPoint) for _, _, kills in plan for kill in kills)
    identical = sum(not found for _, found in outcomes)
    lines = [f"kill campaign seed {seed}: {tried} kill -9 instants tried ({exact} exact kill points, "
             f"{tried - exact} timer kills; {sum(len(kills) for _, _, kills in plan) - tried} timers fired after "
             f"the run had ended), {len(plan)} run folders, {identical} of them resumed to the end bit-identical "
             f"to the uninterrupted run; {time.perf_counter() - began:.0f} s with {workers} at a time (an "
             "uninterrupted run: " + ", ".join(f"{n} steps {t:.1f} s" for n, t in sorted(lifetimes.items())) + ")"]
    for (folder, max_steps, _), (history, found) in zip(plan, outcomes):
        lines.append(f"  {folder} ({max_steps} steps): " + "; ".join(history) + (f"\n    DIFFERS: {found}" if found else ""))
    report = "\n".join(lines)
    print(report)
    assert identical == len(plan) and tried >= 20, f"replay with MTRAIN_TEST_KILL_SEED={seed}\n{report}"


# ---------------------------------------------------------------- failing checkpoint writes

def cli(*args: str, env: dict[str, str] | None = None):
    from typer.testing import CliRunner

    from mtrain.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def assert_one_line_error(result, *needles: str) -> str:
    """Exit 1, no exception escaped, and stderr is one `error: ...` line holding every needle."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name, step", [("last.pt", 4), ("step-4.pt", 4), ("best.pt", 3)])
def test_disk_full_keeps_previous_checkpoints_and_the_rerun_ends_identical(tokenized_slice, reference, tmp_path,
                                                                           monkeypatch, name, step):
    """ENOSPC halfway through one checkpoint write: the run stops with one line naming the file,
    the previous last.pt (and best.pt) still load, no temp file stays, and once there is space
    again the same command resumes and ends identical to an uninterrupted run."""
    from mtrain import checkpoint

    save_atomic, real_save = checkpoint.save_atomic, torch.save
    armed: list[bool] = []

    def full_disk_save(obj, handle, *args, **kwargs):
        if not armed:
            return real_save(obj, handle, *args, **kwargs)
        handle.write(b"PK\x03\x04 the first bytes of a zip")
        raise OSError(28, "No space left on device")

    def watching_save_atomic(obj, path):
        if Path(path).name == name and obj["step"] == step:
            armed.append(True)
        try:
            return save_atomic(obj, path)
        finally:
            armed.clear()

    monkeypatch.setattr(checkpoint.torch, "save", full_disk_save)
    monkeypatch.setattr(checkpoint, "save_atomic", watching_save_atomic)
    args = train_args(tokenized_slice, tmp_path, 6)
    assert_one_line_error(cli(*args), f"{tmp_path / name}: checkpoint write failed", "No space left on device",
                          "re-run the same command")
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 2
    if step > 3:
        assert checkpoint.load(tmp_path / "best.pt")["step"] == 3
    for path in tmp_path.glob("*.pt"):
        checkpoint.load(path)  # every checkpoint left is complete
    assert not list(tmp_path.glob(".*.tmp"))
    result = cli(*args)
    assert result.exit_code == 0 and "resuming from" in result.output, result.output
    assert_identical_runs(reference, tmp_path)


class FullDisk:
    """A file handle (text or binary) that takes `room` more characters or bytes, then raises ENOSPC."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data):
        if len(data) > self.room:
            self.handle.write(data[: self.room])
            self.room = 0
            raise OSError(28, "No space left on device")
        self.room -= len(data)
        return self.handle.write(data)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


@pytest.mark.parametrize("command", ["translate", "eval"])
def test_disk_full_while_writing_translations_keeps_the_previous_file(reference, tmp_path, monkeypatch, command):
    """`translate --output` and `eval --output-hyp` write a temp file and rename it: a full disk
    leaves the previous file as it was, no temp file, and one line on stderr."""
    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        handle = real_fdopen(fd, mode, *args, **kwargs)
        return FullDisk(handle, room=1) if mode == "w" else handle

    src = tmp_path / "in.de"
    src.write_text("Ein Mann schläft.\nZwei Hunde.\nEine Frau.\n", encoding="utf-8")
    ref = tmp_path / "ref.en"
    ref.write_text("A man sleeps.\nTwo dogs.\nA woman.\n", encoding="utf-8")
    out = tmp_path / "out.en"
    out.write_text("yesterday's translations\n", encoding="utf-8")
    args = {"translate": ["translate", "--checkpoint", reference / "best.pt", "--input", src, "--output", out],
            "eval": ["eval", "--checkpoint", reference / "best.pt", "--src", src, "--ref", ref, "--output-hyp", out]}
    monkeypatch.setattr(os, "fdopen", fdopen)
    line = assert_one_line_error(cli(*args[command], "--device", "cpu"), "No space left on device", "disk space")
    assert "None" not in line, line
    monkeypatch.undo()
    assert out.read_text(encoding="utf-8") == "yesterday's translations\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# ---------------------------------------------------------------- damaged and hostile checkpoints

class WritesMarker:
    """Unpickling this calls open(marker, "w"): the file appears if any loader runs pickled code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import builtins

        return builtins.open, (self.marker, "w")


def hostile_files(folder: Path, marker: Path, good: dict) -> dict[str, Path]:
    """The same code-running object packed three ways: torch zip, torch legacy, bare pickle."""
    import io
    import pickle

    crafted = {**good, "model": {**good["model"], "payload": WritesMarker(marker)}}
    files = {}
    for kind in ("zip", "legacy", "pickle"):
        path = folder / f"hostile-{kind}.pt"
        if kind == "pickle":
            path.write_bytes(pickle.dumps(crafted))
        else:
            buffer = io.BytesIO()
            torch.save(crafted, buffer, _use_new_zipfile_serialization=kind == "zip")
            path.write_bytes(buffer.getvalue())
        files[kind] = path
    return files


def readers(ckpt: Path, data_dir: Path, folder: Path) -> dict[str, tuple[list[str], Path]]:
    """Every command that reads a checkpoint, reading `ckpt` (train: a copy as RUN/last.pt, to
    resume): {command: (arguments, the file its error must name)}."""
    src = folder / "src.de"
    src.write_text("Ein Mann schläft.\nZwei Hunde.\n", encoding="utf-8")
    ref = folder / "ref.en"
    ref.write_text("A man sleeps.\nTwo dogs.\n", encoding="utf-8")
    run_dir = folder / f"run-{ckpt.stem}"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "last.pt").write_bytes(ckpt.read_bytes())
    return {
        "translate": (["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(folder / "out.en"),
                       "--device", "cpu"], ckpt),
        "eval": (["eval", "--checkpoint", str(ckpt), "--src", str(src), "--ref", str(ref), "--device", "cpu",
                  "--output-hyp", str(folder / "hyp.en")], ckpt),
        "average": (["average", str(ckpt), str(ckpt), "--out", str(folder / "avg.pt")], ckpt),
        "train": (train_args(data_dir, run_dir, 6), run_dir / "last.pt"),
    }


def test_every_checkpoint_read_is_weights_only():
    """Static check: each torch.load in mtrain passes weights_only=True; nothing unpickles otherwise."""
    import ast

    calls = []
    for path in sorted((ROOT / "mtrain").glob("**/*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            where = f"{path.name}:{node.lineno}"
            if name.endswith(("torch.load", "serialization.load")):
                calls.append(where)
                assert keywords.get("weights_only") == "True", f"{where}: torch.load without weights_only=True"
            assert not name.endswith(("pickle.load", "pickle.loads", "Unpickler", "dill.load")), where
            if name.endswith(("np.load", "numpy.load")):
                assert keywords.get("allow_pickle", "False") == "False", f"{where}: np.load(allow_pickle=True)"
    assert calls, "no torch.load found: the check is looking in the wrong place"


def test_hostile_pickle_is_refused_by_every_reader_and_runs_nothing(tokenized_slice, reference, tmp_path):
    from mtrain import checkpoint

    marker = tmp_path / "MARKER"
    good = checkpoint.load(reference / "last.pt")
    for kind, path in hostile_files(tmp_path, marker, good).items():
        for command, (args, named) in readers(path, tokenized_slice, tmp_path).items():
            line = assert_one_line_error(cli(*args), str(named))
            if kind != "pickle":  # a bare pickle is not a torch file at all; either way it is refused
                assert "refused for safety" in line and "io.open" in line, line
            assert not marker.exists(), f"{command} ran the pickled code of {path}"
    for name in ("out.en", "hyp.en", "avg.pt"):
        assert not (tmp_path / name).exists(), f"{name} was written from a refused checkpoint"


def damaged(good_bytes: bytes, kind: str) -> bytes:
    """Damage a checkpoint file the way disks and copies do."""
    import io
    import zipfile

    if kind == "truncated":
        return good_bytes[: len(good_bytes) // 2]
    if kind == "cut to 10 bytes":
        return good_bytes[:10]
    if kind == "empty":
        return b""
    if kind == "random bytes":
        return random.Random(0).randbytes(4096)
    if kind == "text":
        return b"this is not a checkpoint\n"
    # "bits flipped in the weights": 8 bytes inside the largest tensor record, the zip intact.
    archive = zipfile.ZipFile(io.BytesIO(good_bytes))
    record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    extra = int.from_bytes(good_bytes[record.header_offset + 28: record.header_offset + 30], "little")
    start = record.header_offset + 30 + len(record.filename.encode()) + extra + record.file_size // 2
    flipped = bytearray(good_bytes)
    flipped[start: start + 8] = bytes(b ^ 0xFF for b in flipped[start: start + 8])
    return bytes(flipped)


DAMAGE = ["truncated", "cut to 10 bytes", "empty", "random bytes", "text", "bits flipped in the weights"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_is_a_one_line_error_naming_the_file(tokenized_slice, reference, tmp_path, kind):
    path = tmp_path / "best.pt"
    path.write_bytes(damaged((reference / "last.pt").read_bytes(), kind))
    for command, (args, named) in readers(path, tokenized_slice, tmp_path).items():
        line = assert_one_line_error(cli(*args), str(named))
        assert "checkpoint" in line, f"{command}: {line}"
    for name in ("out.en", "hyp.en", "avg.pt"):
        assert not (tmp_path / name).exists(), f"{name} was written from a damaged checkpoint"


@pytest.mark.parametrize("change, needle", [
    (lambda c: c.pop("model"), "missing or malformed: model"),
    (lambda c: c.update(step="12"), "missing or malformed: step"),
    (lambda c: c["tokenizer"].update(src_model=b"not a SentencePiece model"), "tokenizer cannot be loaded"),
    (lambda c: c["model"].pop(next(iter(c["model"]))), "weights do not fit"),
    (lambda c: c.update(format="other"), "not an mtrain checkpoint"),
    (lambda c: c.update(version=99), "newer than this mtrain reads"),
])
def test_inconsistent_checkpoint_is_a_one_line_error(reference, tmp_path, change, needle):
    """Well-formed torch files whose content is wrong (crafted, or written by something else)."""
    from mtrain import checkpoint

    ckpt = checkpoint.load(reference / "best.pt")
    change(ckpt)
    path = tmp_path / "odd.pt"
    torch.save(ckpt, path)
    src = tmp_path / "in.de"
    src.write_text("Ein Hund.\n", encoding="utf-8")
    assert_one_line_error(cli("translate", "--checkpoint", path, "--input", src, "--device", "cpu"), str(path), needle)


# ---------------------------------------------------------------- non-finite losses

def test_nan_losses_are_skipped_and_counted_and_a_run_of_them_stops(tokenized_slice, tmp_path, nan_losses):
    args = train_args(tokenized_slice, tmp_path / "one", 4)
    nan_losses({3})
    result = cli(*args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["step"], summary["nonfinite"]) == (4, 1)
    assert "step 3: non-finite loss, update skipped" in result.stderr

    args = train_args(tokenized_slice, tmp_path / "many", 6) + ["--set", "train.max_nonfinite=3"]
    nan_losses(range(3, 101))
    result = cli(*args)
    assert_one_line_error(result, "step 3: 3 non-finite losses in a row", "last.pt")
    from mtrain import checkpoint

    last = checkpoint.load(tmp_path / "many" / "last.pt")
    assert last["step"] == 2 and all(torch.isfinite(w).all() for w in last["model"].values())


if __name__ == "__main__":  # `python tests/test_faults.py PHASE,STEP,FRACTION|trace=FILE train ...`
    if sys.argv[1].startswith("trace="):
        install(trace=Path(sys.argv[1].removeprefix("trace=")))
    else:
        install(KillPoint.decode(sys.argv[1]))
    from mtrain.cli import app

    app(args=sys.argv[2:], prog_name="mtrain")
