"""Haystack text generated locally: repeated filler, or varied sentences from word lists.

Long-context tasks hide facts in irrelevant text. Repeating one filler paragraph (the classic
passkey haystack) is easy for a model, since everything but the needle is predictable; the
``"sentences"`` haystack instead draws every sentence from small grammars over word lists, so
the text is varied, grammatical-looking and never repeats a paragraph. No downloads.

Everything is built in token space: a haystack is a list of sentences, each already encoded
(with its leading space), so prompts can be cut to an exact token count and needles placed at
sentence boundaries.
"""

from __future__ import annotations

import random

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

ADJECTIVES = (
    "quiet", "ancient", "bright", "narrow", "heavy", "gentle", "curious", "distant", "silver", "hollow",
    "crowded", "patient", "rusty", "golden", "restless", "humble", "frozen", "broad", "careful", "noisy",
    "simple", "steady", "clever", "tired", "wooden", "empty", "famous", "strange", "proud", "modest",
    "dusty", "pale", "fresh", "lonely", "rapid", "warm", "bitter", "green", "wild", "polite",
)
NOUNS = (
    "farmer", "river", "village", "teacher", "engine", "garden", "sailor", "library", "merchant", "forest",
    "painter", "bridge", "doctor", "harbor", "student", "castle", "baker", "valley", "soldier", "market",
    "poet", "island", "carpenter", "window", "traveler", "mountain", "musician", "kitchen", "child", "lantern",
    "captain", "meadow", "weaver", "tower", "shepherd", "station", "writer", "orchard", "miner", "workshop",
)
VERBS_PAST = (
    "visited", "repaired", "painted", "followed", "described", "admired", "crossed", "guarded", "watched",
    "measured", "cleaned", "built", "forgot", "remembered", "carried", "sold", "found", "opened", "left",
    "studied", "praised", "ignored", "noticed", "explored", "borrowed", "moved", "decorated", "defended",
)
VERBS_INTRANS = (
    "slept", "laughed", "waited", "wandered", "sang", "rested", "worked", "listened", "hesitated", "smiled",
    "traveled", "argued", "paused", "whispered", "returned", "struggled", "danced", "prayed", "shouted",
)
TIMES = (
    "in the morning", "after the storm", "before dawn", "during the festival", "late at night",
    "every spring", "on a cold evening", "at noon", "last winter", "in the autumn", "after supper",
    "before the harvest", "on the first day", "at the end of the week", "during the long summer",
)
PLACES = (
    "near the old mill", "by the river", "in the crowded square", "behind the church", "across the valley",
    "under the bridge", "at the edge of the forest", "inside the workshop", "on the hill", "along the coast",
    "beside the well", "in the small harbor", "at the market", "outside the gate", "in the quiet library",
)
CONNECTORS = ("Meanwhile", "Later", "Afterwards", "Still", "Even so", "For a while", "In the end", "Once again")

# Words for keys of needles (RULER-style "special magic number for <key>") and for variables.
KEY_WORDS = (
    "apple", "breeze", "candle", "dolphin", "ember", "falcon", "glacier", "harvest", "ivory", "jasmine",
    "kettle", "lagoon", "marble", "nectar", "orchid", "pebble", "quartz", "raven", "saffron", "thistle",
    "umbrella", "velvet", "walnut", "yarrow", "zephyr", "anchor", "blossom", "copper", "daisy", "eclipse",
    "feather", "garnet", "hazel", "island", "juniper", "kiwi", "lemon", "maple", "nutmeg", "oyster",
    "pepper", "quill", "ribbon", "sparrow", "tulip", "violet", "willow", "acorn", "bamboo", "cobalt",
)


def _sentence(rng: random.Random) -> str:
    """One sentence from a handful of templates over the word lists above."""
    a, b = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
    n1, n2 = rng.choice(NOUNS), rng.choice(NOUNS)
    form = rng.randrange(7)
    if form == 0:
        s = f"The {a} {n1} {rng.choice(VERBS_PAST)} the {b} {n2} {rng.choice(TIMES)}."
    elif form == 1:
        s = f"{rng.choice(TIMES).capitalize()}, a {a} {n1} {rng.choice(VERBS_INTRANS)} {rng.choice(PLACES)}."
    elif form == 2:
        s = f"Nobody knew why the {n1} {rng.choice(VERBS_PAST)} the {a} {n2}."
    elif form == 3:
        s = f"{rng.choice(CONNECTORS)}, the {n1} {rng.choice(VERBS_INTRANS)} while the {n2} {rng.choice(VERBS_INTRANS)}."
    elif form == 4:
        s = f"The {n1} {rng.choice(PLACES)} was {a} and {b}."
    elif form == 5:
        s = f"Some say the {a} {n1} once {rng.choice(VERBS_PAST)} a {n2} {rng.choice(PLACES)}."
    else:
        s = f"It was {a} {rng.choice(PLACES)}, so the {n1} {rng.choice(VERBS_INTRANS)} {rng.choice(TIMES)}."
    return s


def body_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without the tokenizer's special prefix (BOS), if it adds one."""
    prefix = len(tokenizer.encode(""))
    return tokenizer.encode(text)[prefix:]


class Haystack:
    """A source of encoded sentences.

    Parameters
    ----------
    tokenizer : object with ``encode``
    kind : str
        ``"sentences"`` (generated from word lists) or ``"filler"`` (the repeated passkey filler,
        one sentence at a time).
    seed : int or str
        Seed of the sentence stream; the same seed gives the same text (strings seed stably).
    """

    KINDS = ("sentences", "filler")

    def __init__(self, tokenizer, kind: str = "sentences", seed: int | str = 0) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"haystack kind must be one of {self.KINDS}, got {kind!r}")
        self.tokenizer, self.kind = tokenizer, kind
        self.rng = random.Random(seed)
        self._filler = [body_ids(tokenizer, " " + s.strip() + ".") for s in FILLER.split(".") if s.strip()]
        self._i = 0

    def next_sentence(self) -> list[int]:
        """Token ids of the next sentence, with its leading space."""
        if self.kind == "filler":
            s = self._filler[self._i % len(self._filler)]
            self._i += 1
            return s
        return body_ids(self.tokenizer, " " + _sentence(self.rng))

    def sentences(self, num_tokens: int) -> list[list[int]]:
        """Whole sentences totalling exactly ``num_tokens`` tokens (the last one cut short if needed)."""
        out: list[list[int]] = []
        total = 0
        while total < num_tokens:
            s = self.next_sentence()
            s = s[: num_tokens - total]
            out.append(s)
            total += len(s)
        return out


def insert_at_depths(sentences: list[list[int]],
                     needles: list[tuple[float, list[int]]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Join sentences, inserting each needle at the sentence boundary nearest its depth.

    Parameters
    ----------
    sentences : list of token lists
        The haystack, in order.
    needles : list of (depth, token list)
        ``depth`` in [0, 1]: fraction of the haystack tokens that come before the needle.

    Returns
    -------
    ids : list[int]
        Haystack with needles.
    spans : list of (start, end)
        Token span of each needle inside ``ids``, in the order given.
    """
    bounds = [0]
    for s in sentences:
        bounds.append(bounds[-1] + len(s))
    total = bounds[-1]
    # Sentence index (boundary) each needle goes before; ties keep the given order.
    where = []
    for i, (depth, _) in enumerate(needles):
        target = min(max(depth, 0.0), 1.0) * total
        b = min(range(len(bounds)), key=lambda j: (abs(bounds[j] - target), j))
        where.append((b, i))
    where.sort()
    ids: list[int] = []
    spans: list[tuple[int, int] | None] = [None] * len(needles)
    w = 0
    for j, s in enumerate(sentences + [[]]):
        while w < len(where) and where[w][0] == j:
            i = where[w][1]
            start = len(ids)
            ids.extend(needles[i][1])
            spans[i] = (start, len(ids))
            w += 1
        ids.extend(s)
    return ids, [sp for sp in spans if sp is not None]
