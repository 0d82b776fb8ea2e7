"""Task generators: exact prompt lengths, answers where the case says they are, honest scoring."""

from __future__ import annotations

import collections
import re

import pytest

from lserve.eval.tasks import DEPTH_TASKS, TASKS, make_case, score
from lserve.eval.text import Haystack, insert_at_depths
from lserve.models.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tok(smol):
    return smol.tokenizer


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("n, depth", [(700, 0.0), (1500, 0.37), (3000, 0.9)])
def test_prompt_length_and_needle_position(tok, task, n, depth):
    c = make_case(task, tok, n, depth, seed=4)
    assert c.num_tokens == n and c.context == n
    assert c.answers and c.max_tokens > 0
    if task == "cwe":
        return
    text = tok.decode(c.prompt_ids)
    # Each answer appears in the prompt, inside the needle spans the case reports.
    spans = [tok.decode(c.prompt_ids[a:b]) for a, b in c.needle_spans]
    for ans in c.answers:
        assert ans in text
        assert any(ans in s for s in spans), (ans, spans)
    # The target needle sits at the requested depth of the haystack (to within one sentence).
    hs, he = c.body_span
    first = c.needle_spans[0][0]
    assert hs <= first and c.needle_spans[0][1] <= he
    # Depth counts haystack tokens only: subtract every fact (decoys included) before the target.
    facts = c.needle_spans + c.decoy_spans
    before = sum(e - s for s, e in facts if e <= first)
    frac = (first - hs - before) / (he - hs - sum(e - s for s, e in facts))
    assert abs(frac - depth) < 0.05, (frac, depth)


def test_cases_are_deterministic_and_vary_with_seed(tok):
    a = make_case("niah", tok, 1200, 0.5, seed=1)
    b = make_case("niah", tok, 1200, 0.5, seed=1)
    c = make_case("niah", tok, 1200, 0.5, seed=2)
    assert a.prompt_ids == b.prompt_ids and a.answers == b.answers
    assert c.prompt_ids != a.prompt_ids and c.answers != a.answers


def test_sentence_haystack_is_varied(tok):
    hay = Haystack(tok, "sentences", seed=0)
    sents = [tok.decode(s) for s in hay.sentences(3000)]
    assert sum(len(s) for s in hay.sentences(0)) == 0
    assert len(set(sents)) > 0.9 * len(sents)  # hardly any sentence repeats
    filler = [tok.decode(s) for s in Haystack(tok, "filler").sentences(3000)]
    assert len(set(filler)) <= 5


def test_insert_at_depths_spans():
    sents = [[i] * 10 for i in range(10)]  # 100 tokens, boundaries every 10
    ids, spans = insert_at_depths(sents, [(0.52, [-1, -1]), (0.0, [-2]), (1.0, [-3])])
    assert len(ids) == 104
    assert ids[spans[0][0]:spans[0][1]] == [-1, -1] and spans[0][0] == 51  # after 5 sentences and the depth-0 needle
    assert spans[1] == (0, 1) and ids[spans[2][0]] == -3 and spans[2][1] == len(ids)


def test_cwe_answers_are_the_most_common_words(tok):
    c = make_case("cwe", tok, 2000, None, seed=3)
    words = re.findall(r"\n\d+\. (\w+)", tok.decode(c.prompt_ids))
    counts = collections.Counter(words)
    top = {w for w, _ in counts.most_common(len(c.answers))}
    assert set(c.answers) == top and len(c.answers) == 10
    rest = max(v for w, v in counts.items() if w not in top)
    assert min(counts[w] for w in c.answers) > rest


def test_vt_chain_resolves_to_the_answers(tok):
    c = make_case("vt", tok, 2000, 0.3, seed=0)
    text = tok.decode(c.prompt_ids)
    value = re.search(r"assigned the value (\d+)", text).group(1)
    assign = dict(re.findall(r"VAR (\w+) = (?:VAR )?(\w+)\.", text))
    holding = {v for v in assign if _resolve(assign, v) == value}
    assert holding == set(c.answers)


def _resolve(assign, v):
    while v in assign:
        v = assign[v]
    return v


def test_score():
    c = make_case("niah-multivalue", ByteTokenizer(), 2000, 0.5, seed=0)
    assert score(c, " ".join(c.answers)) == 100.0
    assert score(c, f"{c.answers[0]} and {c.answers[1]}") == 50.0
    assert score(c, c.answers[0] + "9") == 0.0  # a longer number is not the answer
    assert score(c, "") == 0.0
    p = make_case("passkey", ByteTokenizer(), 600, 0.5, seed=0)
    assert score(p, f" {p.answers[0]}.") == 100.0


def test_depth_tasks_reject_too_short_prompts(tok):
    for task in DEPTH_TASKS:
        with pytest.raises(ValueError, match="too short"):
            make_case(task, tok, 60, 0.5)
