"""Random-weight presets stream text for every token (their tokenizer decodes every id)."""

from __future__ import annotations

from lserve.engine import LLM, SamplingParams
from lserve.models.tokenizer import PresetTokenizer


def test_every_id_decodes_to_its_own_text():
    tok = PresetTokenizer(128256)
    texts = [tok.decode([i]) for i in range(tok.vocab_size) if i not in (tok.BOS, tok.EOS)]
    assert all(texts)
    words = [t for t in texts if t.startswith(" ")]
    assert len(set(words)) == len(words)  # distinct ids, distinct words
    assert tok.decode([72, 105, 300]) == "Hi" + tok.decode([300])
    assert tok.decode(tok.encode("pass key 42")) == "pass key 42"  # prompts round-trip


def test_tiny_preset_streams_one_chunk_per_token():
    llm = LLM("tiny")
    rid = llm.add_request("hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    deltas = []
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id == rid
            deltas.append((out.delta_text, len(out.delta_token_ids)))
    assert sum(n for _, n in deltas) == 12
    assert all(text for text, n in deltas if n)
