"""Typed configuration: frozen dataclasses hold every default; YAML files and `--set` overrides
state differences. No torch here, so the CLI can print a config instantly."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import re
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from mtrain.errors import MtrainError
from mtrain.schedule import parse_duration


@dataclass(frozen=True)
class ModelConfig:
    """The Transformer's shape. Defaults are the paper's base model (Vaswani et al. 2017, Table 3)."""

    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1  # on sublayer outputs and on embeddings + positions
    attention_dropout: float = 0.0  # on attention weights (the paper uses none)
    # on the FFN's hidden ReLU output. Negative = the same rate as dropout (tensor2tensor's relu_dropout),
    # the setting every Multi30k recipe here was tuned and scored with; 0 = none, as in the paper and
    # fairseq's default (at the tiny-anchor shape it learned the same within noise: docs/results/NOTES.md).
    activation_dropout: float = -1.0
    vocab_size: int = 8000  # target vocabulary (the joint one when share_embeddings); set by tokenize
    src_vocab_size: int = 0  # 0 = same as vocab_size (joint vocabulary)
    pad_id: int = 0  # fixed by mtrain's SentencePiece training
    max_len: int = 256  # longest sequence the positional table covers
    share_embeddings: bool = True  # three-way tying with a joint vocabulary
    # The FFN's nonlinearity: relu (the paper) or swish (x * sigmoid(x), as Marian's OPUS-MT models
    # use; mtrain import sets it for them).
    activation: str = "relu"
    # A bias on the output projection (the paper has none; imported Marian models carry
    # final_logits_bias).
    output_bias: bool = False


@dataclass(frozen=True)
class TokenizerConfig:
    """SentencePiece training options for `mtrain tokenize`."""

    vocab_size: int = 8000
    model_type: str = "unigram"  # unigram | bpe
    joint: bool = True  # one vocabulary for both sides, so embeddings can be shared
    character_coverage: float = 1.0  # 1.0 keeps every character of small European corpora
    # Sentences SentencePiece trains on: a seeded uniform sample of the cleaned training pairs (both
    # sides count with a joint vocabulary), 0 = all of them. tokenize's peak memory grows with this,
    # not with the corpus: ~1.6 GB at 500k sentences of ~140 characters, ~3 GB at 1M (docs/benchmarks.md, "Corpus scale").
    input_sentence_size: int = 500_000
    seed: int = 1


@dataclass(frozen=True)
class DataConfig:
    """Where the corpus is and how the training split is cleaned."""

    src: str = "de"
    tgt: str = "en"
    train_split: str = "train"
    valid_split: str = "valid"
    test_split: str = "test2016"
    max_len: int = 250  # drop training pairs with a side longer than this (whitespace tokens)
    max_ratio: float = 3.0  # drop training pairs whose length ratio exceeds this
    dedup: bool = True  # drop duplicate (src, tgt) training pairs, across corpora, after normalization
    # Drop training pairs whose source line occurs in an evaluation split (after the same
    # normalization); the overlap is counted in stats.json either way.
    drop_overlap: bool = False
    # Per-corpus share of each training epoch, NAME=WEIGHT for every corpus of the tokenized folder
    # (a YAML mapping, a list or comma-separated text); empty = every pair once an epoch.
    weights: tuple[str, ...] = ()
    # Corpora whose source lines start with a reserved token <NAME> (e.g. back-translated data);
    # set when tokenizing. The token is a SentencePiece control symbol: no text encodes to it.
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: batching, optimisation, validation and checkpointing."""

    max_steps: int = 100_000  # optimizer updates
    # Tokens per batch (padding included), per side. auto: on a GPU, a start-up probe (forward,
    # backward and step on the longest sentences) picks the largest budget that fits in its memory
    # with a margin, and a resumed run keeps the value its last.pt was trained with; on a CPU,
    # memory is not what limits a batch, so auto means the default, 4096.
    max_tokens: int | str = 4096
    update_freq: int = 1  # batches accumulated per update
    warmup_steps: int = 4000
    lr_scale: float = 1.0  # lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    cooldown_steps: int = 0  # > 0: over the last cooldown_steps updates before max_steps, lr falls linearly to ~0
    # A training-time budget, e.g. 2h, 45m, 1h30m ('' = none): the run stops once it has trained this
    # long (validation included, over every resumed invocation; start-up and saving not counted),
    # with the lr falling linearly to 0 over the last cooldown_fraction of it, then validates and
    # averages as at max_steps. max_steps still caps the updates.
    max_time: str = ""
    # With max_time: the share of the budget the lr cooldown takes (a third, the step-count
    # recipes' cooldown share, which measured ~1 valid BLEU over no cooldown).
    cooldown_fraction: float = 0.33
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    # > 0: every epoch re-segments the training text by SentencePiece sampling, a pure function of
    # (seed, epoch) so resume stays exact. Unigram models: the smoothing alpha of subword
    # regularization (Kudo 2018; smaller = more varied and longer, 0.1 doubles the pieces per line);
    # bpe models: the BPE-dropout rate (Provilkov et al. 2020). 0 = the cached deterministic ids.
    sampling_alpha: float = 0.0
    # > 0: R-Drop (Liang et al. 2021). Each batch runs through the model twice with independent
    # dropout masks, and the loss adds rdrop_alpha times the symmetric KL divergence between the two
    # output distributions, which pulls the dropout sub-models together: a regulariser for small
    # data. An update then costs two forward/backward passes of its batch (halve max_tokens to
    # keep the cost of an update). 0 = off. The paper used 5 for translation.
    rdrop_alpha: float = 0.0
    clip_norm: float = 0.0  # 0 = no gradient clipping
    seed: int = 1
    log_every: int = 100
    save_every: int = 1000
    eval_every: int = 1000
    eval_beam: int = 1  # beam size for validation BLEU (1 = greedy, fast on CPU)
    eval_max_sentences: int = 0  # 0 = the whole validation split
    keep_last: int = 5  # step checkpoints kept besides last.pt and best.pt
    keep_every: int = 0  # > 0: also keep every step-N.pt with N % keep_every == 0 (a BLEU-vs-time curve later)
    average_last: int = 0  # > 0: average the last K step checkpoints into averaged.pt at the end
    patience: int = 0  # stop after this many validations without a BLEU gain; 0 = never
    max_nonfinite: int = 10  # consecutive non-finite losses before training stops
    # auto | bf16 | fp16 | off. auto: bfloat16 autocast (float32 weights) where the hardware
    # multiplies bf16 natively: CPUs with AMX or AVX512-BF16 and GPUs that support it; float16 on
    # older GPUs; float32 on other CPUs. off: always float32.
    amp: str = "auto"
    compile: bool = False  # torch.compile the model
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    # Where else the metrics go besides RUN/metrics.jsonl: tensorboard (RUN/tensorboard/) and/or
    # wandb (Weights & Biases; WANDB_MODE=offline works without an account). Empty = nowhere else.
    log_to: tuple[str, ...] = ()


@dataclass(frozen=True)
class DecodeConfig:
    """Search settings for `mtrain translate`, `mtrain eval` and validation."""

    beam: int = 5
    lenpen: float = 0.6  # GNMT length penalty alpha: ((5 + len) / 6) ** alpha
    max_len_a: float = 1.2  # maximum output length = a * src_len + b
    max_len_b: int = 10
    max_tokens: int = 4096  # source tokens per decoding batch
    nbest: int = 1  # hypotheses per input (with sample: independent samples)
    sample: bool = False  # draw each token from the model's distribution instead of searching
    topk: int = 0  # sampling: only the k most probable tokens (0 = no limit)
    topp: float = 1.0  # sampling: the fewest most probable tokens whose probability reaches p (nucleus)
    temperature: float = 1.0  # sampling: divide the logits by this (< 1 sharper, > 1 flatter)
    seed: int = 0  # sampling: the same seed gives the same samples, however inputs are batched
    no_repeat_ngram: int = 0  # > 0: never produce an n-gram of this size twice in one output
    # off | bf16 | auto (as train.amp): decode with the weights cast to bfloat16 where the hardware
    # multiplies it natively (mtrain.cpu.quantize.bfloat16_weights). Off by default: outputs differ from
    # float32's on a share of lines (benchmarks/results/intel-xeon-amx/NOTES.md). Validation inside training decodes in the
    # training's precision either way.
    amp: str = "off"
    # off | int8: decode on a CPU with every linear layer in int8 (weights per output row, activations
    # quantized on the fly; mtrain.cpu.quantize). 1.7-3x float32's speed at decoding's batch sizes; changes
    # a share of lines (benchmarks/results/amd-epyc-zen4/NOTES.md), so off by default. Not with amp, not on a GPU.
    quantize: str = "off"
    # Processes that decode batches side by side on a CPU, the threads shared among them
    # (mtrain.cpu.workers), with the same translations: on 2 cores, bfloat16 decoding of 12000 lines
    # ran 1.06-1.12x (greedy) and 1.15-1.17x (beam 5) as fast with 2 (benchmarks/results/intel-xeon-amx/NOTES.md). Each
    # holds a copy of the model (the calling process keeps only the tokenizer and config) and
    # takes about a second to start; 1 decodes in the calling process.
    workers: int = 1


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


# Section name -> its dataclass (get_type_hints resolves the string annotations).
SECTIONS: dict[str, type] = typing.get_type_hints(Config)


class _Loader(yaml.SafeLoader):
    """YAML with the 1.2 booleans only (true/false). YAML 1.1, PyYAML's default, also reads
    on/off/yes/no as booleans, so `amp: off` became False and `src: no` (Norwegian) too.
    Boolean fields still accept yes/no/on/off: _coerce reads them from the string."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _as_text_on_failure(construct: Any) -> Any:
    """A scalar PyYAML recognizes but cannot build (an integer of over 4300 digits, the date
    2024-13-45, `!!int 12x`, `!!bool maybe`) stays text, so the key's type check names it."""
    def lenient(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        try:
            return construct(loader, node)
        except (ValueError, KeyError):
            return loader.construct_scalar(node)
    return lenient


for _tag in ("int", "float", "bool", "timestamp"):
    _Loader.add_constructor(f"tag:yaml.org,2002:{_tag}",
                            _as_text_on_failure(yaml.SafeLoader.yaml_constructors[f"tag:yaml.org,2002:{_tag}"]))


def _yaml(text: str, where: str) -> Any:
    """Parsed YAML; what PyYAML cannot read is a one-line error naming `where` (and the line of a
    text of several lines)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None and "\n" in text.rstrip("\n") else ""
        raise MtrainError(f"{where}{line}: invalid YAML ({_first_line(err)}); fix the syntax "
                          "(quote text that YAML reads as syntax)") from None
    except RecursionError:  # PyYAML composes nested lists and mappings recursively
        raise MtrainError(f"{where}: invalid YAML (nested too deeply); a config holds sections of key: value") from None


def _first_line(err: yaml.YAMLError) -> str:
    # PyYAML's messages go on with lines pointing into the text.
    problem = getattr(err, "problem", None) or str(err)
    return (problem.strip().splitlines() or [type(err).__name__])[0]


_REPR = reprlib.Repr()  # a value in a message: bounded for huge, nested or self-containing YAML values
_REPR.maxstring = _REPR.maxother = 60


def _show(value: Any) -> str:
    try:
        return _REPR.repr(value)
    except ValueError:  # an int of over 4300 digits, which Python refuses to print
        return "an integer too long to print"


def _quoted(text: str) -> str:
    """Text for a one-line message: as typed, or escaped when it holds line breaks or controls;
    a long one keeps its start and end."""
    text = text if len(text) <= 100 else f"{text[:70]}...{text[-20:]}"
    return text if text.isprintable() else repr(text)


SCALARS = (str, int, float, datetime.date)  # what YAML values may convert to a field's type
INT_OR_AUTO = int | str  # the type of keys that take an integer or the word auto (train.max_tokens)
INT_BOUND = 2**63  # integers fit int64: torch and numpy take no larger


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML or command-line value to the declared field type (YAML reads 3e-4 as a string).
    Only scalars convert: a list or mapping where one value belongs is an error, never its text."""
    if tp == tuple[str, ...]:
        return _coerce_names(value, where)
    if tp == INT_OR_AUTO:
        return _coerce_int_or_auto(value, where)
    if not isinstance(value, SCALARS):
        kind = {bool: "true/false", int: "an integer", float: "a number"}.get(tp, "text")
        raise MtrainError(f"{where}: expected {kind}, got {_show(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise MtrainError(f"{where}: expected true/false, got {_show(value)}")
    if tp is int:
        return _coerce_int(value, where)
    if tp is float:
        return _coerce_float(value, where)
    return str(value)


def _coerce_int_or_auto(value: Any, where: str) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not isinstance(value, SCALARS) or isinstance(value, (bool, datetime.date)):
        raise MtrainError(f"{where}: expected an integer or auto, got {_show(value)}")
    try:
        return _coerce_int(value, where)
    except MtrainError as err:
        if "out of range" in str(err):
            raise
        raise MtrainError(f"{where}: expected an integer or auto, got {_show(value)}") from None


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise MtrainError(f"{where}: expected an integer, got {_show(value)}")
    try:
        number = float(value) if isinstance(value, str) else value
        if isinstance(number, float) and not number.is_integer():  # also NaN and inf
            raise ValueError
        number = int(number)
    except (TypeError, ValueError):
        raise MtrainError(f"{where}: expected an integer, got {_show(value)}") from None
    if not -INT_BOUND <= number < INT_BOUND:
        raise MtrainError(f"{where}: {_show(value)} is out of range; use an integer of at most 18 digits")
    return number


def _coerce_float(value: Any, where: str) -> float:
    """A finite float: NaN passes every range check (all comparisons are false), inf most."""
    if isinstance(value, bool):
        raise MtrainError(f"{where}: expected a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    except (TypeError, ValueError):
        raise MtrainError(f"{where}: expected a number, got {_show(value)}") from None
    if not math.isfinite(number):
        raise MtrainError(f"{where}: expected a finite number, got {_show(value)}")
    return number


def _coerce_names(value: Any, where: str) -> tuple[str, ...]:
    """A YAML list, or comma-separated text (--set train.log_to=a,b); empty or null: none. A
    mapping gives NAME=VALUE items (data.weights: {europarl: 1, bt: 0.5})."""
    if isinstance(value, dict):
        value = [f"{key}={item}" for key, item in value.items()]
    items = value if isinstance(value, (list, tuple)) else [value] if value else []
    if not all(isinstance(item, SCALARS) for item in items):
        raise MtrainError(f"{where}: expected names, as a list or comma-separated, got {_show(value)}")
    names = [name.strip() for item in items for name in str(item).split(",")]
    return tuple(name for name in names if name)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(section: str, key: Any, valid: list[str], where: str) -> MtrainError:
    name = _quoted(key) if isinstance(key, str) else _show(key)  # YAML keys may be numbers, null, dates
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return MtrainError(
        f"{where}: unknown key {section}.{name}{hint}; valid keys of [{section}]: {', '.join(valid)}"
    )


def _merge(base: dict[str, dict[str, Any]], updates: dict[str, Any], where: str) -> None:
    """Merge `{section: {key: value}}` into `base` in place, checking names and coercing types."""
    for section, values in updates.items():
        if section not in SECTIONS:
            raise MtrainError(
                f"{where}: unknown section {_show(section)}; valid sections: {', '.join(SECTIONS)}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise MtrainError(f"{where}: section {section!r} must be a mapping of key: value")
        types = _field_types(SECTIONS[section])
        for key, value in values.items():
            if key not in types:
                raise _unknown_key(section, key, list(types), where)
            base[section][key] = _coerce(value, types[key], f"{where}: {section}.{key}")


def parse_override(text: str) -> dict[str, dict[str, Any]]:
    """`train.lr_scale=2` -> {"train": {"lr_scale": "2"}}; the value is coerced later."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise MtrainError(f"--set {text!r}: expected section.key=value, e.g. --set train.max_steps=1000")
    dotted, value = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    return {section: {key: _yaml(value, f"--set {_quoted(text)}") if value.strip() else ""}}


def config_from_dict(data: dict[str, Any], where: str = "config") -> Config:
    """Build a Config from nested dicts (a YAML file, a checkpoint's stored config)."""
    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    _merge(merged, data or {}, where)
    return Config(**{name: SECTIONS[name](**merged[name]) for name in SECTIONS})


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file (if any), then each `--set section.key=value` in order."""
    merged = set_keys(path, overrides)
    config = Config(**{name: SECTIONS[name](**merged[name]) for name in SECTIONS})
    check_ranges(config)
    return config


def set_keys(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of the keys the YAML file and the overrides set (coerced), without the defaults."""
    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise MtrainError(f"{path}: config file not found; pass an existing YAML file (see configs/)")
        data = _yaml(_read_text(path), str(path)) or {}
        if not isinstance(data, dict):
            raise MtrainError(f"{path}: expected a mapping of sections (model:, train:, ...)")
        _merge(merged, data, str(path))
    for text in overrides:
        _merge(merged, parse_override(text), f"--set {_quoted(text)}")
    return merged


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise MtrainError(f"{path}:{line}: invalid UTF-8 (byte 0x{raw[err.start]:02x}); save the config as UTF-8") from None


# Smallest allowed value (and the bound it must stay below) of numeric keys that cannot work
# outside it: a negative length, a zero interval (step % 0) or a zero warmup (division by zero)
# would otherwise fail deep inside a run, or silently do nothing. decode.* is checked, with the
# option names, by mtrain.translate.check_decode.
LOG_TARGETS = ("tensorboard", "wandb")  # train.log_to values
RANGES: dict[str, tuple[float, float | None]] = {
    **{f"model.{k}": (1, None) for k in ("d_model", "d_ff", "n_heads", "n_encoder_layers", "n_decoder_layers", "vocab_size")},
    "model.max_len": (2, None), "model.src_vocab_size": (0, None),
    "model.dropout": (0, 1), "model.attention_dropout": (0, 1), "model.activation_dropout": (-1, 1),
    "tokenizer.vocab_size": (1, None), "tokenizer.input_sentence_size": (0, None),
    "data.max_len": (1, None), "data.max_ratio": (1, None),
    **{f"train.{k}": (1, None) for k in ("max_tokens", "update_freq", "warmup_steps", "log_every", "save_every",
                                         "eval_every", "eval_beam", "max_nonfinite")},
    **{f"train.{k}": (0, None) for k in ("max_steps", "lr_scale", "weight_decay", "clip_norm", "eval_max_sentences",
                                         "keep_last", "keep_every", "average_last", "patience", "num_threads", "adam_eps",
                                         "sampling_alpha", "cooldown_steps", "rdrop_alpha")},
    "train.label_smoothing": (0, 1), "train.cooldown_fraction": (0, 1), "train.adam_beta1": (0, 1), "train.adam_beta2": (0, 1),
    # numpy (np.random.seed) and SentencePiece take 32-bit unsigned seeds
    "train.seed": (0, 2**32), "tokenizer.seed": (0, 2**32),
}


ACTIVATIONS = ("relu", "swish")


def check_ranges(config: Config) -> None:
    """One-line error for the first key in RANGES whose value cannot work."""
    for dotted, (low, high) in RANGES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value == "auto":  # resolved when training starts (train.max_tokens)
            continue
        if value < low or (high is not None and value >= high):
            bound = f"at least {low}" if high is None else f"in [{low}, {high})"
            raise MtrainError(f"{dotted}={value!r}: must be {bound}; change it in the config file or with --set {dotted}=...")
    check_corpus_settings(config.data)
    if config.model.activation not in ACTIVATIONS:
        raise MtrainError(f"model.activation={config.model.activation!r}: use {' or '.join(ACTIVATIONS)}")
    train = config.train
    unknown = [target for target in train.log_to if target not in LOG_TARGETS]
    if unknown:
        raise MtrainError(f"train.log_to: unknown {unknown[0]!r}; use {' and/or '.join(LOG_TARGETS)}, "
                          "e.g. --set train.log_to=tensorboard")
    try:
        parse_duration(train.max_time)
    except ValueError as err:
        raise MtrainError(f"train.max_time: {err}; e.g. --set train.max_time=2h") from None
    if train.max_time and train.cooldown_steps:  # two cooldowns would multiply
        raise MtrainError("train.max_time places the lr cooldown in time (train.cooldown_fraction); "
                          "drop train.cooldown_steps with --set train.cooldown_steps=0")
    if train.cooldown_steps > train.max_steps:  # the cooldown would start before update 1 and lower every lr
        raise MtrainError(f"train.cooldown_steps={train.cooldown_steps} exceeds train.max_steps={train.max_steps}: "
                          "set it to at most max_steps (e.g. a fifth to a third of the run) with --set train.cooldown_steps=...")


def corpus_weights(data: DataConfig) -> dict[str, float]:
    """data.weights as {name: weight}; each weight a finite number above 0, each name once."""
    weights: dict[str, float] = {}
    for item in data.weights:
        name, sep, text = item.partition("=")
        name = name.strip()
        try:
            weight = float(text) if sep else math.nan
        except ValueError:
            weight = math.nan
        if not name or not math.isfinite(weight):
            raise MtrainError(f"data.weights: {item!r} is not NAME=WEIGHT; write e.g. --set data.weights=europarl=1,bt=0.5")
        if weight <= 0:
            raise MtrainError(f"data.weights: {name}={text.strip()}: a weight must be above 0; leave a corpus "
                              "out of training by tokenizing without it")
        if name in weights:
            raise MtrainError(f"data.weights: {name!r} is given twice; give each corpus one weight")
        weights[name] = weight
    return weights


def check_corpus_settings(data: DataConfig, names: Sequence[str] | None = None) -> None:
    """data.weights and data.tags are well-formed and, given the corpus names, name only those
    (and weights name every one): one line before any work."""
    weights = corpus_weights(data)
    if len(set(data.tags)) != len(data.tags):
        raise MtrainError(f"data.tags: {', '.join(data.tags)} names a corpus twice; name each tagged corpus once")
    if names is None:
        return
    known = ", ".join(names)
    for key, given in (("data.weights", list(weights)), ("data.tags", list(data.tags))):
        unknown = [name for name in given if name not in names]
        if unknown:
            raise MtrainError(f"{key}: no corpus named {unknown[0]!r} (the corpora are {known}); use those names")
    missing = [name for name in names if name not in weights]
    if weights and missing:
        raise MtrainError(f"data.weights: no weight for corpus {missing[0]!r}; give every corpus ({known}) a weight, "
                          "e.g. --set data.weights=" + ",".join(f"{name}=1" for name in names))


def replace(config: Config, **sections: dict[str, Any]) -> Config:
    """Return a copy with some fields changed: replace(cfg, model={"vocab_size": 8000})."""
    updated = {
        name: dataclasses.replace(getattr(config, name), **sections.get(name, {})) for name in SECTIONS
    }
    return Config(**updated)


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dicts; tuples become lists (YAML and checkpoints store lists)."""
    return {name: {key: list(value) if isinstance(value, tuple) else value for key, value in section.items()}
            for name, section in dataclasses.asdict(config).items()}


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
