"""Tokenizers behind one small interface: a Hugging Face tokenizer, bytes, or bytes plus words for presets."""

from __future__ import annotations


def encode_prompt(tokenizer, prompt, chat: bool = False) -> list[int]:
    """Token ids of a text prompt, a token list, or chat messages (with the chat template).

    The one tokenization rule of the engine and of the router's prefix keys.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return tokenizer.apply_chat_template(prompt)
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


class HFTokenizer:
    """Wraps a ``transformers`` tokenizer (from a model directory or a GGUF file)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = len(tok)
        eos = tok.eos_token_id
        self.eos_token_ids = () if eos is None else (int(eos),)
        self.has_chat_template = bool(getattr(tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Prompt ids for a chat, with the assistant turn opened."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def save(self, path) -> None:
        self.tok.save_pretrained(str(path))


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255), plus BOS=256 and EOS=257: for random-weight presets."""

    BOS, EOS = 256, 257
    has_chat_template = True

    def __init__(self, vocab_size: int = 258) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.BOS] * add_special_tokens + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


def _word(i: int) -> str:
    """Bijective base-26 letters: 0 -> 'a', 25 -> 'z', 26 -> 'aa', ..."""
    out = []
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out.append(chr(97 + r))
    return "".join(reversed(out))


class PresetTokenizer(ByteTokenizer):
    """The tokenizer of random-weight presets: prompts are UTF-8 bytes (as :class:`ByteTokenizer`),
    and every id a model can generate decodes to text on its own.

    Printable ASCII bytes (and newline, tab) decode to themselves; every other id (control and
    non-ASCII bytes, which alone are no UTF-8 text, and ids past the bytes, which a model with a
    128k vocabulary samples nearly always) decodes to a space and a letter word unique to it.
    So a streaming client sees one non-empty text chunk per generated token.
    """

    def decode(self, ids: list[int]) -> str:
        parts = []
        for i in ids:
            if i in (self.BOS, self.EOS):
                continue
            parts.append(chr(i) if 32 <= i < 127 or i in (9, 10) else " " + _word(i))
        return "".join(parts)
