"""The HTTP side of `mtrain serve`: FastAPI routes over a Batcher.

    POST /translate  {"text": [...], "beam": 5, ...} -> {"translations": [...]}, line for line
    GET  /health     model, device, precision, queue
    GET  /           a page to try it;  GET /docs: the OpenAPI page

The body is read and checked here, not by FastAPI's own parsing, so that every bad request gets one
status and one JSON line {"error": "..."} (the table in docs/serve.md): 400 for a body that is not
UTF-8 JSON, 413 over a limit (refused, never truncated), 422 for a well-formed request the model
cannot take (a wrong type, an unknown option, an empty list, an invalid setting), 503 while the
queue is full or the server stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from importlib import metadata, resources
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from mtrain.config import DecodeConfig
from mtrain.errors import MtrainError
from mtrain.serve.batcher import Batcher
from mtrain.translate import check_decode


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may hold; more is refused with 413."""

    max_lines: int = 256
    max_chars: int = 100_000  # characters over all lines (and prefixes)
    max_queue_lines: int = 20_000  # lines waiting for a batch, all requests together; beyond: 503

    @property
    def max_body(self) -> int:
        """Bytes of a request body: every character as a 6-byte JSON escape, plus room for options."""
        return 6 * self.max_chars + 4 * self.max_lines + 16_384


Number = Optional[StrictFloat | StrictInt]  # JSON has one number type: 1 is a valid lenpen


class TranslateRequest(BaseModel):
    """The lines to translate, and the decoding options of `mtrain translate` that make sense per
    request (left out: the server's, from its command line)."""

    model_config = ConfigDict(extra="forbid")

    text: list[StrictStr] = Field(description="Sentences to translate, one per item.")
    prefix: Optional[list[StrictStr]] = Field(None, description="Per item, raw target text the translation starts with (\"\" = none).")
    beam: Optional[StrictInt] = Field(None, description="Beam size; 1 = greedy.")
    lenpen: Number = Field(None, description="GNMT length penalty alpha.")
    max_len_a: Number = Field(None, description="Max output length = a * source length + b tokens.")
    max_len_b: Optional[StrictInt] = None
    nbest: Optional[StrictInt] = Field(None, description="Hypotheses per item (at most beam; with sample, samples).")
    sample: Optional[StrictBool] = Field(None, description="Draw each token instead of searching.")
    topk: Optional[StrictInt] = None
    topp: Number = None
    temperature: Number = None
    seed: Optional[StrictInt] = None
    no_repeat_ngram: Optional[StrictInt] = None


class Hypothesis(BaseModel):
    text: str
    score: float


class TranslateResponse(BaseModel):
    translations: list[str] = Field(description="The best translation of each item, in order.")
    nbest: Optional[list[list[Hypothesis]]] = Field(None, description="With nbest > 1: each item's hypotheses, best first.")


SAMPLING_ONLY = ("topk", "topp", "temperature", "seed")


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes: by its Content-Length before reading, and while
    reading a body sent without one."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"request body of {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadRequest(413, f"request body over {limit} bytes")
    return bytes(body)


def parse(body: bytes) -> TranslateRequest:
    """The request, or BadRequest naming the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(400, f"request body is not UTF-8 (byte 0x{body[err.start]:02x} at offset {err.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadRequest(400, f"request body is not JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(data, dict):
        raise BadRequest(422, 'the body must be a JSON object such as {"text": ["Ein Hund läuft."]}')
    unknown = sorted(set(data) - set(TranslateRequest.model_fields))
    if unknown:
        raise BadRequest(422, f"unknown option {unknown[0]!r}; the options are {', '.join(TranslateRequest.model_fields)}")
    try:
        return TranslateRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        # ("lenpen", "float"): a union's member names its type; the field and list indices say where
        where = ".".join(str(part) for part in first["loc"] if isinstance(part, int) or part in TranslateRequest.model_fields)
        raise BadRequest(422, f"{where}: {first['msg']}") from None


def check(req: TranslateRequest, limits: Limits) -> None:
    """Limits (413) and what the lines must be (422)."""
    if not req.text:
        raise BadRequest(422, "text: the list is empty; send at least one line")
    if len(req.text) > limits.max_lines:
        raise BadRequest(413, f"text: {len(req.text)} lines; the limit is {limits.max_lines} per request")
    chars = sum(map(len, req.text)) + sum(map(len, req.prefix or []))
    if chars > limits.max_chars:
        raise BadRequest(413, f"text: {chars} characters; the limit is {limits.max_chars} per request")
    if req.prefix is not None and len(req.prefix) != len(req.text):
        raise BadRequest(422, f"prefix: {len(req.prefix)} items for {len(req.text)} lines of text; send one per line")
    for name, items in (("text", req.text), ("prefix", req.prefix or [])):
        for i, item in enumerate(items):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(422, f"{name}.{i}: a lone surrogate (an unpaired \\ud800-\\udfff escape); "
                                      "send valid Unicode") from None


def decode_options(req: TranslateRequest, defaults: DecodeConfig) -> DecodeConfig:
    """The server's decoding settings with the request's options over them (422 if they cannot work)."""
    given = {key: value for key, value in req.model_dump(exclude={"text", "prefix"}).items() if value is not None}
    if not given.get("sample", defaults.sample):
        stray = [key for key in SAMPLING_ONLY if key in given]
        if stray:
            raise BadRequest(422, f"{stray[0]} applies only to sampling; add \"sample\": true (or drop {stray[0]})")
    for key in ("lenpen", "max_len_a", "topp", "temperature"):
        if key in given:
            given[key] = float(given[key])
    decode = dataclasses.replace(defaults, **given)
    try:
        check_decode(decode)
    except MtrainError as err:
        message = str(err).split("; fix the option")[0]  # translate's words for its flags: --max-len-a
        raise BadRequest(422, re.sub(r"--([a-z-]+)", lambda m: m.group(1).replace("-", "_"), message)) from None
    return decode


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is read already, so the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def package_version() -> str:
    try:
        return metadata.version("mtrain")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def make_app(batcher: Batcher, info: dict[str, Any], defaults: DecodeConfig, limits: Limits) -> FastAPI:
    """The app for one model. `info` is what /health says of it (name, device, precision, ...)."""
    app = FastAPI(title="mtrain serve", version=package_version(),
                  description=f"Translation with {info['model']} ({info['direction']}).")
    page = resources.files("mtrain.serve").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """The model, where it runs, and what waits for a batch."""
        return {"status": "ok", **info, "queue": batcher.queue(), "served": dict(batcher.counts)}

    @app.post("/translate", response_model=TranslateResponse, responses={
        400: {"description": "the body is not UTF-8 JSON"}, 413: {"description": "over a limit"},
        422: {"description": "a wrong type, an unknown option, an empty list or a setting that cannot work"},
        503: {"description": "the queue is full, or the server is stopping"}},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": TranslateRequest.model_json_schema()}}}})
    async def translate(request: Request) -> Response:
        """Translate each item of `text`; the answer is what `mtrain translate` gives for the same
        lines and options."""
        try:
            req = parse(await read_body(request, limits.max_body))
            check(req, limits)
            decode = decode_options(req, defaults)
        except BadRequest as bad:
            return error(bad.status, str(bad))
        if batcher.queue()["lines"] + len(req.text) > limits.max_queue_lines:
            return error(503, f"the queue holds {limits.max_queue_lines} lines already; retry shortly")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def finish(result: Any) -> None:  # from the decoding thread
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(result))

        try:
            job = batcher.submit(req.text, req.prefix, decode, finish)
        except RuntimeError as err:
            return error(503, str(err))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            batcher.cancel(job)  # nobody to answer: its lines leave the queue
            return Response(status_code=499)
        gone.cancel()
        result = answer.result()
        if isinstance(result, Exception):
            return error(503 if "out of memory" in str(result) else 500, f"decoding failed: {str(result).splitlines()[0][:300]}")
        body: dict[str, Any] = {"translations": [hyps[0][0] for hyps in result]}
        if decode.nbest > 1:
            body["nbest"] = [[{"text": text, "score": score} for text, score in hyps] for hyps in result]
        return JSONResponse(body)

    return app
