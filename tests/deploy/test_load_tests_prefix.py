"""The prefix-cache workloads of the load generator: document QA and multi-turn chat."""

from __future__ import annotations

import asyncio

import pytest
from test_load_tests import ScriptedServer, tok  # noqa: F401 - the byte tokenizer fixture

from load_tests.cli import build_parser, make_dataset
from load_tests.client import RequestOptions
from load_tests.datasets import chat_dataset, doc_qa_dataset
from load_tests.runner import LoadShape, run_load


def test_doc_qa_is_n_docs_by_m_questions_in_rounds(tok):  # noqa: F811
    specs = doc_qa_dataset(tok, num_docs=4, questions=3, doc_len=300, doc_range=0.3, question_len=16, output_len=8,
                           seed=3)
    assert len(specs) == 12
    assert [s.meta["question"] for s in specs] == [0] * 4 + [1] * 4 + [2] * 4
    by_doc: dict[int, list] = {}
    for s in specs:
        by_doc.setdefault(s.group, []).append(s)
        assert s.input_len == len(s.prompt) == s.meta["doc_len"] + 16
        assert 210 <= s.meta["doc_len"] <= 390
    assert sorted(by_doc) == [0, 1, 2, 3]
    for qs in by_doc.values():
        n = qs[0].meta["doc_len"]
        assert all(q.prompt[:n] == qs[0].prompt[:n] for q in qs)  # the document is shared exactly
        assert len({tuple(q.prompt[n:]) for q in qs}) == 3  # the questions differ
    with pytest.raises(ValueError):
        doc_qa_dataset(tok, 2, 2, 100, 0.1, 0, 8)


def test_chat_turns_resend_the_history(tok):  # noqa: F811
    specs = chat_dataset(tok, conversations=2, turns=3, system_len=50, user_len=10, reply_len=20, output_len=8,
                         think_s=0.5, seed=1)
    assert [(s.meta["conversation"], s.meta["turn"]) for s in specs] == [(c, t) for c in range(2) for t in range(3)]
    for i, s in enumerate(specs):
        t = s.meta["turn"]
        assert s.input_len == 50 + 10 * (t + 1) + 20 * t
        if t:
            prev = specs[i - 1]
            assert s.after == i - 1 and s.think_s == 0.5
            assert s.prompt[: prev.input_len] == prev.prompt  # the earlier turn is a prefix of this one
        else:
            assert s.after is None


def test_cli_builds_both_workloads(tok):  # noqa: F811
    p = build_parser()
    _, specs, info = make_dataset(p.parse_args(["--dataset", "doc-qa", "--tokenizer", tok.source, "--num-docs", "3",
                                                "--questions-per-doc", "2", "--doc-len", "100"]))
    assert len(specs) == 6 and info["num_prompts"] == 6 and info["questions_per_doc"] == 2
    _, specs, info = make_dataset(p.parse_args(["--dataset", "chat", "--tokenizer", tok.source, "--conversations", "2",
                                                "--turns", "4", "--system-len", "30"]))
    assert len(specs) == 8 and info["turns"] == 4


@pytest.mark.parametrize("shape", [LoadShape("poisson", rate=100.0, seed=2), LoadShape("concurrency", concurrency=3)])
def test_a_chat_turn_is_sent_after_the_previous_one_finished(tok, shape):  # noqa: F811
    specs = chat_dataset(tok, conversations=2, turns=3, system_len=5, user_len=3, reply_len=2, output_len=3,
                         think_s=0.05)

    async def go():
        async with ScriptedServer(tokens=3, first_s=0.05, gap_s=0.02) as srv:
            return await run_load(specs, RequestOptions(url=srv.url, model="m"), shape, time_limit_s=30,
                                  progress=False)

    results, _, not_sent = asyncio.run(go())
    assert not_sent == 0 and all(r.success for r in results)
    for i, s in enumerate(specs):
        if s.after is not None:
            prev = results[s.after]
            assert results[i].start >= prev.start + prev.e2e + 0.04
