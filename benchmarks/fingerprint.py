"""A behaviour fingerprint: proof that a change to mtrain's code (a refactor, a move of modules)
changed nothing a user sees, or exactly what it changed.

    python benchmarks/fingerprint.py --out DIR [--code PATH]    # run the pipeline with the code at PATH
    python benchmarks/fingerprint.py --compare DIR_A DIR_B      # what differs between two runs

Typical use: fingerprint the commit before the change from a pristine worktree, then the changed
code, and compare:

    git worktree add /tmp/base HEAD --detach
    python benchmarks/fingerprint.py --code /tmp/base --out /tmp/fp-before
    python benchmarks/fingerprint.py --out /tmp/fp-after
    python benchmarks/fingerprint.py --compare /tmp/fp-before /tmp/fp-after

--out runs `python -m mtrain` (PYTHONPATH=PATH, default: the repository holding this script) on a
slice of data/multi30k (3000 training pairs, 100 valid and 100 test2016 lines, copied to DIR/corpus),
CPU only, one thread, fixed seeds, MKL's AMD stub off:
  tokenize     vocabulary of 1000: the SentencePiece model, id caches and stats (paths blanked)
  train        a 2+2-layer d_model 128 model, 300 updates, validation at the end: once in float32
               (train.amp=off) and once in bfloat16 (train.amp=bf16, where the CPU multiplies it
               natively); the weights (tensor by tensor, in name order) and the logged metrics (times left out)
  translate    test2016 with the float32 model: greedy, beam 5, beam 3 n-best 2, sampling, and greedy
               and beam 5 with decode.amp=bf16 and with decode.quantize=int8 (files kept as DIR/NAME.hyp)
  score        log-probabilities of the 100 test pairs
  export       ctranslate2 and huggingface: the weight file, the other files (paths blanked) and the
               parity report's numbers (checked on the test pairs)
  eval         BLEU and chrF of every 1-best translation file
It prints one JSON object (also DIR/fingerprint.json); logs of each command go to DIR/logs/.
--compare says, item by item, identical or not, and for translations the share of identical lines
and each side's BLEU. Two runs of the same code on one host give the same digests; other CPU kinds
may round differently, so compare runs made on the same machine."""

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
SPLITS = {"train": 3000, "valid": 100, "test2016": 100}
THREADS = "1"
TRAIN = ["model.d_model=128", "model.d_ff=512", "model.n_heads=4", "model.n_encoder_layers=2",
         "model.n_decoder_layers=2", "train.max_steps=300", "train.warmup_steps=100", "train.lr_scale=0.7",
         "train.max_tokens=1024", "train.eval_every=300", "train.save_every=300", "train.log_every=25",
         "train.seed=1", f"train.num_threads={THREADS}"]
PRECISIONS = {"fp32": "off", "bf16": "bf16"}  # name -> train.amp
SEARCHES = {"greedy": ["--greedy"], "beam5": ["--beam", "5"], "nbest": ["--beam", "3", "--nbest", "2"],
            "sample": ["--sample", "--topk", "5", "--seed", "3", "--nbest", "2"],
            "bf16_greedy": ["--greedy", "--set", "decode.amp=bf16"],
            "bf16_beam5": ["--beam", "5", "--set", "decode.amp=bf16"],
            "int8_greedy": ["--greedy", "--set", "decode.quantize=int8"],
            "int8_beam5": ["--beam", "5", "--set", "decode.quantize=int8"]}
EXPORTS = {"ctranslate2": "model.bin", "huggingface": "model.safetensors"}  # format -> weight file
TIME_KEYS = {"tokens_per_s", "elapsed_s", "valid_s", "run_dir"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def files_digest(paths: list[Path], root: Path, out: Path) -> str:
    """One digest of files (names relative to root, in order), with the output folder's path
    blanked so that two output folders can agree."""
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes().replace(str(out).encode(), b"DIR") + b"\0")
    return h.hexdigest()[:16]


def weights_digest(checkpoint: Path) -> str:
    """The model's tensors (name, dtype, shape, bytes) in name order; not the file, whose pickle
    also holds paths and times."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def native_bf16() -> bool:
    """What train.amp=auto asks on an x86 CPU: AMX or AVX512-BF16."""
    import torch

    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


class Runner:
    """Runs `python -m mtrain` with the code at `code`, its stderr logged to out/logs/NAME.log."""

    def __init__(self, code: Path, out: Path):
        self.code, self.logs = code, out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=THREADS, MKL_NUM_THREADS=THREADS,
                        MTRAIN_MKL_INTEL_PATH="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        where = self.python("import mtrain; print(mtrain.__file__)", "which").strip()
        if not Path(where).resolve().is_relative_to(code):
            sys.exit(f"mtrain resolves to {where}, not to {code}")

    def python(self, script: str, name: str, *args: str) -> str:
        log(f"[{name}] {' '.join(args)}"[:160])
        done = subprocess.run([sys.executable, *(("-c", script) if script else ()), *args], cwd=self.code,
                              env=self.env, capture_output=True, text=True)
        (self.logs / f"{name}.log").write_text(done.stderr, encoding="utf-8")
        if done.returncode:
            sys.exit(f"{name} failed ({' '.join(args)}):\n{done.stderr[-3000:]}")
        return done.stdout

    def mtrain(self, name: str, *args: str) -> str:
        return self.python("", name, "-m", "mtrain", *args)


def slice_corpus(out: Path) -> Path:
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for split, n in SPLITS.items():
        for lang in ("de", "en"):
            lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:n]
            (corpus / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus


def run(code: Path, out: Path) -> dict:
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out} is not empty")
    mtrain = Runner(code, out).mtrain
    corpus, tok, found = slice_corpus(out), out / "tok", {}
    src, ref = str(corpus / "test2016.de"), str(corpus / "test2016.en")

    mtrain("tokenize", "tokenize", "--data", str(corpus), "--src", "de", "--tgt", "en", "--out", str(tok),
           "--vocab-size", "1000")
    found["tokenize_spm"] = files_digest(list(tok.glob("*.model")), tok, out)
    found["tokenize_ids"] = files_digest(list(tok.glob("*.npy")) + list(tok.glob("*.txt")), tok, out)
    found["tokenize_stats"] = files_digest(list(tok.glob("*.json")), tok, out)

    for name, amp in PRECISIONS.items():
        if amp == "bf16" and not native_bf16():
            found[f"train_{name}"] = "skipped: no native bfloat16 on this CPU"
            continue
        run_dir = out / f"run-{name}"
        settings = [arg for setting in TRAIN + [f"train.amp={amp}"] for arg in ("--set", setting)]
        mtrain(f"train-{name}", "train", "--data", str(tok), "--out", str(run_dir), "--device", "cpu", *settings)
        found[f"train_{name}_weights"] = weights_digest(run_dir / "last.pt")
        metrics = [{k: v for k, v in json.loads(line).items() if k not in TIME_KEYS}
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        found[f"train_{name}_metrics"] = sha(json.dumps(metrics, sort_keys=True).encode())
        found[f"train_{name}_final_loss"] = next(m["loss"] for m in reversed(metrics) if m.get("event") == "train")
    model = str(out / "run-fp32" / "last.pt")

    for name, args in SEARCHES.items():
        hyp = out / f"{name}.hyp"
        mtrain(f"translate-{name}", "translate", "--checkpoint", model, "--input", src, "--output", str(hyp),
               "--device", "cpu", *args)
        found[f"translate_{name}"] = sha(hyp.read_bytes())

    scores = out / "score.txt"
    scores.write_text(mtrain("score", "score", "--checkpoint", model, "--src", src, "--tgt", ref, "--device", "cpu"))
    found["score"] = sha(scores.read_bytes())

    for fmt, weights in EXPORTS.items():
        folder = out / f"export-{fmt}"
        report = json.loads(mtrain(f"export-{fmt}", "export", "--checkpoint", model, "--format", fmt, "--out",
                                   str(folder), "--check", src, "--check-ref", ref, "--json"))
        found[f"export_{fmt}_weights"] = sha((folder / weights).read_bytes())
        found[f"export_{fmt}_files"] = files_digest([p for p in folder.iterdir() if p.name != weights], folder, out)
        found[f"export_{fmt}_parity"] = {k: report[k] for k in ("max_logprob_diff", "greedy_identical",
                                                                 "bleu_mtrain", "bleu_export", "passed")}

    for name in SEARCHES:
        if "--nbest" not in SEARCHES[name]:
            scored = json.loads(mtrain(f"eval-{name}", "eval", "--hyp", str(out / f"{name}.hyp"), "--ref", ref, "--json"))
            found[f"eval_{name}"] = {"bleu": round(scored["bleu"], 4), "chrf": round(scored["chrf"], 4)}
    (out / "fingerprint.json").write_text(json.dumps(found, indent=1) + "\n")
    return found


def first_best(lines: list[str]) -> list[str]:
    """The translations of a file; of an n-best file (input index<TAB>score<TAB>text), the first of each input."""
    if lines and lines[0].count("\t") == 2:
        best = {}
        for line in lines:
            index, _, text = line.split("\t", 2)
            best.setdefault(index, text)
        return list(best.values())
    return lines


def bleu(hyps: list[str], ref: Path) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hyps, [ref.read_text(encoding="utf-8").splitlines()]).score, 2)


def compare(a: Path, b: Path) -> dict:
    first, second = (json.loads((d / "fingerprint.json").read_text()) for d in (a, b))
    report = {}
    for key in dict.fromkeys([*first, *second]):
        x, y = first.get(key), second.get(key)
        name = key.removeprefix("translate_")
        if x == y:
            report[key] = "identical"
        elif key.startswith("translate_") and (a / f"{name}.hyp").exists() and (b / f"{name}.hyp").exists():
            p, q = ((d / f"{name}.hyp").read_text(encoding="utf-8").splitlines() for d in (a, b))
            same = sum(s == t for s, t in zip(p, q))
            report[key] = (f"differs: {same}/{max(len(p), len(q))} lines identical ({same / max(len(p), len(q), 1):.1%}), "
                           f"BLEU {bleu(first_best(p), a / 'corpus/test2016.en')} vs "
                           f"{bleu(first_best(q), b / 'corpus/test2016.en')}")
        else:
            report[key] = f"differs: {x} vs {y}"
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="the repository whose mtrain runs (default: this one)")
    parser.add_argument("--out", type=Path, help="a new (or empty) folder for the outputs")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"), help="compare two --out folders")
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare(*args.compare), indent=1))
    elif args.out:
        print(json.dumps(run(args.code.resolve(), args.out.resolve()), indent=1))
    else:
        parser.error("give --out DIR or --compare DIR_A DIR_B")


if __name__ == "__main__":
    main()
