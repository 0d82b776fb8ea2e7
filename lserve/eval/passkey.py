"""Passkey retrieval prompts: a 5-digit key hidden at a given depth in repeated filler text.

Plain prompts (no chat template): the default model retrieves from raw text far better.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyCase:
    """One prompt with its answer and where the needle sits."""

    prompt_ids: list[int]
    answer: str
    depth: float
    num_tokens: int


def make_passkey(tokenizer, num_tokens: int, depth: float, seed: int = 0) -> PasskeyCase:
    """A prompt of exactly ``num_tokens`` tokens (give or take the tail) with the needle at ``depth``.

    Parameters
    ----------
    tokenizer : object with ``encode``
    num_tokens : int
        Target prompt length in tokens.
    depth : float
        Fraction of the filler before the needle (0 = right after the intro, 1 = at the end).
    """
    key = str(random.Random(seed * 1000003 + num_tokens + int(depth * 100)).randint(10000, 99999))
    head = tokenizer.encode(INTRO)
    needle = tokenizer.encode(NEEDLE.format(key=key))[len(tokenizer.encode("")):]
    tail = tokenizer.encode("\n" + QUESTION)[len(tokenizer.encode("")):]
    unit = tokenizer.encode(FILLER)[len(tokenizer.encode("")):]
    budget = num_tokens - len(head) - len(needle) - len(tail)
    if budget < 0:
        raise ValueError(f"{num_tokens} tokens is too short for a passkey prompt")
    filler = (unit * (budget // len(unit) + 1))[:budget]
    # Cut filler at whole-unit boundaries around the needle so sentences stay intact.
    cut = int(round(depth * (budget // len(unit)))) * len(unit)
    ids = head + filler[:cut] + needle + filler[cut:] + tail
    return PasskeyCase(ids, key, depth, len(ids))
