"""Raw parallel text: reading (text pairs, TSV, JSONL, Hugging Face `datasets`) with the checks
that must pass before any work, and cleaning of the training split. No torch, no SentencePiece."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from mtrain.config import Config
from mtrain.errors import MtrainError

DEFAULT_DATA_DIR = Path("data/multi30k")
DEFAULT_HF_DATASET = "bentrevett/multi30k"
# Hugging Face split names for mtrain's split names (bentrevett/multi30k: train/validation/test).
HF_SPLIT_ALIASES = {"valid": ("validation", "dev", "val"), "test2016": ("test",), "test": ("test2016",)}
DROP_RULES = ("empty_side", "too_long", "length_ratio", "duplicate")
# Characters per whitespace token beyond which a side counts as too long: far above real words
# (German compounds reach ~40), so it only drops text that has no spaces to split.
MAX_CHARS_PER_TOKEN = 64

Pairs = tuple[list[str], list[str]]


# ----------------------------------------------------------------------------------------------
# Reading, with the checks that must pass before any work
# ----------------------------------------------------------------------------------------------
def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (or .gz), without a BOM, line ends or CR; invalid UTF-8 is a one-line error.

    Lines are split on "\\n" only: str.splitlines() would also split on U+2028, U+0085 and friends,
    which occur inside real sentences and would break the line alignment of the two sides.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise MtrainError(f"{path}: file not found; check the path") from None
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise MtrainError(f"{path}: cannot read ({err}); check that the file is intact") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise MtrainError(
            f"{path}:{line}: invalid UTF-8 (byte 0x{raw[err.start]:02x}); re-encode the file as UTF-8, "
            f"e.g. iconv -f latin1 -t utf-8"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _existing(path: Path) -> Optional[Path]:
    """path or path.gz, whichever exists."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def read_text_pair(src_path: Path, tgt_path: Path) -> Pairs:
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise MtrainError(
            f"{tgt_path}:{min(len(src_lines), len(tgt_lines)) + 1}: {_lines(len(tgt_lines))}, but {src_path} has "
            f"{_lines(len(src_lines))}; line i of each side must translate line i of the other, so fix the alignment"
        )
    return src_lines, tgt_lines


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def read_tsv(path: Path, src: str, tgt: str) -> Pairs:
    """Two TAB-separated columns, src then tgt; a header row `src<TAB>tgt` (the language codes) is skipped."""
    src_lines, tgt_lines = [], []
    for number, line in enumerate(read_lines(path), start=1):
        columns = line.split("\t")
        if len(columns) != 2:
            raise MtrainError(
                f"{path}:{number}: expected 2 TAB-separated columns ({src}<TAB>{tgt}), found {len(columns)}; "
                "remove or escape the extra TABs"
            )
        if number == 1 and (columns[0].strip(), columns[1].strip()) == (src, tgt):
            continue
        src_lines.append(columns[0])
        tgt_lines.append(columns[1])
    return src_lines, tgt_lines


def _pair_from_row(row: Any, src: str, tgt: str) -> Optional[tuple[str, str]]:
    """{"de": ..., "en": ...} or {"translation": {"de": ..., "en": ...}} -> (src, tgt), else None."""
    if isinstance(row, dict) and isinstance(row.get("translation"), dict):
        row = row["translation"]
    if isinstance(row, dict) and isinstance(row.get(src), str) and isinstance(row.get(tgt), str):
        return row[src], row[tgt]
    return None


def read_jsonl(path: Path, src: str, tgt: str) -> Pairs:
    src_lines, tgt_lines = [], []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue  # each object is self-contained, so a blank line cannot shift the alignment
        try:
            pair = _pair_from_row(json.loads(line), src, tgt)
        except json.JSONDecodeError as err:
            raise MtrainError(f"{path}:{number}: invalid JSON ({err.msg}); write one JSON object per line") from None
        if pair is None:
            raise MtrainError(
                f"{path}:{number}: expected an object with string fields {src!r} and {tgt!r} "
                f"(or {{\"translation\": {{...}}}}); check --src/--tgt or the file"
            )
        src_lines.append(pair[0])
        tgt_lines.append(pair[1])
    return src_lines, tgt_lines


def read_split(data_dir: Path, split: str, src: str, tgt: str) -> Pairs:
    """One split from DIR/{split}.{src}+{split}.{tgt}, else DIR/{split}.tsv, else DIR/{split}.jsonl (.gz allowed)."""
    src_path, tgt_path = _existing(data_dir / f"{split}.{src}"), _existing(data_dir / f"{split}.{tgt}")
    if src_path and tgt_path:
        return read_text_pair(src_path, tgt_path)
    if src_path or tgt_path:
        missing = data_dir / f"{split}.{tgt if src_path else src}"
        present = src_path or tgt_path
        raise MtrainError(f"{missing}: file not found (but {present} exists); add the other side of the {split} split")
    if tsv := _existing(data_dir / f"{split}.tsv"):
        return read_tsv(tsv, src, tgt)
    if jsonl := _existing(data_dir / f"{split}.jsonl"):
        return read_jsonl(jsonl, src, tgt)
    raise MtrainError(
        f"{data_dir / f'{split}.{src}'}: file not found; put {split}.{src} + {split}.{tgt} "
        f"(or {split}.tsv / {split}.jsonl) in {data_dir}, or choose splits with --splits"
    )


def read_hf_dataset(name: str, splits: Sequence[str], src: str, tgt: str) -> dict[str, Pairs]:
    """Read splits through Hugging Face `datasets` (downloads on first use; needs internet)."""
    try:
        import datasets

        dataset = datasets.load_dataset(name)
    except Exception as err:  # network, auth, unknown name: all one line for the user
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MtrainError(
            f"--hf-dataset {name}: could not load it ({first}); check the name and your internet connection, "
            f"or copy the files to a folder and pass --data"
        ) from None
    result = {}
    for split in splits:
        hf_split = next((s for s in (split, *HF_SPLIT_ALIASES.get(split, ())) if s in dataset), None)
        if hf_split is None:
            raise MtrainError(
                f"--hf-dataset {name}: no split {split!r} (it has {', '.join(dataset)}); choose splits with --splits"
            )
        src_lines, tgt_lines = [], []
        for number, row in enumerate(dataset[hf_split], start=1):
            pair = _pair_from_row(row, src, tgt)
            if pair is None:
                raise MtrainError(
                    f"--hf-dataset {name} [{hf_split}] row {number}: no string fields {src!r} and {tgt!r} "
                    f"(columns: {', '.join(row)}); check --src/--tgt"
                )
            src_lines.append(pair[0])
            tgt_lines.append(pair[1])
        result[split] = (src_lines, tgt_lines)
    return result


def read_corpus(
    data_dir: Optional[Path], splits: Sequence[str], src: str, tgt: str, hf_dataset: Optional[str] = None
) -> tuple[dict[str, Pairs], str]:
    """Every split, fully checked, before any work starts. Returns (splits, a description of the source)."""
    if hf_dataset and data_dir is not None:
        raise MtrainError(f"--data {data_dir} and --hf-dataset {hf_dataset}: pass only one of them")
    if hf_dataset:
        return read_hf_dataset(hf_dataset, splits, src, tgt), f"hf:{hf_dataset}"
    if data_dir is None:
        data_dir = DEFAULT_DATA_DIR
        if not data_dir.is_dir():
            raise MtrainError(
                f"{data_dir}: not found and no --data given; copy Multi30k's {{train,valid,test2016}}.{{{src},{tgt}}} "
                f"files to {data_dir}/ or pass --hf-dataset {DEFAULT_HF_DATASET} (needs internet)"
            )
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise MtrainError(f"{data_dir}: folder not found; pass --data with the folder holding the corpus files")
    return {split: read_split(data_dir, split, src, tgt) for split in splits}, str(data_dir)


# ----------------------------------------------------------------------------------------------
# Cleaning (training split only)
# ----------------------------------------------------------------------------------------------
def clean_pairs(src_lines: list[str], tgt_lines: list[str], max_len: int, max_ratio: float, dedup: bool = True):
    """Drop training pairs by the first rule they break, in DROP_RULES order; lengths are whitespace
    tokens. too_long also catches a side of more than MAX_CHARS_PER_TOKEN * max_len characters: text
    without spaces (a run-on line, CJK, a base64 blob) is one "token" however long it is.

    Returns (kept src, kept tgt, {rule: number dropped}).
    """
    max_chars = MAX_CHARS_PER_TOKEN * max_len
    dropped = dict.fromkeys(DROP_RULES, 0)
    seen: set[tuple[str, str]] = set()
    kept_src, kept_tgt = [], []
    for s, t in zip(src_lines, tgt_lines):
        n_src, n_tgt = len(s.split()), len(t.split())
        if n_src == 0 or n_tgt == 0:
            rule = "empty_side"
        elif n_src > max_len or n_tgt > max_len or max(len(s), len(t)) > max_chars:
            rule = "too_long"
        elif max(n_src, n_tgt) > max_ratio * min(n_src, n_tgt):
            rule = "length_ratio"
        elif dedup and (s, t) in seen:
            rule = "duplicate"
        else:
            seen.add((s, t))
            kept_src.append(s)
            kept_tgt.append(t)
            continue
        dropped[rule] += 1
    return kept_src, kept_tgt, dropped


def cleaning_report(split: str, n_in: int, n_kept: int, dropped: dict[str, int], cfg: Config) -> str:
    rules = {
        "empty_side": "empty side",
        "too_long": f"longer than {cfg.data.max_len} tokens",
        "length_ratio": f"length ratio > {cfg.data.max_ratio:g}",
        "duplicate": "exact duplicate",
    }
    parts = ", ".join(f"{label} {dropped[rule]}" for rule, label in rules.items())
    return f"cleaned {split}: {n_in} pairs -> {n_kept} kept, {n_in - n_kept} dropped ({parts})"
