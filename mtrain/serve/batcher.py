"""Dynamic batching: the lines of requests that arrive together are decoded together.

One thread owns the model and decodes; request handlers only queue their lines and wait. When a
request arrives the thread waits a short collection window (`window` seconds after the oldest
waiting request arrived) unless a full batch is waiting already, then takes the lines of every
waiting request with the same decoding options, oldest first, up to the token budget
(decode.max_tokens source tokens), and decodes them in one call of translate_nbest. A request
longer than the budget is split across batches; a request is answered when its last line is.

Each line keeps its number within its own request, which picks its sampling streams, so a
request's answer is what `mtrain translate` gives for its lines (the search of a line does not
depend on the other rows of its batch beyond float rounding: docs/guarantees.md).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from mtrain.config import DecodeConfig
from mtrain.translate import Hypotheses, char_cap, translate_nbest

Finish = Callable[[Any], None]  # called once, from the decoding thread: a Hypotheses, or an Exception


@dataclasses.dataclass(eq=False)
class Request:
    """One client's lines (and prefixes) to translate with one set of decoding options."""

    lines: list[str]
    prefixes: list[str] | None
    decode: DecodeConfig
    lengths: list[int]  # source tokens of each line (capped to the model's max_len), for the budget
    finish: Finish
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    results: Hypotheses = dataclasses.field(init=False)  # per line, filled as its batches finish
    taken: int = 0  # lines handed to a batch so far
    done: int = 0  # lines decoded
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.results = [[] for _ in self.lines]


@dataclasses.dataclass
class Slice:
    """Lines start..end-1 of one request, in one batch."""

    request: Request
    start: int
    end: int


class Batcher:
    """The decoding thread and its queue (see the module docstring). `load` gives what
    mtrain.translate.load_for_decoding gives (model, tokenizer, checkpoint dict); `window` is the
    collection window in seconds; `budget` the source tokens per batch.

    The thread calls `load` itself, so that no other thread of the process has run a parallel
    torch op: one that had (the main thread loading the model) keeps its own OpenMP team, and the
    two teams shared 2 cores badly, a one-line beam-5 request taking 66 ms instead of 29 ms (2-core
    Zen 4, the quickstart model)."""

    def __init__(self, load: Callable[[], tuple[Any, Any, dict[str, Any]]], device: Any, window: float,
                 budget: int) -> None:
        self.load, self.device, self.window, self.budget = load, device, window, budget
        self.model: Any = None
        self.tokenizer: Any = None
        self.ckpt: dict[str, Any] = {}
        self.stats: dict[str, Any] | None = None
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.waiting: list[Request] = []  # requests with lines not yet handed to a batch, oldest first
        self.cond = threading.Condition()
        self.stopping = False
        self.counts = {"batches": 0, "lines": 0, "cancelled_lines": 0}
        self.thread = threading.Thread(target=self._run, name="mtrain-decode", daemon=True)

    def start(self) -> Batcher:
        """Start the thread; return once it has loaded the model (or raise what loading raised)."""
        self.thread.start()
        self.loaded.wait()
        if self.load_error is not None:
            self.thread.join()
            raise self.load_error
        return self

    def stop(self) -> None:
        """Decode what is waiting, then end the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()

    def lengths(self, lines: list[str]) -> list[int]:
        """Each line's source tokens as the search will see them (cut to the model's max_len)."""
        cap, limit = char_cap(self.model.cfg.max_len), self.model.cfg.max_len
        return [min(len(ids) + 1, limit) for ids in self.tokenizer.src.encode([line[:cap] for line in lines])]

    def submit(self, lines: list[str], prefixes: list[str] | None, decode: DecodeConfig, finish: Finish) -> Request:
        request = Request(lines, prefixes, decode, self.lengths(lines), finish)
        with self.cond:
            if self.stopping:
                raise RuntimeError("the server is stopping")
            self.waiting.append(request)
            self.cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """The client is gone: its lines not yet in a batch are never decoded."""
        with self.cond:
            request.cancelled = True
            if request in self.waiting:
                self.waiting.remove(request)
                self.counts["cancelled_lines"] += len(request.lines) - request.taken

    def queue(self) -> dict[str, int]:
        """Requests and lines waiting for a batch."""
        with self.cond:
            return {"requests": len(self.waiting), "lines": sum(len(r.lines) - r.taken for r in self.waiting)}

    # --- the decoding thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.model, self.tokenizer, self.ckpt = self.load()
            self.stats = self.ckpt.get("stats") or None
        except BaseException as err:  # handed to start(), in the calling thread
            self.load_error = err
            return
        finally:
            self.loaded.set()
        while True:
            with self.cond:
                while not self.waiting and not self.stopping:
                    self.cond.wait()
                if not self.waiting:
                    return  # stopping, and nothing left
                self._collect()
                batch = self._take()
            self._decode(batch)

    def _collect(self) -> None:
        """Wait (holding the condition) until the oldest request's window has passed or a full
        batch of its options is waiting."""
        oldest = self.waiting[0]
        while not self.stopping and self._waiting_tokens(oldest.decode) < self.budget:
            left = oldest.arrived + self.window - time.monotonic()
            if left <= 0:
                return
            self.cond.wait(left)

    def _waiting_tokens(self, decode: DecodeConfig) -> int:
        return sum(sum(r.lengths[r.taken:]) for r in self.waiting if r.decode == decode)

    def _take(self) -> list[Slice]:
        """Lines of the waiting requests with the oldest one's options, oldest first, up to the
        budget (at least one line)."""
        decode, tokens, batch = self.waiting[0].decode, 0, []
        for request in [r for r in self.waiting if r.decode == decode]:
            start = end = request.taken
            while end < len(request.lines) and (tokens == 0 or tokens + request.lengths[end] <= self.budget):
                tokens += request.lengths[end]
                end += 1
            if end > start:
                batch.append(Slice(request, start, end))
                request.taken = end
            if request.taken == len(request.lines):
                self.waiting.remove(request)
            if tokens >= self.budget or end < len(request.lines):
                break
        return batch

    def _decode(self, batch: list[Slice]) -> None:
        lines = [line for s in batch for line in s.request.lines[s.start : s.end]]
        numbers = [i for s in batch for i in range(s.start, s.end)]
        with_prefixes = any(s.request.prefixes is not None for s in batch)
        prefixes = [(s.request.prefixes or [""] * len(s.request.lines))[i] for s in batch
                    for i in range(s.start, s.end)] if with_prefixes else None
        try:
            results, _ = translate_nbest(self.model, self.tokenizer, lines, batch[0].request.decode, self.device,
                                         self.stats, prefixes=prefixes, numbers=numbers)
        except Exception as err:  # one batch failing (out of memory, say) fails its requests, not the server
            for request in {id(s.request): s.request for s in batch}.values():
                self._fail(request, err)
            return
        self.counts["batches"] += 1
        self.counts["lines"] += len(lines)
        at = 0
        for s in batch:
            request = s.request
            request.results[s.start : s.end] = results[at : at + s.end - s.start]
            at += s.end - s.start
            request.done += s.end - s.start
            if request.done == len(request.lines) and not request.cancelled:
                request.finish(request.results)

    def _fail(self, request: Request, err: Exception) -> None:
        with self.cond:
            if request in self.waiting:
                self.waiting.remove(request)
            done, request.cancelled = request.cancelled, True
        if not done:
            request.finish(err)
