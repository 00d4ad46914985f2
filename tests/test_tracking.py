"""train.log_to: TensorBoard and Weights & Biases get every metrics.jsonl record (same steps, same
values), the validation samples and the config; across a stop and across a kill -9 the resumed run's
series equals metrics.jsonl and an uninterrupted run's; W&B continues the same run; a missing
package is a one-line error before training starts.

TensorBoard is read back with its own readers (EventAccumulator, and the plugin accumulator that
`tensorboard --load_fast=false` uses); W&B offline runs are read back from their .wandb files, and
a stand-in `wandb` module records the exact calls."""

from __future__ import annotations

import math
import signal
import struct
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
from test_faults import TINY, KillPoint, assert_one_line_error, cli, finish, resume_in_process, start, train_args
from test_train import copy_data  # noqa: F401 (a fixture: the copy task's tokenized data)

from mtrain.config import load_config, to_dict
from mtrain.errors import MtrainError
from mtrain.plot import TIME_FIELDS, read_metrics

pytest.importorskip("tensorboard")


def run(data_dir: Path, run_dir: Path, max_steps: int, *overrides: str) -> dict:
    """In this process, with test_faults' settings (a log line every update, validation every 3,
    last.pt every 2): the same run as its `train_args` command."""
    from mtrain.train import train

    cfg = load_config(None, TINY + [f"train.max_steps={max_steps}", *overrides])
    return train(cfg, data_dir, run_dir, device="cpu")


# ---------------------------------------------------------------- expected and read-back series

def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as tagged series: every numeric field but the step, at the record's step."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series[f"{record['event']}/{key}"].append((record["step"], value))
    return dict(series)


def tensorboard_data(run_dir: Path, plugin: bool = False) -> tuple[dict, dict]:
    """(scalar tag -> [(step, value)], text tag -> [(step, text)]) as TensorBoard reads the folder."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util import tensor_util

    module = plugin_event_accumulator if plugin else event_accumulator
    acc = module.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars, texts = {}, {}
    for tag in acc.Tags().get("scalars", []):
        scalars[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        if tag.endswith("/text_summary"):
            texts[tag.removesuffix("/text_summary")] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events]
        else:  # the plugin accumulator keeps scalars as tensors
            scalars[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events]
    return scalars, texts


def assert_same_series(got: dict, want: dict) -> None:
    """Same tags, same steps in order; values equal up to TensorBoard's float32."""
    assert sorted(got) == sorted(want)
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        for (step, a), (_, b) in zip(got[tag], want[tag]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-30) or (math.isnan(a) and math.isnan(b)), (tag, step)


def assert_tensorboard_equals_metrics(run_dir: Path, plugin: bool = False) -> tuple[dict, dict]:
    records = read_metrics(run_dir / "metrics.jsonl")
    scalars, texts = tensorboard_data(run_dir, plugin)
    assert_same_series(scalars, expected_scalars(records))
    valid = [r for r in records if r["event"] == "valid"]
    assert [step for step, _ in texts["valid/samples"]] == [r["step"] for r in valid]
    for (_, text), record in zip(texts["valid/samples"], valid):
        assert text.count("\n") == 1 + len(record["samples"])  # header, rule, one row per sample
        for sample in record["samples"]:
            assert all(sample[k].replace("|", "\\|") in text for k in ("src", "ref", "hyp")), (text, sample)
    assert [step for step, _ in texts["config"]] == [0]
    return scalars, texts


def without_time(series: dict) -> dict:
    return {tag: values for tag, values in series.items() if tag.split("/", 1)[1] not in TIME_FIELDS}


# ---------------------------------------------------------------- TensorBoard

@pytest.fixture(scope="module")
def reference(copy_data, tmp_path_factory) -> Path:  # noqa: F811
    """An uninterrupted 6-step run logging to TensorBoard."""
    run_dir = tmp_path_factory.mktemp("reference")
    run(copy_data, run_dir, 6, "train.log_to=tensorboard")
    return run_dir


def test_tensorboard_holds_every_metrics_record_the_samples_and_the_config(reference):
    records = read_metrics(reference / "metrics.jsonl")
    assert {r["event"] for r in records} == {"train", "valid"} and len(records) == 6 + 2
    scalars, texts = assert_tensorboard_equals_metrics(reference)
    assert {"train/loss", "train/nll", "train/ppl", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "valid/loss", "valid/bleu", "valid/chrf", "valid/best_bleu"} <= set(scalars)
    config = texts["config"][0][1]
    assert "log_to:" in config and "- tensorboard" in config and "d_model: 32" in config
    assert [p.parent.name for p in reference.glob("tensorboard/events.out.tfevents.*")] == ["tensorboard"]


def test_tensorboard_series_survives_a_stop_and_resume(copy_data, reference, tmp_path, stop_at_step):  # noqa: F811
    """Ctrl-C after update 3, the same command again: one series, equal to metrics.jsonl and,
    wall-clock fields aside, to the uninterrupted run's."""
    stop_at_step(3)
    assert run(copy_data, tmp_path, 6, "train.log_to=tensorboard")["stopped"] == "interrupted"
    stop_at_step(None)
    assert run(copy_data, tmp_path, 6, "train.log_to=tensorboard")["step"] == 6
    assert len(list(tmp_path.glob("tensorboard/events.out.tfevents.*"))) == 2
    scalars, texts = assert_tensorboard_equals_metrics(tmp_path)
    reference_scalars, reference_texts = tensorboard_data(reference)
    assert_same_series(without_time(scalars), without_time(reference_scalars))
    assert texts == reference_texts


def test_tensorboard_series_survives_a_kill9_and_resume(copy_data, reference, tmp_path):  # noqa: F811
    """SIGKILL halfway through writing last.pt at update 4: the events of updates 3-4 are on disk
    but last.pt is still update 2's. The resumed run redoes 3-4; TensorBoard shows each step once,
    equal to metrics.jsonl and to the uninterrupted run."""
    args = train_args(copy_data, tmp_path, 6) + ["--set", "train.log_to=tensorboard"]
    code, err = finish(start(args, KillPoint("last.pt", 4, 0.5)))
    assert code == -signal.SIGKILL, err
    killed, _ = tensorboard_data(tmp_path)
    assert max(step for step, _ in killed["train/loss"]) == 4 and killed["valid/bleu"][0][0] == 3
    assert "resuming from" in resume_in_process(args)
    reference_scalars, reference_texts = tensorboard_data(reference)
    scalars, texts = assert_tensorboard_equals_metrics(tmp_path, plugin=True)
    assert_same_series(without_time(scalars), without_time(reference_scalars))
    assert texts == reference_texts
    # The older EventAccumulator drops a restart's expired scalars but keeps its text events.
    scalars, _ = tensorboard_data(tmp_path)
    assert_same_series(scalars, expected_scalars(read_metrics(tmp_path / "metrics.jsonl")))


def test_a_new_event_file_sorts_after_one_from_the_same_second(tmp_path):
    """TensorBoard reads a folder's event files in name order, and a name is the creation second,
    then host and process id: a file of this second from a larger process id must still come first."""
    import time

    from mtrain.tracking import TensorBoardTracker

    (tmp_path / "tensorboard").mkdir()
    earlier = tmp_path / "tensorboard" / f"events.out.tfevents.{int(time.time())}.zz.99999999.0"
    earlier.write_bytes(b"")
    TensorBoardTracker(tmp_path, load_config(None), resume_step=2, history=[]).close(failed=False)
    names = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    assert len(names) == 2 and names[0] == earlier.name


def test_tensorboard_enabled_on_resume_catches_up_from_metrics(copy_data, tmp_path, stop_at_step):  # noqa: F811
    stop_at_step(3)
    run(copy_data, tmp_path, 6)
    stop_at_step(None)
    run(copy_data, tmp_path, 6, "train.log_to=tensorboard")
    assert_tensorboard_equals_metrics(tmp_path)


# ---------------------------------------------------------------- Weights & Biases

class FakeWandb(types.ModuleType):
    """A stand-in `wandb` module that records init/log/finish calls."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logs: list[tuple[int, dict]] = []
        self.finishes: list[int] = []
        fake = self

        class Run:
            def log(self, values, step):
                fake.logs.append((step, values))

            def finish(self, exit_code=0):
                fake.finishes.append(exit_code)

        class Table:
            def __init__(self, columns, data):
                self.columns, self.data = columns, data

        self.Run, self.Table = Run, Table

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self.Run()


@pytest.fixture
def fake_wandb(monkeypatch) -> FakeWandb:
    module = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_PROJECT", "nmt-tests")
    return module


def logged(fake: FakeWandb) -> tuple[dict, dict]:
    """The fake's calls as scalar series, and step -> [(src, ref, hyp)] of the samples tables."""
    series, tables = defaultdict(list), {}
    for step, values in fake.logs:
        for key, value in values.items():
            if key == "valid/samples":
                assert value.columns == ["src", "ref", "hyp"]
                tables[step] = [tuple(row) for row in value.data]
            else:
                series[key].append((step, value))
    return dict(series), tables


def test_wandb_gets_every_record_and_a_resumed_run_continues_the_same_run(copy_data, tmp_path, fake_wandb,  # noqa: F811
                                                                          stop_at_step):
    stop_at_step(3)
    run(copy_data, tmp_path, 6, "train.log_to=wandb")
    stop_at_step(None)
    run(copy_data, tmp_path, 6, "train.log_to=wandb")
    first, second = fake_wandb.inits
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    assert first["id"] == second["id"] == run_id and first["resume"] == second["resume"] == "allow"
    assert first["project"] == "nmt-tests" and first["dir"] == str(tmp_path)
    assert second["config"] == to_dict(load_config(tmp_path / "config.yaml"))
    assert second["config"]["train"]["log_to"] == ["wandb"] and second["config"]["model"]["vocab_size"] > 0
    assert fake_wandb.finishes == [0, 0]
    records = read_metrics(tmp_path / "metrics.jsonl")
    series, tables = logged(fake_wandb)
    assert series == expected_scalars(records)  # exact: W&B gets the values, not float32 copies
    assert tables == {r["step"]: [(s["src"], s["ref"], s["hyp"]) for s in r["samples"]]
                      for r in records if r["event"] == "valid"}
    # A fresh start in another folder is another W&B run.
    run(copy_data, tmp_path / "other", 2, "train.log_to=wandb")
    assert fake_wandb.inits[-1]["id"] != run_id


def test_wandb_enabled_on_resume_catches_up_and_a_failed_run_is_marked(copy_data, tmp_path, fake_wandb,  # noqa: F811
                                                                       stop_at_step, nan_losses):
    stop_at_step(3)
    run(copy_data, tmp_path, 6)
    stop_at_step(None)
    run(copy_data, tmp_path, 6, "train.log_to=wandb")
    assert logged(fake_wandb)[0] == expected_scalars(read_metrics(tmp_path / "metrics.jsonl"))
    nan_losses(range(1, 100))
    with pytest.raises(MtrainError, match="non-finite losses in a row"):
        run(copy_data, tmp_path / "failing", 6, "train.log_to=wandb", "train.max_nonfinite=2")
    assert fake_wandb.finishes == [0, 1]


def wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        pytest.skip(f"{path.name}: an offline-run format this test does not read")
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def test_wandb_offline_run_is_resumed_under_the_same_id(copy_data, tmp_path, monkeypatch, stop_at_step):  # noqa: F811
    """The real wandb package, WANDB_MODE=offline: the stopped and the resumed process write one
    offline folder each under RUN/wandb/, both with the run id kept in RUN/; their histories,
    joined as W&B joins a resumed run's, are metrics.jsonl."""
    import json

    wandb = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": tmp_path / "wandb-dir",
                        "WANDB_CONFIG_DIR": tmp_path / "wandb-config", "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                        "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run_dir = tmp_path / "run"
    stop_at_step(3)
    run(copy_data, run_dir, 6, "train.log_to=wandb")
    stop_at_step(None)
    run(copy_data, run_dir, 6, "train.log_to=wandb")
    wandb.teardown()  # the W&B service process writes the files; stopping it completes them
    run_id = (run_dir / "wandb-run-id").read_text().strip()
    folders = sorted(run_dir.glob("wandb/offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith("-" + run_id) for f in folders), folders
    history: dict[int, dict] = {}
    for folder in folders:
        records = wandb_records(folder / f"run-{run_id}.wandb")
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert [(r.run_id, r.project) for r in runs] == [(run_id, "mtrain")]
        for record in records:
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                step = record.history.step.num
                if step > max(history, default=0):  # W&B drops a resumed run's steps below its last
                    history[step] = {k: v for k, v in row.items() if not k.startswith("_") and "/samples" not in k}
                    if "valid/samples/nrows" in row:
                        history[step]["valid/samples"] = row["valid/samples/nrows"]
    series: dict[str, list] = defaultdict(list)
    for step, row in sorted(history.items()):
        for key, value in row.items():
            if key != "valid/samples":
                series[key].append((step, value))
    records = read_metrics(run_dir / "metrics.jsonl")
    assert dict(series) == expected_scalars(records)
    assert {s: row["valid/samples"] for s, row in history.items() if "valid/samples" in row} == {
        r["step"]: len(r["samples"]) for r in records if r["event"] == "valid"}


# ---------------------------------------------------------------- a missing package

@pytest.mark.parametrize("target", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_a_one_line_error_before_training(copy_data, tmp_path, monkeypatch,  # noqa: F811
                                                                       target):
    monkeypatch.setitem(sys.modules, target, None)  # `import tensorboard` / `import wandb` fails
    if target == "tensorboard":
        monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    args = train_args(copy_data, tmp_path, 2) + ["--set", f"train.log_to={target}"]
    assert_one_line_error(cli(*args), f"train.log_to={target} needs the {target} package",
                          f"pip install 'mtrain[{target}]'")
    assert not (tmp_path / "last.pt").exists() and not (tmp_path / "metrics.jsonl").exists()
