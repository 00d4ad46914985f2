"""A behaviour fingerprint: proof that a change to mtrain's code (a refactor, a move of modules)
changed nothing a user sees, or exactly what it changed.

    python benchmarks/fingerprint.py --code PATH --out DIR      # run the pipeline with the code at PATH
    python benchmarks/fingerprint.py --compare DIR_A DIR_B      # what differs between two runs

It runs `python -m mtrain` with PYTHONPATH=PATH on a slice of Multi30k (data/multi30k: 3000
training pairs, 100 valid and test lines): tokenize, a short training run in float32 and one in
bfloat16 (where the CPU has it), translate greedy, beam 5, beam 3 n-best, sampling and the
bfloat16 copy's greedy and beam, and score. It writes each output to DIR and prints one JSON object
of SHA-256 digests. --compare says, item by item, identical or not, and for translations the share
of identical lines. Two runs of the same code on one host give the same digests (threads fixed
at 2); hosts of other CPU kinds may round differently."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "multi30k"
TRAIN = ["model.d_model=64", "model.d_ff=128", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
         "train.max_steps=40", "train.warmup_steps=20", "train.max_tokens=1024", "train.eval_every=40",
         "train.save_every=40", "train.log_every=10", "train.seed=1", "train.num_threads=2"]
SEARCHES = {"greedy": ["--greedy"], "beam5": ["--beam", "5"], "nbest": ["--beam", "3", "--nbest", "2"],
            "sample": ["--sample", "--topk", "5", "--seed", "3", "--nbest", "2"],
            "bf16_greedy": ["--greedy", "--set", "decode.amp=bf16"], "bf16_beam5": ["--beam", "5", "--set", "decode.amp=bf16"]}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def weights_digest(path: Path, code: Path) -> str:
    """The digest of a checkpoint's weights, tensor by tensor in name order (not of the file, whose
    pickled metadata may carry paths and times)."""
    script = ("import hashlib, sys, torch; ck = torch.load(sys.argv[1], weights_only=True, map_location='cpu'); "
              "h = hashlib.sha256(); [h.update(k.encode()) or h.update(v.contiguous().view(torch.uint8).numpy().tobytes()) "
              "for k, v in sorted(ck['model'].items())]; print(h.hexdigest()[:16])")
    return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                          env=environment(code)).stdout.strip()


def environment(code: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="2")
    env.pop("MTRAIN_MKL_INTEL_PATH", None)
    return env


def mtrain(code: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "mtrain", *args], env=environment(code), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"mtrain {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def slice_corpus(out: Path) -> Path:
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 3000), ("valid", 100), ("test2016", 100)):
        for lang in ("de", "en"):
            lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:n]
            (corpus / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus


def run(code: Path, out: Path) -> dict[str, str]:
    corpus = slice_corpus(out)
    tok = out / "tok"
    mtrain(code, "tokenize", "--data", str(corpus), "--src", "de", "--tgt", "en", "--out", str(tok), "--vocab-size", "1000")
    found = {"spm": digest(tok / "spm.model")}
    for amp in ("off", "auto"):
        run_dir = out / f"run-{amp}"
        mtrain(code, "train", "--data", str(tok), "--out", str(run_dir), "--device", "cpu",
               *[arg for setting in TRAIN + [f"train.amp={amp}"] for arg in ("--set", setting)])
        found[f"train_{amp}_weights"] = weights_digest(run_dir / "last.pt", code)
        losses = [r.get("loss") for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
        found[f"train_{amp}_losses"] = hashlib.sha256(json.dumps(losses).encode()).hexdigest()[:16]
    model = out / "run-off" / "last.pt"
    for name, args in SEARCHES.items():
        hyp = out / f"{name}.hyp"
        mtrain(code, "translate", "--checkpoint", str(model), "--input", str(corpus / "test2016.de"),
               "--output", str(hyp), "--device", "cpu", *args)
        found[name] = digest(hyp)
    scores = out / "score.txt"
    done = subprocess.run([sys.executable, "-m", "mtrain", "score", "--checkpoint", str(model), "--src",
                           str(corpus / "test2016.de"), "--tgt", str(corpus / "test2016.en"), "--device", "cpu"],
                          env=environment(code), capture_output=True, text=True, check=True)
    scores.write_text(done.stdout, encoding="utf-8")
    found["score"] = digest(scores)
    (out / "fingerprint.json").write_text(json.dumps(found, indent=1) + "\n")
    return found


def compare(a: Path, b: Path) -> dict[str, str]:
    first, second = (json.loads((d / "fingerprint.json").read_text()) for d in (a, b))
    report = {}
    for key, value in first.items():
        if value == second.get(key):
            report[key] = "identical"
        elif (a / f"{key}.hyp").exists():
            x, y = ((d / f"{key}.hyp").read_text(encoding="utf-8").splitlines() for d in (a, b))
            same = sum(p == q for p, q in zip(x, y))
            report[key] = f"differs: {same}/{max(len(x), len(y))} lines identical"
        else:
            report[key] = "differs"
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="the repository whose mtrain runs")
    parser.add_argument("--out", type=Path, help="a new folder for the outputs")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare(*args.compare), indent=1))
    elif args.out:
        print(json.dumps(run(args.code.resolve(), args.out.resolve()), indent=1))
    else:
        parser.error("give --out DIR or --compare DIR_A DIR_B")


if __name__ == "__main__":
    main()
