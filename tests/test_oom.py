"""Device memory: train.max_tokens=auto's start-up probe (mtrain.probe) against a fake device
whose memory query is patched, and an out-of-memory error in the middle of a run, injected: one
line naming the step, the batch shape and a smaller max_tokens, exit code 1, last.pt intact, and
the same command resumes to the end of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mtrain import checkpoint, probe
from mtrain.cli import app
from mtrain.config import load_config
from mtrain.errors import MtrainError
from mtrain.train import train

MiB = 2 ** 20
GiB = 2 ** 30


# ---------------------------------------------------------------- the search, on a memory model

def line(fixed: float, per_token: float, hard: float = float("inf")):
    """A step's peak memory at a budget: fixed + per_token * budget; out of memory past `hard`."""
    calls = []

    def measure(budget: int) -> int | None:
        calls.append(budget)
        peak = fixed + per_token * budget
        return None if peak > hard else int(peak)
    return measure, calls


@pytest.mark.parametrize("fixed,per_token,capacity", [(500 * MiB, 0.2 * MiB, 8192 * MiB),
                                                      (2000 * MiB, 1.5 * MiB, 24576 * MiB),
                                                      (100 * MiB, 0.01 * MiB, 80000 * MiB)])
def test_search_finds_the_largest_budget_under_the_margin(fixed, per_token, capacity):
    measure, calls = line(fixed, per_token)
    found = probe.search(measure, capacity, floor=100)
    limit = (1 - probe.MARGIN) * capacity
    assert found % probe.GRAIN == 0 and found <= probe.CEILING
    assert fixed + per_token * found <= limit  # fits, margin kept
    assert found == probe.CEILING or fixed + per_token * (found + probe.GRAIN) > limit  # and no more would
    assert len(calls) <= 3  # a straight line needs no bisection


def test_search_bisects_when_memory_runs_out_before_the_line_says():
    """Fragmentation, or memory growing faster than the budget: the extrapolated budget runs out
    of memory, and the search settles between the largest that fitted and it."""
    measure, calls = line(500 * MiB, 0.2 * MiB, hard=3000 * MiB)
    found = probe.search(measure, 8192 * MiB, floor=1000)
    assert 500 * MiB + 0.2 * MiB * found <= 3000 * MiB
    assert found >= (12500 - probe.GRAIN) * 15 / 16  # 12500 is the true largest
    assert len(calls) <= 12


def test_search_says_in_one_line_when_not_even_the_longest_pair_fits():
    measure, _ = line(7900 * MiB, 1 * MiB)
    with pytest.raises(MtrainError) as err:
        probe.search(measure, 8192 * MiB, floor=300)
    assert "\n" not in str(err.value) and "even 320 tokens" in str(err.value)


def test_the_probe_batch_is_the_longest_pairs_the_budget_holds():
    import numpy as np

    src, tgt = np.array([3, 9, 4, 20, 7, 19]), np.array([5, 8, 25, 2, 6, 18])
    rows = probe.ProbeBatches(src, tgt).longest(80)  # costs max + 1: 6, 10, 26, 21, 8, 20
    assert rows.tolist() == [2, 3, 5]  # 80 // 26 = 3 rows, the three most costly
    assert probe.ProbeBatches(src, tgt).longest(10).tolist() == [2]  # at least one


def test_the_fullest_target_batch_holds_the_most_target_tokens_the_budget_allows():
    import itertools

    import numpy as np

    src, tgt = np.array([3, 9, 4, 20, 7, 19]), np.array([5, 8, 25, 2, 6, 18])
    # costs 6, 10, 26, 21, 8, 20. At 40: widest 20 holds 2 pairs, the longest targets costing <= 20
    # are rows 5 and 1 (18 + 8 = 26), more than row 2 alone (25, widest 26) or 1, 4, 0 (19, widest 10).
    assert probe.ProbeBatches(src, tgt).fullest(40).tolist() == [5, 1]
    assert probe.ProbeBatches(src, tgt).fullest(80).tolist() == [2, 5, 1]  # widest 26: 3 pairs, 51 targets
    assert probe.ProbeBatches(src, tgt).fullest(10).tolist() == [1]  # only row 1 (cost 10) fits
    assert [b.tolist() for b in probe.ProbeBatches(src, tgt)(40)] == [[2], [5, 1]]
    same = np.array([4, 4, 4]), np.array([4, 4, 4])  # the longest pairs are the fullest targets: one batch
    assert [b.tolist() for b in probe.ProbeBatches(*same)(10)] == [[0, 1]]
    rng = np.random.default_rng(0)  # against every subset that fits, on small random corpora
    for _ in range(200):
        n = int(rng.integers(1, 10))
        src, tgt, budget = rng.integers(1, 15, n), rng.integers(1, 15, n), int(rng.integers(16, 80))
        cost = np.maximum(src, tgt) + 1
        best = max(int(tgt[list(rows)].sum()) for k in range(1, n + 1) for rows in itertools.combinations(range(n), k)
                   if k * cost[list(rows)].max() <= budget)
        rows = probe.ProbeBatches(src, tgt).fullest(budget)
        assert int(tgt[rows].sum()) == best and len(rows) * cost[rows].max() <= budget


@pytest.mark.parametrize("free,reserved,fraction,expected", [(30, 2, 1.0, 32), (30, 2, 0.25, 20), (5, 0, 0.5, 5)],
                         ids=["uncapped", "capped", "cap-above-free"])
@pytest.mark.parametrize("device", [torch.device("cuda", 0), torch.device("cuda")], ids=["cuda:0", "cuda"])
def test_cuda_capacity_is_free_plus_reserved_up_to_the_process_cap(monkeypatch, free, reserved, fraction, expected,
                                                                    device):
    """What the probe may fill on an 80 GiB GPU: the free memory plus what torch already holds,
    but no more than the cap set by torch.cuda.set_per_process_memory_fraction. A single-GPU run's
    device is plain "cuda"; torch's cap query, like the fake here, wants the GPU's index."""

    def get_per_process_memory_fraction(d):
        if not isinstance(d, int) and d.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
        return fraction

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: reserved * GiB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", get_per_process_memory_fraction)
    assert probe.CudaMemory(device).capacity() == expected * GiB
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")  # an older torch: no cap to read
    assert probe.CudaMemory(device).capacity() == (free + reserved) * GiB


def test_the_cuda_gauge_measures_a_probe_step_by_the_allocators_reserved_peak(monkeypatch):
    """The probe drives the real gauge on a GPU: reset (synchronise, free the cache, zero the
    peak), the step, then the peak of reserved memory after synchronising. torch.cuda's calls are
    recorded here in place of a GPU."""
    device, calls = torch.device("cuda", 0), []
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: calls.append("max_memory_reserved") or 3 * GiB)
    gauge = probe.memory_gauge(device)
    assert isinstance(gauge, probe.CudaMemory) and probe.memory_gauge(torch.device("cpu")) is None
    measure = probe.Probe(lambda budget: calls.append(f"step {budget}"), gauge, lambda line: calls.append(line))
    assert measure(2048) == 3 * GiB
    assert calls == ["synchronize", "empty_cache", "reset_peak_memory_stats", "step 2048", "synchronize",
                     "max_memory_reserved", "max_tokens probe: 2048 tokens: peak 3.00 GiB"]


# ---------------------------------------------------------------- the probe in a run, on a fake device

TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "train.warmup_steps=10", "train.num_threads=1", "train.log_every=1",
        "train.eval_every=100", "train.eval_max_sentences=2"]


class FakeDevice:
    """A memory query patched in for the CPU: a step needs fixed + per_token * (padded tokens of
    its largest side) + per_target * (real target tokens: the output layer and the loss), and a
    step needing more than `capacity` runs out of memory, as CUDA would."""

    def __init__(self, capacity: int, fixed: int = 100 * MiB, per_token: int = MiB // 8, per_target: int = 0) -> None:
        self.total, self.fixed, self.per_token, self.per_target, self.current = capacity, fixed, per_token, per_target, 0

    def need(self, tokens: int, targets: int = 0) -> int:
        return self.fixed + self.per_token * tokens + self.per_target * targets

    def capacity(self) -> int:
        return self.total

    def reset(self) -> None:
        self.current = 0

    def peak(self) -> int:
        return self.current

    def patch(self, monkeypatch) -> None:
        """Route the probe to this device, and make every forward + backward allocate on it."""
        from mtrain import trainer

        original = trainer.forward_backward

        def forward_backward(objective, micro, *args, **kwargs):
            for src, tgt_in, tgt_out in micro:
                need = self.need(max(src.numel(), tgt_in.numel()), int((tgt_out != 0).sum()))  # pad id 0
                if need > self.total:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
                self.current = max(self.current, need)
            return original(objective, micro, *args, **kwargs)

        monkeypatch.setattr(trainer, "forward_backward", forward_backward)
        monkeypatch.setattr(probe, "memory_gauge", lambda device: self)


def train_cli(data, out, *sets: str):
    args = ["train", "--data", str(data), "--device", "cpu"] + (["--out", str(out)] if out else ["--dry-run"])
    for item in TINY + list(sets):
        args += ["--set", item]
    return CliRunner().invoke(app, args)


def test_auto_picks_the_largest_budget_that_fits_and_says_so(tokenized_slice, monkeypatch):
    device = FakeDevice(capacity=800 * MiB)
    device.patch(monkeypatch)
    result = train_cli(tokenized_slice, None, "train.max_tokens=auto")
    assert result.exit_code == 0, result.output
    chosen = json.loads(result.stdout[result.stdout.index("{"):])["max_tokens"]
    from mtrain.data import TokenizedData

    split = TokenizedData(tokenized_slice).split("train")
    longest = probe.longest_cost(split.src.lengths, split.tgt.lengths)
    padded = lambda budget: (budget // longest) * longest  # noqa: E731 - the probe batch's size
    limit = 0.9 * device.total
    assert device.need(padded(chosen)) <= limit
    assert device.need(padded(chosen * 17 // 16 + 2 * probe.GRAIN + longest)) > limit  # near the largest
    logged = [x for x in result.stderr.splitlines() if x.startswith("train.max_tokens=auto:")]
    assert logged == [f"train.max_tokens=auto: {chosen} (the largest budget whose steps on the longest pairs and "
                      f"on the longest targets fit in cpu's memory with 10% left free)"]
    assert "max_tokens probe:" in result.stderr  # each budget tried, with its peak


def test_with_subword_sampling_the_probe_measures_the_sampled_segmentation(tokenized_slice, monkeypatch):
    """train.sampling_alpha cuts training batches from sampled segmentations, which have more pieces
    than the cached ids (about twice as many at alpha 0.1): the probe's batches are cut from the first
    epoch's sampled segmentation, the one training starts with, so that its longer pairs are measured."""
    import numpy as np

    from mtrain import trainer
    from mtrain.data import SubwordSampler, TokenizedData

    data = TokenizedData(tokenized_slice)
    split = data.split("train")
    sampled = SubwordSampler(split, data.tokenizer, 0.1, 1, probe.CEILING)(1)
    widest = lambda s: int(np.maximum(s.src.lengths, s.tgt.lengths).max()) + 1  # noqa: E731
    assert widest(sampled) > widest(split)
    FakeDevice(capacity=800 * MiB).patch(monkeypatch)
    original, seen = trainer.forward_backward, []

    def forward_backward(objective, micro, *args, **kwargs):
        seen.extend(max(src.shape[1], tgt_in.shape[1]) for src, tgt_in, _ in micro)
        return original(objective, micro, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward", forward_backward)
    result = train_cli(tokenized_slice, None, "train.max_tokens=auto", "train.sampling_alpha=0.1", "train.seed=1")
    assert result.exit_code == 0, result.output
    assert max(seen) == widest(sampled)  # the longest sampled pair (with EOS), not the longest cached one


def test_auto_keeps_the_batch_with_the_most_target_tokens_under_the_limit(tokenized_slice, monkeypatch):
    """Where memory follows the real target tokens (the output layer and the loss at a large
    vocabulary), the longest pairs are not the most demanding batch: a long source pads a batch that
    holds fewer targets. At the chosen budget every batch of an epoch stays under the limit, and the
    budget is near the largest for which the fullest-target batch does."""
    import numpy as np

    from mtrain.data import TokenizedData, make_batches

    device = FakeDevice(capacity=800 * MiB, per_token=MiB // 64, per_target=MiB // 8)
    device.patch(monkeypatch)
    result = train_cli(tokenized_slice, None, "train.max_tokens=auto")
    assert result.exit_code == 0, result.output
    chosen = json.loads(result.stdout[result.stdout.index("{"):])["max_tokens"]
    split = TokenizedData(tokenized_slice).split("train")
    src, tgt = split.src.lengths, split.tgt.lengths
    cost = np.maximum(src, tgt) + 1

    def need(rows) -> int:  # padded tokens of the batch, and its target tokens plus EOS
        return device.need(len(rows) * int(cost[rows].max()), int(tgt[rows].sum()) + len(rows))

    limit = 0.9 * device.total
    assert max(need(rows) for rows in make_batches(src, tgt, chosen, seed=1, epoch=1)) <= limit
    batches = probe.ProbeBatches(src, tgt)
    assert need(batches.fullest(chosen * 17 // 16 + 4 * probe.GRAIN)) > limit
    assert need(batches.longest(chosen)) < need(batches.fullest(chosen))


def test_auto_run_starts_as_one_given_its_budget_and_resumes_with_it(tokenized_slice, tmp_path, monkeypatch):
    """The probe trains a throw-away model and leaves the RNGs as it found them (it forks them, and
    the run seeds them again when it builds its model): a run with auto trains bit-identically to
    one given the chosen number. Resuming keeps the stored budget, whatever the device now says."""
    device = FakeDevice(capacity=800 * MiB)
    device.patch(monkeypatch)
    auto = train_cli(tokenized_slice, tmp_path / "auto", "train.max_tokens=auto", "train.max_steps=3")
    assert auto.exit_code == 0, auto.output
    chosen = checkpoint.load(tmp_path / "auto" / "last.pt")["config"]["train"]["max_tokens"]
    assert isinstance(chosen, int) and chosen >= 1024
    given = train_cli(tokenized_slice, tmp_path / "given", f"train.max_tokens={chosen}", "train.max_steps=3")
    assert given.exit_code == 0, given.output
    a, b = (checkpoint.load(tmp_path / name / "last.pt")["model"] for name in ("auto", "given"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    device.total = 1600 * MiB  # the probe would now pick more
    again = train_cli(tokenized_slice, tmp_path / "auto", "train.max_tokens=auto", "train.max_steps=4")
    assert again.exit_code == 0, again.output
    assert f"train.max_tokens=auto: {chosen} (the value {tmp_path / 'auto' / 'last.pt'} was trained with)" in again.stderr
    assert "max_tokens probe:" not in again.stderr


@pytest.mark.parametrize("here,elsewhere", [(False, False), (False, True), (True, False)])
def test_a_probe_that_fails_on_one_process_stops_every_process(monkeypatch, here, elsewhere):
    """With several processes each probes its own GPU, then they take the smallest budget in an
    all-reduce. A probe that fails on one process (not even the longest pair fits) must stop the
    others too, not leave them waiting in that all-reduce: every process first says whether its
    probe failed, and all stop if any did."""
    import types

    from mtrain import trainer

    said: list[bool] = []
    too_small = MtrainError("train.max_tokens=auto: even 90 tokens (injected)")

    def any_rank(flag, info, device):
        said.append(flag)
        return flag or elsewhere

    def probe_here(cfg, gauge):
        if here:
            raise too_small
        return 4096

    monkeypatch.setattr(trainer.dist_utils, "any_rank", any_rank)
    monkeypatch.setattr(trainer, "smallest_over_ranks", lambda tokens, dist, device: tokens - 64)  # another rank's
    fake = types.SimpleNamespace(dist=None, device=torch.device("cpu"), _probe_max_tokens=probe_here)
    if not (here or elsewhere):
        assert trainer.Trainer._probe_on_every_rank(fake, None, None) == 4032
    else:
        with pytest.raises(MtrainError) as caught:
            trainer.Trainer._probe_on_every_rank(fake, None, None)
        assert caught.value is too_small if here else "failed on another process" in str(caught.value)
    assert said == [here]


def test_auto_survives_running_out_of_memory_inside_adams_first_step(tokenized_slice, monkeypatch):
    """Adam makes its moments in its first step(); running out of memory there leaves a parameter's
    state half made (its step count, no moments), as torch's Adam does. The next budget the probe
    tries must start from a clean optimizer, not fail on the half-made state."""
    from mtrain import trainer

    FakeDevice(capacity=800 * MiB).patch(monkeypatch)
    original, failed = trainer.new_optimizer, []

    def new_optimizer(model, t, device):
        optimizer = original(model, t, device)
        step = optimizer.step

        def first_step_runs_out(*args, **kwargs):
            if not failed:
                failed.append(True)
                optimizer.state[next(iter(model.parameters()))]["step"] = torch.tensor(0.0)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
            return step(*args, **kwargs)

        optimizer.step = first_step_runs_out
        return optimizer

    monkeypatch.setattr(trainer, "new_optimizer", new_optimizer)
    result = train_cli(tokenized_slice, None, "train.max_tokens=auto")
    assert result.exit_code == 0, result.output
    assert failed and f"max_tokens probe: {probe.START} tokens: out of memory" in result.stderr
    assert json.loads(result.stdout[result.stdout.index("{"):])["max_tokens"] < probe.START


def test_the_probe_keeps_adams_moments_through_a_budget_that_runs_out(tokenized_slice, monkeypatch):
    """Training holds Adam's moments while it steps, so the probe must too: after a budget runs out
    of memory in forward or backward, the next budgets are measured with every parameter's moments
    still in place, not from an emptied optimizer."""
    from mtrain import trainer

    FakeDevice(capacity=800 * MiB).patch(monkeypatch)
    made, original_optimizer = [], trainer.new_optimizer

    def new_optimizer(*args):
        made.append(original_optimizer(*args))
        return made[-1]

    monkeypatch.setattr(trainer, "new_optimizer", new_optimizer)
    fake_forward_backward, seen = trainer.forward_backward, []

    def forward_backward(objective, micro, *args, **kwargs):
        optimizer = made[0]  # the probe's: a dry run builds it first and trains nothing
        complete = sum({"exp_avg", "exp_avg_sq"} <= s.keys() for s in optimizer.state.values())
        too_large = max(max(src.numel(), tgt.numel()) for src, tgt, _ in micro) > 3000
        seen.append((complete, too_large))
        if too_large:  # memory that grows faster than the probe's line predicts
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return fake_forward_backward(objective, micro, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward", forward_backward)
    result = train_cli(tokenized_slice, None, "train.max_tokens=auto")
    assert result.exit_code == 0, result.output
    n_params = len(list(made[0].param_groups[0]["params"]))
    first_fit = next(i for i, (_, too_large) in enumerate(seen) if not too_large)
    failures = [i for i, (_, too_large) in enumerate(seen) if too_large]
    assert failures and failures[-1] < len(seen) - 1  # a budget ran out, and others were measured after it
    assert all(complete == n_params for complete, _ in seen[first_fit + 1:])


def test_auto_on_a_cpu_is_the_default_budget(tokenized_slice):
    result = train_cli(tokenized_slice, None, "train.max_tokens=auto")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout[result.stdout.index("{"):])["max_tokens"] == probe.CPU_DEFAULT


# ---------------------------------------------------------------- out of memory mid-run

def oom_at_update(monkeypatch, n: int, error: BaseException | None = None) -> list:
    """Update n of the next run runs out of memory (injected: `error`, else PyTorch's own error).
    Returns the micro-batches each update was given, as they come."""
    from mtrain import trainer

    original, calls = trainer.forward_backward, []

    def forward_backward(objective, micro, *args, **kwargs):
        calls.append(micro)
        if len(calls) == n:
            raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return original(objective, micro, *args, **kwargs)
    monkeypatch.setattr(trainer, "forward_backward", forward_backward)
    return calls


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"),
                                   RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")],
                         ids=["OutOfMemoryError", "cublas-alloc"])
def test_out_of_memory_mid_run_is_one_line_and_the_run_resumes(tokenized_slice, tmp_path, monkeypatch, error):
    """Update 5 meets a batch too large for the device (injected, as PyTorch's own error or as a
    library's failed allocation). The run stops with one line: the step, the batch's shape, a smaller
    max_tokens; last.pt (saved at update 4) is untouched; the same command on a device with room then
    ends bit-identical to a run never stopped."""
    sets = ["train.max_tokens=512", "train.max_steps=8", "train.save_every=2"]
    whole = train_cli(tokenized_slice, tmp_path / "whole", *sets)
    assert whole.exit_code == 0, whole.output
    out = tmp_path / "cut"
    with monkeypatch.context() as patch:
        calls = oom_at_update(patch, 5, error)
        cut = train_cli(tokenized_slice, out, *sets)
    assert cut.exit_code == 1
    assert "Traceback" not in cut.output
    last = cut.stderr.strip().splitlines()[-1]
    src, tgt, _ = calls[4][0]
    assert last == (f"error: step 5: out of cpu memory in a batch of {src.shape[0]} x {src.shape[1]} source / "
                    f"{tgt.shape[0]} x {tgt.shape[1]} target tokens (train.max_tokens=512); {out / 'last.pt'} is "
                    "intact, and re-running the same command with --set train.max_tokens=384 resumes from it")
    assert checkpoint.load(out / "last.pt")["step"] == 4
    resumed = train_cli(tokenized_slice, out, *sets)
    assert resumed.exit_code == 0 and "resuming from" in resumed.stderr
    a, b = (checkpoint.load(tmp_path / name / "last.pt")["model"] for name in ("whole", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_out_of_memory_error_lets_go_of_the_failed_update(tokenized_slice, tmp_path, monkeypatch):
    """A script or notebook that catches the error and retries with the suggested budget in the same
    process needs the failed update's memory back: the error carries no context (the frames of the
    update, which hold its activations), and what the update made is freed once it is raised."""
    import weakref

    from mtrain import trainer

    original, calls, made = trainer.forward_backward, [], []

    def forward_backward(objective, micro, *args, **kwargs):
        calls.append(micro)
        if len(calls) == 3:
            activations = torch.ones(1024)
            made.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return original(objective, micro, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward", forward_backward)
    config = load_config(None, TINY + ["train.max_tokens=512", "train.max_steps=5"])
    with pytest.raises(MtrainError, match=r"^step 3: out of cpu memory in a batch of ") as caught:
        train(config, tokenized_slice, tmp_path / "run", device="cpu")
    assert str(caught.value).endswith("(train.max_tokens=512); nothing was saved yet: re-run the same command with "
                                      "--set train.max_tokens=384 to start again")
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert made and made[0]() is None


def test_out_of_memory_copying_a_batch_to_the_device_is_the_same_line(tokenized_slice, tmp_path, monkeypatch):
    """The copy of an update's batch to the device can be the allocation that fails: the same line,
    naming the step and the batch, as an update that runs out."""
    from mtrain import trainer

    original, calls = trainer.to_device, []

    def to_device(tensors, device):
        calls.append(tensors)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        return original(tensors, device)

    monkeypatch.setattr(trainer, "to_device", to_device)
    config = load_config(None, TINY + ["train.max_tokens=512", "train.max_steps=5", "train.save_every=2"])
    with pytest.raises(MtrainError) as caught:
        train(config, tokenized_slice, tmp_path / "run", device="cpu")
    src, tgt, _ = calls[2]
    assert str(caught.value) == (
        f"step 3: out of cpu memory in a batch of {src.shape[0]} x {src.shape[1]} source / {tgt.shape[0]} x "
        f"{tgt.shape[1]} target tokens (train.max_tokens=512); {tmp_path / 'run' / 'last.pt'} is intact, and "
        "re-running the same command with --set train.max_tokens=384 resumes from it")


def test_the_suggested_budget_resumes_the_run_to_its_end(tokenized_slice, tmp_path, monkeypatch):
    """What the line says to do works: the same command with the suggested max_tokens resumes from
    last.pt (the batches are re-cut for the new budget) and trains to max_steps."""
    sets = ["train.max_tokens=512", "train.max_steps=6", "train.save_every=2"]
    with monkeypatch.context() as patch:
        oom_at_update(patch, 3)
        with pytest.raises(MtrainError, match=r"--set train\.max_tokens=384 resumes from it$"):
            train(load_config(None, TINY + sets), tokenized_slice, tmp_path / "run", device="cpu")
    train(load_config(None, TINY + sets + ["train.max_tokens=384"]), tokenized_slice, tmp_path / "run", device="cpu")
    last = checkpoint.load(tmp_path / "run" / "last.pt")
    assert last["step"] == 6 and last["config"]["train"]["max_tokens"] == 384


def test_out_of_memory_at_the_longest_pairs_budget_says_no_smaller_budget_helps(tokenized_slice, tmp_path, monkeypatch):
    """A budget that is already the longest pair's cost cannot shrink: the line says what can help."""
    from mtrain.data import TokenizedData

    split = TokenizedData(tokenized_slice).split("train")
    floor = probe.longest_cost(split.src.lengths, split.tgt.lengths)
    oom_at_update(monkeypatch, 1)
    with pytest.raises(MtrainError) as caught:
        train(load_config(None, TINY + [f"train.max_tokens={floor}", "train.max_steps=3"]), tokenized_slice,
              tmp_path / "run", device="cpu")
    assert str(caught.value).endswith(f"(train.max_tokens={floor}); the budget is already the longest pair's {floor} "
                                      "tokens: lower data.max_len and re-tokenize, or train on a device with more memory")


def test_suggested_budget_is_three_quarters_in_64s_and_never_below_the_longest_pair():
    from mtrain.trainer import suggest_max_tokens

    assert suggest_max_tokens(512, 60) == 384 and suggest_max_tokens(25000, 60) == 18688 and suggest_max_tokens(100, 10) == 64
    assert suggest_max_tokens(512, 401) == 448  # 384 would be refused: the floor, rounded up to 64
    assert suggest_max_tokens(512, 500) == 500  # rounded up it would not be smaller: the floor itself
    assert suggest_max_tokens(512, 200) == 384
    assert suggest_max_tokens(64, 10) == 48  # three quarters, where no multiple of 64 is left
    assert suggest_max_tokens(500, 500) is None  # nothing smaller holds the longest pair


# ---------------------------------------------------------------- out of memory anywhere else

OUT_OF_MEMORY = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
                 RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
                 RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes")]


@pytest.mark.parametrize("err", OUT_OF_MEMORY, ids=["torch", "cuda-error", "cublas", "cpu"])
def test_out_of_memory_outside_an_update_is_one_line_naming_the_batch_settings(err, capsys):
    """Validation, translate or score running out of memory: one line (the error's first line and the
    settings that size a batch), exit code 1, no traceback; other RuntimeErrors are bugs and propagate."""
    import typer

    from mtrain.cli import friendly
    from mtrain.errors import is_out_of_memory

    assert is_out_of_memory(err)

    def command():
        raise err

    with pytest.raises(typer.Exit) as stop:
        friendly(command)()
    assert stop.value.exit_code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: out of memory ({str(err).splitlines()[0]}); ")
    assert "--max-tokens" in lines[0] and "train.max_tokens" in lines[0]

    def bug():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")

    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not a RuntimeError: not PyTorch's
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        friendly(bug)()
