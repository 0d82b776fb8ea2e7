"""Engine logprob entries -> token texts and bytes, and OpenAI's two logprobs shapes.

The replica turns the engine's ``(token id, logprob, ((id, logprob), ...))`` entries into
``[text, logprob, bytes, [[text, logprob, bytes], ...]]`` lists (plain JSON, nothing
tokenizer-specific crosses to the ingress); the ingress formats them as completions'
``{tokens, token_logprobs, top_logprobs, text_offset}`` or chat's ``{content: [...]}``.
"""

from __future__ import annotations

from typing import Any

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the model rules out gets this (as vLLM does)

Entry = list  # [text, logprob | None, bytes, [[text, logprob, bytes], ...] | None]


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Token id -> (text, UTF-8 bytes), cached, for logprobs.

    Special tokens keep their text (``<|im_end|>``); a token holding part of a UTF-8 character
    has its exact bytes and U+FFFD in its text.

    Parameters
    ----------
    tokenizer : HFTokenizer or ByteTokenizer
        The engine's tokenizer (:mod:`lserve.models.tokenizer`).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.hf = getattr(tokenizer, "tok", None)
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in repr(decoder)
        self._bytes = _byte_decoder() if self.byte_level else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        got = self._cache.get(token_id)
        if got is None:
            raw = self._raw(token_id)
            got = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return got

    def _raw(self, token_id: int) -> bytes:
        if self.hf is None:  # the byte tokenizer of the presets: ids 0-255 are bytes
            return bytes([token_id]) if token_id < 256 else self.tokenizer.decode([token_id]).encode()
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def entries(self, items, with_top: bool = True) -> list[Entry]:
        """Engine entries (``None`` for the first prompt token, whose id comes from ``items``'
        caller) -> JSON-ready lists."""
        out = []
        for tok, lp, top in items:
            text, raw = self(tok)
            alts = [[*self(t), v] for t, v in top] if top is not None else None
            out.append([text, None if lp is None else max(lp, LOGPROB_FLOOR), raw,
                        None if alts is None else [[a[0], max(a[2], LOGPROB_FLOOR), a[1]] for a in alts]])
        return out


def completion_logprobs(entries: list[Entry], offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI completions' ``logprobs`` object for ``entries``, with text offsets from ``offset``;
    returns it and the offset after the last token. Each ``top_logprobs`` dict holds the
    alternatives and the token itself (vLLM's shape)."""
    tokens, lps, tops, offsets = [], [], [], []
    for text, lp, _, top in entries:
        tokens.append(text)
        lps.append(lp)
        offsets.append(offset)
        offset += len(text)
        if top is None:
            tops.append(None)
        else:
            d = {t: v for t, v, _ in top}
            d.setdefault(text, lp)
            tops.append(d)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """OpenAI chat's ``logprobs`` object (``top_logprobs``: the asked-for alternatives only)."""
    return {"content": [{"token": text, "logprob": lp, "bytes": raw,
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, v, b in top or []]}
                        for text, lp, raw, top in entries]}
