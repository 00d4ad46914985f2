"""The sentences `mtrain export` checks parity on when no check file or data folder is given: a
handful per common source language. Parity is a property of the model function, so any text
serves; the model's own source language makes the greedy outputs realistic."""

from __future__ import annotations

BUILT_IN = {
    "de": [
        "Ein Hund läuft durch den Park.",
        "Zwei Männer spielen Fußball auf einer grünen Wiese.",
        "Eine Frau mit einem roten Hut liest ein Buch.",
        "Kinder spielen am Strand im Sand.",
        "Ein Mann fährt mit seinem Fahrrad die Straße entlang.",
        "Die Leute warten an der Bushaltestelle.",
        "Ein kleines Mädchen isst ein Eis.",
        "Ein Koch bereitet in einer Küche das Essen zu.",
    ],
    "en": [
        "A dog runs through the park.",
        "Two men are playing soccer on a green field.",
        "A woman in a red hat is reading a book.",
        "Children are playing in the sand at the beach.",
        "A man rides his bicycle down the street.",
        "People are waiting at the bus stop.",
        "A little girl is eating an ice cream.",
        "A cook is preparing food in a kitchen.",
    ],
    "fr": [
        "Un chien court dans le parc.",
        "Deux hommes jouent au football sur un terrain vert.",
        "Une femme avec un chapeau rouge lit un livre.",
        "Des enfants jouent dans le sable à la plage.",
    ],
    "cs": [
        "Pes běží parkem.",
        "Dva muži hrají fotbal na zeleném hřišti.",
        "Žena v červeném klobouku čte knihu.",
        "Děti si hrají v písku na pláži.",
    ],
}


def built_in(language: str | None) -> list[str]:
    """The model's source language's sentences, or every language's when it has none here."""
    if language in BUILT_IN:
        return list(BUILT_IN[language])
    return [line for lines in BUILT_IN.values() for line in lines]


def read_check_set(check: Path | None, check_ref: Path | None, data: Path | None, limit: int):
    """The check set from --check [--check-ref], or --data's validation split, or None (built-in).
    Files are read with the same line rules as `mtrain eval` (one sentence a line, UTF-8)."""
    from mtrain.errors import MtrainError
    from mtrain.evaluate import read_stripped_lines
    from mtrain.export.parity import CheckSet

    if limit < 1:
        raise MtrainError(f"--check-lines {limit}: must be at least 1")
    if check_ref is not None and check is None:
        raise MtrainError("--check-ref needs --check (the sources it translates)")
    if check is not None and data is not None:
        raise MtrainError("--check and --data both give a check set; pass one")
    if check is not None:
        sources = read_stripped_lines(check)
        refs = None if check_ref is None else read_stripped_lines(check_ref)
        if refs is not None and len(refs) != len(sources):
            raise MtrainError(f"{check_ref}: {len(refs)} lines for {len(sources)} sources in {check}; "
                              "give one reference per source line")
        return CheckSet(sources[:limit], None if refs is None else refs[:limit], str(check))
    if data is not None:
        from mtrain.data import TokenizedData

        split = TokenizedData(data).split("valid")
        return CheckSet(split.src_text()[:limit], split.tgt_text()[:limit], f"{data} valid split")
    return None
