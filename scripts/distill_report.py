"""Teacher and student on one test set, in one run on one machine: cased sacreBLEU, chrF,
sentences/s and size on disk of the single teacher (mtrain, beam 5), the teacher ensemble (when
several teachers are given), the student (mtrain, greedy and beam 5) and the student's CTranslate2
int8 export (greedy). Systems take turns chunk by chunk, so load from other processes falls on
all of them alike. Writes --out (JSON) and the same table as Markdown beside it, and with
--hyp-dir each system's translations (<system>.hyp) for scoring with other metrics.

    python scripts/distill_report.py --teacher A.pt [B.pt] --student S.pt --student-export DIR \
        --src test2016.de --ref test2016.en --out results.json [--hyp-dir DIR] [--threads T]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mtrain.atomic import atomic_write  # noqa: E402
from mtrain.config import DecodeConfig  # noqa: E402
from mtrain.evaluate import read_stripped_lines  # noqa: E402
from mtrain.hardware import machine_record  # noqa: E402
from mtrain.translate import load_for_decoding, translate_lines  # noqa: E402

CHUNK = 100


def size_on_disk(paths: list[Path]) -> int:
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return sum(f.stat().st_size for f in files)


def systems(args) -> dict[str, tuple[list[Path], int]]:
    """name -> (model paths, beam)."""
    found = {"teacher_beam5": ([args.teacher[0]], 5)}
    if len(args.teacher) > 1:
        found[f"teacher_ensemble{len(args.teacher)}_beam5"] = (list(args.teacher), 5)
    found["student_greedy"] = ([args.student], 1)
    found["student_beam5"] = ([args.student], 5)
    found["student_ct2_int8_greedy"] = ([args.student_export], 1)
    return found


def run(args) -> dict:
    import sacrebleu

    sources, refs = read_stripped_lines(args.src), read_stripped_lines(args.ref)
    if len(sources) != len(refs):
        sys.exit(f"error: {args.ref}: {len(refs)} lines for {len(sources)} sources in {args.src}")
    loaded, outputs, seconds = {}, {}, {}
    for name, (paths, beam) in systems(args).items():
        model, tokenizer, ckpt = load_for_decoding(paths if len(paths) > 1 else paths[0], torch.device("cpu"))
        decode = dataclasses.replace(DecodeConfig(**{**ckpt.get("config", {}).get("decode", {})}), beam=beam, nbest=1)
        if name.startswith("student_ct2"):  # the export decodes with the student's own settings
            decode = dataclasses.replace(loaded["student_greedy"][2], beam=1)
        loaded[name] = (model, tokenizer, decode, ckpt.get("stats") or None)
        translate_lines(model, tokenizer, sources[:8], decode, "cpu", ckpt.get("stats") or None)  # warm-up
        outputs[name], seconds[name] = [], 0.0
    for start in range(0, len(sources), CHUNK):
        for name, (model, tokenizer, decode, stats) in loaded.items():
            begin = time.perf_counter()
            outputs[name] += translate_lines(model, tokenizer, sources[start : start + CHUNK], decode, "cpu", stats)
            seconds[name] += time.perf_counter() - begin
    if args.hyp_dir:
        args.hyp_dir.mkdir(parents=True, exist_ok=True)
        for name, lines in outputs.items():
            with atomic_write(args.hyp_dir / f"{name}.hyp") as handle:
                handle.writelines(line + "\n" for line in lines)
    rows = {}
    for name, (paths, beam) in systems(args).items():
        rows[name] = {
            "bleu": round(sacrebleu.corpus_bleu(outputs[name], [refs]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(outputs[name], [refs]).score, 2),
            "sent_s": round(len(sources) / seconds[name], 2),
            "size_mb": round(size_on_disk(paths) / 1e6, 1),
            "beam": beam,
        }
    teacher = rows["teacher_beam5"]
    for row in rows.values():
        row["speedup_vs_teacher_beam5"] = round(row["sent_s"] / teacher["sent_s"], 2)
        row["bleu_vs_teacher_beam5"] = round(row["bleu"] - teacher["bleu"], 2)
    return {"sentences": len(sources), "test_src": str(args.src), "threads": torch.get_num_threads(),
            "hardware": machine_record(), "rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def markdown(result: dict) -> str:
    lines = ["| system | BLEU | chrF | sentences/s | × teacher speed | size (MB) |", "|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['bleu']:.2f} | {row['chrf']:.2f} | {row['sent_s']:.1f} | "
                     f"{row['speedup_vs_teacher_beam5']:.2f} | {row['size_mb']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, nargs="+", required=True)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--student-export", type=Path, required=True)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--ref", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hyp-dir", type=Path, help="write each system's translations to DIR/<system>.hyp")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    with atomic_write(args.out) as handle:
        handle.write(json.dumps(result, indent=1) + "\n")
    with atomic_write(args.out.with_suffix(".md")) as handle:
        handle.write(markdown(result))
    print(markdown(result), end="")
    print(f"({result['sentences']} sentences, {result['threads']} threads, {platform.processor() or platform.machine()})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
