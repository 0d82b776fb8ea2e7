"""Long-context tasks generated locally, at an exact prompt length in tokens.

Tasks (RULER-style where named so):

* ``passkey``: a 5-digit pass key in repeated filler (the classic passkey prompt).
* ``niah``: needle in a haystack: "One of the special magic numbers for <word> is: <7 digits>."
  in varied generated text (or filler), asked back by its key.
* ``niah-multikey``: the same with three distractor needles under other keys.
* ``niah-multivalue``: four needles share one key; all four values must be returned.
* ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... hidden in the
  haystack; every variable holding the value must be named.
* ``cwe``: common-words extraction: a numbered list of made-up words in which ten words are
  frequent; the ten must be named.

Every generator is deterministic in ``(task, num_tokens, depth, seed)`` and returns an
:class:`EvalCase` whose ``prompt_ids`` are exactly ``num_tokens`` long and whose
``needle_spans`` say where the facts are. Prompts are plain text (no chat template): the
default model retrieves far better from raw prompts.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from lserve.eval.passkey import INTRO as PASSKEY_INTRO
from lserve.eval.passkey import NEEDLE as PASSKEY_NEEDLE
from lserve.eval.passkey import QUESTION as PASSKEY_QUESTION
from lserve.eval.text import KEY_WORDS, Haystack, body_ids, insert_at_depths

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")
NIAH_NEEDLE = " One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
                 "The special magic number for {key} mentioned in the provided text is")
MV_QUESTION = ("\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
               "The special magic numbers for {key} mentioned in the provided text are")
VT_INTRO = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n")
VT_QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the text above. "
               "Answer: According to the chain(s) of variable assignment in the text above, {n} variables "
               "are assigned the value {value}, they are:")
CWE_INTRO = "Below is a numbered list of words. In these words, some appear more often than others.\n"
CWE_QUESTION = ("\nQuestion: What are the 10 most common words in the above list? "
                "Answer: The top 10 words that appear most often in the list are:")

TASKS = ("passkey", "niah", "niah-multikey", "niah-multivalue", "vt", "cwe")
# Tokens to generate per task: enough for the full answer with a little slack.
MAX_TOKENS = {"passkey": 8, "niah": 12, "niah-multikey": 12, "niah-multivalue": 48, "vt": 40, "cwe": 80}
# Tasks whose needle position is set by ``depth`` (cwe has no needle).
DEPTH_TASKS = ("passkey", "niah", "niah-multikey", "niah-multivalue", "vt")


@dataclass
class EvalCase:
    """One prompt, its expected answers and where they are hidden.

    Attributes
    ----------
    prompt_ids : list[int]
        Exactly ``context`` token ids.
    answers : list[str]
        Strings the output must contain (all of them for full credit).
    needle_spans : list of (start, end)
        Token spans of the facts inside ``prompt_ids`` (the target first); for ``cwe``, empty.
    body_span : (start, end)
        Token range of the haystack with its needles (between the instructions and the question).
    decoy_spans : list of (start, end)
        Distractor facts (other keys, the decoy variable chain), not part of the answer.
    depth : float or None
        Requested depth of the (target) needle: fraction of the haystack before it.
    """

    task: str
    prompt_ids: list[int]
    answers: list[str]
    context: int
    depth: float | None
    seed: int
    needle_spans: list[tuple[int, int]] = field(default_factory=list)
    max_tokens: int = 16
    body_span: tuple[int, int] = (0, 0)  # token range of the haystack (needles included)
    decoy_spans: list[tuple[int, int]] = field(default_factory=list)  # distractor facts

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


def _rng(task: str, num_tokens: int, depth: float | None, seed: int) -> random.Random:
    d = -1 if depth is None else int(round(depth * 1000))
    return random.Random(f"{task}:{num_tokens}:{d}:{seed}")


def _assemble(tokenizer, task: str, num_tokens: int, depth: float | None, seed: int, head: str,
              needles: list[tuple[float, str]], tail: str, answers: list[str], haystack: str) -> EvalCase:
    """head + haystack (with needles at their depths) + tail, cut to exactly ``num_tokens``."""
    head_ids = tokenizer.encode(head)
    tail_ids = body_ids(tokenizer, tail)
    needle_ids = [(d, body_ids(tokenizer, text)) for d, text in needles]
    budget = num_tokens - len(head_ids) - len(tail_ids) - sum(len(n) for _, n in needle_ids)
    if budget < 16:
        raise ValueError(f"{num_tokens} tokens is too short for a {task} prompt (needs > "
                         f"{num_tokens - budget + 16})")
    hay = Haystack(tokenizer, haystack, seed=f"hay:{task}:{num_tokens}:{seed}")
    body, spans = insert_at_depths(hay.sentences(budget), needle_ids)
    ids = head_ids + body + tail_ids
    spans = [(s + len(head_ids), e + len(head_ids)) for s, e in spans]
    return EvalCase(task, ids, answers, num_tokens, depth, seed, spans, MAX_TOKENS[task],
                    (len(head_ids), len(head_ids) + len(body)))


def _distinct_keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample(KEY_WORDS, n)


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def _spread(rng: random.Random, n: int, avoid: float) -> list[float]:
    """``n`` depths in [0.05, 0.95] at least 0.05 away from ``avoid`` (and from each other where possible)."""
    out: list[float] = []
    for _ in range(200):
        if len(out) == n:
            break
        d = rng.uniform(0.05, 0.95)
        if abs(d - avoid) >= 0.05 and all(abs(d - o) >= 0.03 for o in out):
            out.append(d)
    while len(out) < n:
        out.append(rng.uniform(0.05, 0.95))
    return out


def make_passkey_case(tokenizer, num_tokens: int, depth: float, seed: int = 0, haystack: str = "filler") -> EvalCase:
    """Passkey retrieval (5-digit key)."""
    rng = _rng("passkey", num_tokens, depth, seed)
    key = _number(rng, 5)
    return _assemble(tokenizer, "passkey", num_tokens, depth, seed, PASSKEY_INTRO,
                     [(depth, " " + PASSKEY_NEEDLE.format(key=key).strip())], "\n" + PASSKEY_QUESTION, [key], haystack)


def make_niah_case(tokenizer, num_tokens: int, depth: float, seed: int = 0, haystack: str = "sentences") -> EvalCase:
    """Single needle: a 7-digit value under a word key."""
    rng = _rng("niah", num_tokens, depth, seed)
    key, value = rng.choice(KEY_WORDS), _number(rng, 7)
    return _assemble(tokenizer, "niah", num_tokens, depth, seed, NIAH_INTRO,
                     [(depth, NIAH_NEEDLE.format(key=key, value=value))], NIAH_QUESTION.format(key=key), [value],
                     haystack)


def make_multikey_case(tokenizer, num_tokens: int, depth: float, seed: int = 0, haystack: str = "sentences",
                       num_distractors: int = 3) -> EvalCase:
    """The target needle at ``depth`` plus distractor needles with other keys at random depths."""
    rng = _rng("niah-multikey", num_tokens, depth, seed)
    keys = _distinct_keys(rng, num_distractors + 1)
    values = [_number(rng, 7) for _ in keys]
    depths = [depth] + _spread(rng, num_distractors, depth)
    needles = [(d, NIAH_NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    case = _assemble(tokenizer, "niah-multikey", num_tokens, depth, seed, NIAH_INTRO, needles,
                     NIAH_QUESTION.format(key=keys[0]), [values[0]], haystack)
    case.needle_spans, case.decoy_spans = case.needle_spans[:1], case.needle_spans[1:]
    return case


def make_multivalue_case(tokenizer, num_tokens: int, depth: float, seed: int = 0, haystack: str = "sentences",
                         num_values: int = 4) -> EvalCase:
    """``num_values`` needles share one key: the first at ``depth``, the others at random depths."""
    rng = _rng("niah-multivalue", num_tokens, depth, seed)
    key = rng.choice(KEY_WORDS)
    values: list[str] = []
    while len(values) < num_values:
        v = _number(rng, 7)
        if v not in values:
            values.append(v)
    depths = [depth] + _spread(rng, num_values - 1, depth)
    needles = [(d, NIAH_NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values)]
    return _assemble(tokenizer, "niah-multivalue", num_tokens, depth, seed, NIAH_INTRO, needles,
                     MV_QUESTION.format(key=key), values, haystack)


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def make_vt_case(tokenizer, num_tokens: int, depth: float, seed: int = 0, haystack: str = "sentences",
                 num_hops: int = 4) -> EvalCase:
    """Variable tracking: one chain of ``num_hops + 1`` variables from ``depth`` to the end, plus a distractor chain."""
    rng = _rng("vt", num_tokens, depth, seed)
    taken: set[str] = set()
    value, other = _number(rng, 5), _number(rng, 5)
    chain = [_var_name(rng, taken) for _ in range(num_hops + 1)]
    decoy = [_var_name(rng, taken) for _ in range(num_hops + 1)]
    top = depth + (0.95 - depth) * 0.9 if depth < 0.95 else depth
    steps = [depth + (top - depth) * i / num_hops for i in range(num_hops + 1)]
    needles = [(steps[0], f" VAR {chain[0]} = {value}.")]
    needles += [(steps[i], f" VAR {chain[i]} = VAR {chain[i - 1]}.") for i in range(1, num_hops + 1)]
    dsteps = sorted(_spread(rng, num_hops + 1, depth))
    needles += [(dsteps[0], f" VAR {decoy[0]} = {other}.")]
    needles += [(dsteps[i], f" VAR {decoy[i]} = VAR {decoy[i - 1]}.") for i in range(1, num_hops + 1)]
    case = _assemble(tokenizer, "vt", num_tokens, depth, seed, VT_INTRO, needles,
                     VT_QUESTION.format(value=value, n=num_hops + 1), chain, haystack)
    case.needle_spans, case.decoy_spans = case.needle_spans[: num_hops + 1], case.needle_spans[num_hops + 1:]
    return case


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def make_cwe_case(tokenizer, num_tokens: int, depth: float | None = None, seed: int = 0, num_common: int = 10,
                  **_) -> EvalCase:
    """Common-words extraction: ten made-up words appear often in a numbered list, the rest once."""
    rng = _rng("cwe", num_tokens, None, seed)
    head_ids = tokenizer.encode(CWE_INTRO)
    tail_ids = body_ids(tokenizer, CWE_QUESTION)
    budget = num_tokens - len(head_ids) - len(tail_ids)
    words: set[str] = set()
    while len(words) < 4 * num_tokens:
        words.add(_pseudo_word(rng))
    pool = sorted(words)
    rng.shuffle(pool)
    common, rare = pool[:num_common], pool[num_common:]
    sample = [len(body_ids(tokenizer, f"\n{100 + j}. {w}")) for j, w in enumerate(pool[:50])]
    n_items = max(budget * len(sample) // sum(sample), 4 * num_common)  # items that fit, about
    freq = max(4, n_items * 2 // (5 * num_common))  # common words fill about 40% of the list
    n_rare = max(n_items - num_common * freq, 0)
    queue = [w for w in common for _ in range(freq)] + rare[:n_rare]
    rng.shuffle(queue)
    spare = iter(rare[n_rare:])  # rare words to pad with (each used once)
    # Encode item by item up to the budget; a cut last item is always a rare word.
    body: list[int] = []
    counts = dict.fromkeys(common, 0)
    i = 0
    while len(body) < budget:
        w = queue.pop() if queue else next(spare)
        ids = body_ids(tokenizer, f"\n{i + 1}. {w}")
        if len(body) + len(ids) > budget:
            ids = body_ids(tokenizer, f"\n{i + 1}. {next(spare)}")[: budget - len(body)]
        elif w in counts:
            counts[w] += 1
        body.extend(ids)
        i += 1
    # Common words must still beat every rare word (each appears at most once).
    answers = [w for w in common if counts[w] >= 2]
    return EvalCase("cwe", head_ids + body + tail_ids, answers, num_tokens, None, seed, [], MAX_TOKENS["cwe"],
                    (len(head_ids), len(head_ids) + len(body)))


GENERATORS = {
    "passkey": make_passkey_case,
    "niah": make_niah_case,
    "niah-multikey": make_multikey_case,
    "niah-multivalue": make_multivalue_case,
    "vt": make_vt_case,
    "cwe": make_cwe_case,
}


def make_case(task: str, tokenizer, num_tokens: int, depth: float | None, seed: int = 0,
              haystack: str | None = None) -> EvalCase:
    """Build one case of ``task`` (see :data:`TASKS`).

    Parameters
    ----------
    tokenizer : object with ``encode`` / ``decode``
    num_tokens : int
        Exact prompt length.
    depth : float or None
        Needle depth in [0, 1] (ignored by ``cwe``).
    haystack : str, optional
        ``"sentences"`` or ``"filler"``; each task has its own default.
    """
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    kw = {} if haystack is None else {"haystack": haystack}
    return GENERATORS[task](tokenizer, num_tokens, 0.5 if depth is None else depth, seed, **kw)


def score(case: EvalCase, text: str) -> float:
    """Score (0-100) of generated ``text``: share of the expected answers it contains.

    Numbers must match whole (``12345`` does not count inside ``123456``); words and variable
    names are matched as whole words, case-sensitively for variables.
    """
    if not case.answers:
        return 0.0
    found = 0
    for a in case.answers:
        pat = rf"(?<![0-9A-Za-z]){re.escape(a)}(?![0-9A-Za-z])"
        flags = 0 if case.task == "vt" else re.IGNORECASE
        found += bool(re.search(pat, text, flags))
    return 100.0 * found / len(case.answers)
