"""End-to-end wall times: `mtrain tokenize` on Multi30k (always) and the README main job,
scripts/quickstart.sh (tokenize -> train -> translate -> eval, about 5 minutes on 2 cores; only with --main-job).
A table goes to stderr; `--json` prints one JSON object on stdout.

    python benchmarks/e2e.py --json [--main-job]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPORA = [ROOT / "data" / "multi30k", ROOT.parent / "shared" / "corpora" / "multi30k"]


def corpus_dir() -> Path | None:
    """The local Multi30k copy that the quickstart and the tests use too."""
    return next((path for path in CORPORA if (path / "train.de").is_file()), None)


def timed(command: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> float:
    """Wall seconds of a command; its output goes to `log` (or is dropped); a failure raises."""
    start = time.perf_counter()
    with open(log or os.devnull, "w", encoding="utf-8") as out:
        subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def bench_tokenize(corpus: Path, work: Path) -> dict[str, float]:
    """Clean + train joint SentencePiece (8k) + encode and cache train/valid/test2016."""
    out = work / "tok"
    seconds = timed([sys.executable, "-m", "mtrain", "tokenize", "--data", str(corpus), "--src", "de", "--tgt", "en",
                     "--out", str(out)], log=work / "tokenize.log")
    pairs = json.loads((out / "stats.json").read_text(encoding="utf-8"))["splits"]["train"]["lines"]
    return {"tokenize_wall_s": round(seconds, 2), "tokenize_train_pairs": pairs,
            "tokenize_pairs_per_s": round(pairs / seconds, 1)}


def bench_main_job(work: Path) -> dict[str, float]:
    """scripts/quickstart.sh in fresh run/data folders, inside the current virtual environment."""
    env = dict(os.environ, RUN=str(work / "run"), TOK=str(work / "quickstart-tok"),
               VIRTUAL_ENV=os.environ.get("VIRTUAL_ENV") or sys.prefix)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    seconds = timed(["bash", "scripts/quickstart.sh"], env=env, log=work / "quickstart.log")
    tail = (work / "quickstart.log").read_text(encoding="utf-8", errors="replace").splitlines()[-6:]
    return {"main_job_wall_s": round(seconds, 1), "main_job_log_tail": tail}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry; tokenize takes ~15 s either way")
    parser.add_argument("--main-job", action="store_true", help="also time scripts/quickstart.sh (about 5 minutes on 2 cores)")
    args = parser.parse_args(argv)
    corpus = corpus_dir()
    result: dict = {"corpus": str(corpus) if corpus else None, "machine": platform.machine(), "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="mtrain-e2e-") as tmp:
        if corpus is None:
            print("no local Multi30k copy (data/multi30k or ../shared/corpora/multi30k); tokenize not timed",
                  file=sys.stderr)
        else:
            result.update(bench_tokenize(corpus, Path(tmp)))
        if args.main_job:
            result.update(bench_main_job(Path(tmp)))
    for key in ("tokenize_wall_s", "tokenize_pairs_per_s", "main_job_wall_s"):
        if key in result:
            print(f"{key:<24}{result[key]:>10}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
