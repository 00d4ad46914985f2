"""`mtrain serve` over real HTTP (uvicorn on a local port, httpx as the client), on a tiny random
checkpoint: concurrent clients get what `mtrain translate` gives for their lines and options; the
batcher decodes concurrent requests together, splits one over the token budget and drops a gone
client's lines; every bad request gets its 4xx and one JSON line, and the server answers after it;
SIGTERM answers the requests already received, then stops; the page translates in a real browser."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from mtrain.config import DecodeConfig  # noqa: E402
from mtrain.serve import build  # noqa: E402
from mtrain.serve.api import Limits  # noqa: E402
from mtrain.serve.batcher import Batcher  # noqa: E402
from mtrain.translate import load_for_decoding, translate_nbest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tokenized_slice, tmp_path_factory) -> Path:
    from mtrain.checkpoint import make, save_atomic
    from mtrain.config import Config, ModelConfig, to_dict
    from mtrain.data import TokenizedData
    from mtrain.model import Transformer

    tokenizer = TokenizedData(tokenized_slice).tokenizer
    cfg = ModelConfig(d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      vocab_size=tokenizer.tgt.vocab_size, max_len=48)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("serve") / "best.pt"
    save_atomic(make(to_dict(Config(model=cfg)), Transformer(cfg).state_dict(), tokenizer.to_state(),
                     TokenizedData(tokenized_slice).stats, 0), path)
    return path


@pytest.fixture(scope="module")
def lines(multi30k_slice) -> list[str]:
    return (multi30k_slice / "valid.de").read_text(encoding="utf-8").splitlines()[:60]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(checkpoint: Path | list[Path], decode: DecodeConfig = DecodeConfig(), window: float = 0.005,
            limits: Limits = Limits()):
    """The server's app on a local port, in a thread; yields (base URL, batcher)."""
    paths = checkpoint if isinstance(checkpoint, list) else [checkpoint]
    app, batcher, _ = build(paths, decode, torch.device("cpu"), window, limits)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", batcher
    finally:
        server.should_exit = True
        thread.join()
        batcher.stop()


def expected(checkpoint: Path, text: list[str], decode: DecodeConfig) -> list[list[tuple[str, float]]]:
    """What `mtrain translate` gives for these lines (its function, in this process)."""
    model, tokenizer, ckpt = load_for_decoding([checkpoint], torch.device("cpu"), decode)
    return translate_nbest(model, tokenizer, text, decode, "cpu", ckpt.get("stats"))[0]


OPTIONS = [{}, {"beam": 1}, {"beam": 3, "nbest": 2}, {"sample": True, "seed": 7, "topk": 5},
           {"beam": 2, "no_repeat_ngram": 2}]


def test_concurrent_clients_get_what_translate_gives(checkpoint, lines):
    """32 requests from 16 clients at once, each a random handful of lines (some empty) with one of
    several option sets: every answer, text and n-best scores, is translate's for its lines; the
    batcher decoded them in fewer batches than requests."""
    rng = random.Random(0)
    requests = []
    for _ in range(32):
        text = rng.sample(lines, rng.randint(1, 6)) + ([""] if rng.random() < 0.2 else [])
        requests.append({"text": text, **rng.choice(OPTIONS)})
    with running(checkpoint, window=0.05) as (url, batcher):
        with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda body: client.post("/translate", json=body), requests))
        served = client_health(url)["served"]
    for body, answer in zip(requests, answers):
        assert answer.status_code == 200, answer.text
        options = {key: value for key, value in body.items() if key != "text"}
        want = expected(checkpoint, body["text"], DecodeConfig(**options))
        got = answer.json()
        assert got["translations"] == [hyps[0][0] for hyps in want]
        if options.get("nbest", 1) > 1:
            assert [[h["text"] for h in hyps] for hyps in got["nbest"]] == [[t for t, _ in hyps] for hyps in want]
            scores = [h["score"] for hyps in got["nbest"] for h in hyps]
            assert scores == pytest.approx([s for hyps in want for _, s in hyps], rel=1e-5, abs=1e-4)
    assert served["lines"] == sum(len(body["text"]) for body in requests)
    assert served["batches"] < len(requests)  # requests that arrived together were decoded together


def client_health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def test_batcher_groups_by_options_splits_by_budget_and_keeps_order(checkpoint, lines, monkeypatch):
    """Requests waiting together with the same options share one batch, other options get their
    own, a request over the token budget is split over several; every request gets its lines' own
    results, in order."""
    from mtrain.serve import batcher as batcher_module

    batches = []

    def fake_translate(model, tokenizer, text, decode, device, stats, prefixes=None, numbers=None):
        batches.append((list(text), decode.beam, list(numbers)))
        return [[(f"{decode.beam}:{line}", 0.0)] for line in text], None

    monkeypatch.setattr(batcher_module, "translate_nbest", fake_translate)
    batcher = Batcher(lambda: load_for_decoding([checkpoint], torch.device("cpu")), "cpu", window=60, budget=0)
    batcher.start()
    budget = batcher.budget = sum(batcher.lengths(lines[:2] + lines[4:5]))  # a and c fill one batch
    got = {}
    greedy, beam = DecodeConfig(beam=1), DecodeConfig(beam=4)
    jobs = [("a", lines[:2], greedy), ("b", lines[2:4], beam), ("c", lines[4:5], greedy), ("long", lines[5:25], greedy)]
    for name, text, decode in jobs:  # all within the first one's window (stop ends it): they wait together
        batcher.submit(text, None, decode, lambda result, name=name: got.__setitem__(name, result))
    batcher.stop()
    for name, text, decode in jobs:
        assert [hyps[0][0] for hyps in got[name]] == [f"{decode.beam}:{line}" for line in text]
    first = batches[0]
    assert first[1] == 1 and first[0][:3] == lines[:2] + lines[4:5]  # a and c together, oldest first
    assert first[2][:3] == [0, 1, 0]  # each line numbered within its own request (sampling streams)
    assert any(b[1] == 4 and b[0] == lines[2:4] for b in batches)  # b alone: other options
    long_batches = [b for b in batches if b[1] == 1 and set(b[0]) & set(lines[5:25])]
    assert len(long_batches) > 1  # 20 lines over the budget: split
    lengths = dict(zip(lines, batcher.lengths(lines)))
    for text, _, _ in batches:
        assert len(text) == 1 or sum(lengths[line] for line in text) <= budget


def test_a_gone_client_costs_nothing(checkpoint, lines):
    """A client that gives up mid-request: its lines not yet decoded leave the queue, and the next
    client is answered."""
    decode = DecodeConfig(beam=5, max_tokens=40)  # small batches: the request spans many
    with running(checkpoint, decode=decode) as (url, batcher):
        many = [line for _ in range(4) for line in lines][:200]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/translate", json={"text": many}, timeout=0.3)
        deadline = time.monotonic() + 30
        while batcher.queue()["lines"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert batcher.counts["cancelled_lines"] > 0 and batcher.queue()["lines"] == 0
        answer = httpx.post(f"{url}/translate", json={"text": lines[:2]}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["translations"]) == 2
    assert batcher.counts["lines"] < len(many) + 2


BAD = [  # (name, body bytes, status)
    ("invalid JSON", b'{"text": ["a",', 400),
    ("invalid UTF-8", b'{"text": ["\xff\xfe"]}', 400),
    ("not an object", b'["a", "b"]', 422),
    ("text missing", b'{"beam": 5}', 422),
    ("text not a list", b'{"text": "Ein Hund."}', 422),
    ("a line not a string", b'{"text": ["a", 3]}', 422),
    ("empty list", b'{"text": []}', 422),
    ("unknown option", b'{"text": ["a"], "beams": 5}', 422),
    ("server-side option", b'{"text": ["a"], "max_tokens": 99999}', 422),
    ("wrong option type", b'{"text": ["a"], "beam": "5"}', 422),
    ("bool for a number", b'{"text": ["a"], "beam": true}', 422),
    ("setting that cannot work", b'{"text": ["a"], "beam": 0}', 422),
    ("nbest over beam", b'{"text": ["a"], "beam": 2, "nbest": 3}', 422),
    ("sampling option without sample", b'{"text": ["a"], "topp": 0.5}', 422),
    ("prefix count", b'{"text": ["a", "b"], "prefix": [""]}', 422),
    ("lone surrogate", b'{"text": ["\\ud800"]}', 422),
    ("too many lines", json.dumps({"text": ["a"] * 9}).encode(), 413),
    ("too many characters", json.dumps({"text": ["x" * 101]}).encode(), 413),
    ("body too large", b'{"text": ["' + b"y" * 20_000 + b'"]}', 413),
]


def test_bad_requests_get_a_4xx_and_the_server_goes_on(checkpoint):
    limits = Limits(max_lines=8, max_chars=100)
    table = []
    with running(checkpoint, limits=limits) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        for name, body, status in BAD:
            answer = client.post("/translate", content=body, headers={"Content-Type": "application/json"})
            error = answer.json()["error"]
            assert answer.status_code == status, (name, answer.text)
            assert isinstance(error, str) and error and "\n" not in error, name
            ok = client.post("/translate", json={"text": ["Ein Hund."]})
            assert ok.status_code == 200 and client.get("/health").status_code == 200, name
            table.append(f"| {name} | {answer.status_code} | {error} |")
    print("\n".join(table))


def test_health_docs_and_openapi_describe_the_server(checkpoint):
    with running(checkpoint) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        health = client.get("/health").json()
        assert health["model"] == f"{checkpoint.parent.name}/best.pt" and health["device"] == "cpu"
        assert health["precision"] == "float32" and health["queue"] == {"requests": 0, "lines": 0}
        schema = client.get("/openapi.json").json()
        body = schema["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"text", "beam", "nbest", "sample"} <= set(body["properties"]) and body["required"] == ["text"]
        assert client.get("/docs").status_code == 200
        page = client.get("/")
        assert page.status_code == 200 and "<textarea" in page.text


@pytest.mark.parametrize("kind", ["ensemble", "ctranslate2"])
def test_ensembles_and_exported_folders_serve_as_translate_takes_them(checkpoint, lines, kind, tmp_path):
    """Two checkpoints (an ensemble) or a CTranslate2 export folder: what translate gives for them."""
    if kind == "ensemble":
        served = [checkpoint, checkpoint]
    else:
        pytest.importorskip("ctranslate2")
        from mtrain.export import export_checkpoint

        served = [tmp_path / "ct2"]
        export_checkpoint(checkpoint, "ctranslate2", served[0])
    model, tokenizer, ckpt = load_for_decoding(served, torch.device("cpu"), DecodeConfig(beam=3))
    want = translate_nbest(model, tokenizer, lines[:6], DecodeConfig(beam=3), "cpu", ckpt.get("stats"))[0]
    with running(served) as (url, _):
        health = client_health(url)
        answer = httpx.post(f"{url}/translate", json={"text": lines[:6], "beam": 3}, timeout=60)
    assert answer.json()["translations"] == [hyps[0][0] for hyps in want]
    assert health["precision"] == ("float32" if kind == "ensemble" else "ctranslate2 float32")
    assert health["model"] == ("serve0/best.pt + serve0/best.pt" if kind == "ensemble" else "ct2")


def serve_process(checkpoint: Path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mtrain.cli", "serve", "--checkpoint", str(checkpoint),
                             "--port", str(port), "--device", "cpu", *extra],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def test_sigterm_answers_what_was_received_then_stops(checkpoint, lines):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = serve_process(checkpoint, port, "--max-tokens", "40", "--beam", "5")
    try:
        wait_ready(url, process)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{url}/translate", json={"text": lines[:40]}, timeout=120)
            while httpx.get(f"{url}/health", timeout=5).json()["served"]["batches"] == 0:
                time.sleep(0.02)  # decoding has started
            process.send_signal(signal.SIGTERM)
            answer = pending.result()
        assert answer.status_code == 200 and len(answer.json()["translations"]) == 40
        assert process.wait(timeout=60) == 0
        assert "every request received answered" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_missing_server_libraries_is_one_line(checkpoint, monkeypatch):
    from typer.testing import CliRunner

    from mtrain.cli import app

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    result = CliRunner().invoke(app, ["serve", "--checkpoint", str(checkpoint)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["error: mtrain serve needs FastAPI and uvicorn: pip install 'mtrain[serve]'"]


def chromium() -> str | None:
    return next((path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if path), None)


@pytest.mark.skipif(chromium() is None, reason="no Chromium installed (Debian: apt-get install chromium)")
def test_the_page_translates_in_a_browser(checkpoint, lines, tmp_path):
    """Type German into the page's box, press the button, read the English: what /translate gives.
    The screenshot goes to tmp_path, or to $MTRAIN_SCREENSHOT where set; $MTRAIN_SERVE_CHECKPOINT
    serves a trained model instead of the tiny random one."""
    sync_api = pytest.importorskip("playwright.sync_api")
    text = lines[:2]
    with running(Path(os.environ.get("MTRAIN_SERVE_CHECKPOINT", checkpoint))) as (url, _):
        want = httpx.post(f"{url}/translate", json={"text": text}, timeout=60).json()["translations"]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 900, "height": 620})
            page.goto(url)
            page.wait_for_function("document.getElementById('model').textContent.includes('.pt')")
            page.fill("#source", "\n".join(text))
            page.click("#go")
            page.wait_for_function("document.getElementById('status').textContent.endsWith('ms')", timeout=60_000)
            assert page.inner_text("#output").split("\n") == want
            shot = Path(os.environ.get("MTRAIN_SCREENSHOT", tmp_path / "page.png"))
            page.screenshot(path=str(shot))
            browser.close()
    assert shot.stat().st_size > 0


def test_a_checkpoint_that_does_not_load_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from mtrain.cli import app

    result = CliRunner().invoke(app, ["serve", "--checkpoint", str(tmp_path / "missing.pt")])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing.pt" in lines[0]
