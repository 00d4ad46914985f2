"""`mtrain serve`: a translation server over HTTP (optional extra `mtrain[serve]`: FastAPI, uvicorn).

`batcher` decodes the lines of concurrent requests together in one thread; `api` holds the routes,
the request checks and their error table; `page.html` is the page at `/`. `serve` loads the model as
`mtrain translate` does (a checkpoint, an ensemble, or an exported CTranslate2 folder) and runs
uvicorn until Ctrl-C or SIGTERM, which stop new connections and answer every request already
received before the process ends."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from mtrain.errors import MtrainError

INSTALL_HINT = "mtrain serve needs FastAPI and uvicorn: pip install 'mtrain[serve]'"


def require_server_libraries() -> None:
    """One line naming the extra to install, where FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise MtrainError(INSTALL_HINT) from None


def describe(checkpoints: list[Path], model: Any, ckpt: dict[str, Any], device: Any, decode: Any) -> dict[str, Any]:
    """What /health and the page say of the model."""
    from mtrain.search import weights_dtype
    from mtrain.translate import Engine

    data = (ckpt.get("config") or {}).get("data", {})
    if isinstance(model, Engine):
        precision = f"ctranslate2 {getattr(model, 'meta', {}).get('quantization') or 'float32'}"
    elif decode.quantize == "int8":
        precision = "int8"
    else:
        precision = str(weights_dtype(model)).removeprefix("torch.")
    name = " + ".join(path.name if path.is_dir() else f"{path.parent.name}/{path.name}" for path in checkpoints)
    return {"model": name, "checkpoints": [str(path) for path in checkpoints],
            "direction": f"{data.get('src', '?')}->{data.get('tgt', '?')}", "device": str(device),
            "precision": precision, "defaults": {"beam": decode.beam, "lenpen": decode.lenpen,
                                                 "max_tokens": decode.max_tokens}}


def build(checkpoints: list[Path], decode: Any, device: Any, window: float, limits: Any):
    """(FastAPI app, Batcher started) for these checkpoints; the caller stops the batcher."""
    from mtrain.serve.api import make_app
    from mtrain.serve.batcher import Batcher
    from mtrain.translate import check_decode, load_for_decoding

    check_decode(decode)
    if decode.workers != 1:
        raise MtrainError(f"decode.workers={decode.workers}: the server decodes in one process, its batches in "
                          "one thread with every core; drop decode.workers")
    batcher = Batcher(lambda: load_for_decoding(checkpoints, device, decode), device, window, decode.max_tokens).start()
    info = describe(checkpoints, batcher.model, batcher.ckpt, device, decode)
    return make_app(batcher, info, decode, limits), batcher, info


def serve(checkpoints: list[Path], decode: Any, device: Any, host: str, port: int, window: float, limits: Any) -> None:
    """Run the server until Ctrl-C or SIGTERM (see the module docstring)."""
    import uvicorn

    app, batcher, info = build(checkpoints, decode, device, window, limits)
    print(f"serving {info['model']} ({info['direction']}, {info['device']}, {info['precision']}) on "
          f"http://{host}:{port}/  (API docs: /docs)", file=sys.stderr, flush=True)
    # uvicorn stops on SIGINT and SIGTERM once every request received is answered, then raises the
    # signal again for the handler it found: these record it, so that a stop it asked for ends in
    # one line and exit status 0, not a KeyboardInterrupt or death by the signal.
    stops: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, frame: stops.append(number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        batcher.stop()
    if stops:
        print(f"stopped by {signal.Signals(stops[0]).name}, every request received answered", file=sys.stderr)
