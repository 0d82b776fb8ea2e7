"""The router's prefix keys: chained hashes of a prompt's full token pages, exactly the keys the
engine's prefix cache indexes (:mod:`lserve.cache.page_hash`, same seed and page size), so that
"replica R holds this prefix" means R's cache holds those pages.

The ingress tokenizes with the model's own tokenizer, loaded (without weights) when the ingress
starts, so every request is keyed the same way from the first one (the engine replicas take
longer to start anyway). When it cannot be loaded, routing falls back to hashes of the prompt's
characters (:func:`lserve.serve.router.prefix_hashes`), which still keep a prefix on one replica.
"""

from __future__ import annotations

import logging
from typing import Any

from lserve.cache.page_hash import namespace_seed, page_hashes
from lserve.serve.router import MAX_BLOCKS, prefix_hashes, routing_text

log = logging.getLogger("lserve")


class PrefixKeys:
    """Routing keys of prompts for one deployment.

    Parameters
    ----------
    settings : ServeSettings
        The deployment's settings (model, page size and everything in the hash seed).
    load : bool
        Load the tokenizer (tests of the fallback pass False).
    """

    def __init__(self, settings, load: bool = True) -> None:
        cfg = settings.engine_config()
        self.page_size = cfg.cache.page_size
        self.seed = namespace_seed(cfg.prefix_namespace())
        self.block_chars = settings.prefix_block_chars
        self.model = settings.model
        self.tokenizer = None
        if load and cfg.prefix_cache:
            try:
                from lserve.models.loader import load_tokenizer

                self.tokenizer = load_tokenizer(self.model)
            except Exception as e:  # noqa: BLE001 - routing must work without it
                log.warning("router: no tokenizer for %s (%s); prefix affinity hashes characters", self.model, e)

    def route(self, prompt: str | list, chat: bool = False) -> dict[str, Any]:
        """``{"prefix": [hash, ...], "tokens": n, "block_tokens": b, "keys": "pages" | "chars"}`` for the router."""
        tok = self.tokenizer
        if tok is not None:
            from lserve.models.tokenizer import encode_prompt

            try:
                ids = encode_prompt(tok, prompt, chat)
            except Exception:  # noqa: BLE001 - the replica reports bad prompts; route by characters
                ids = None
            if ids is not None:
                return {"prefix": page_hashes(ids, self.page_size, self.seed, MAX_BLOCKS), "tokens": max(1, len(ids)),
                        "block_tokens": self.page_size, "keys": "pages"}
        text = routing_text(prompt)
        return {"prefix": prefix_hashes(text, self.block_chars), "tokens": max(1, len(text) // 4),
                "block_tokens": self.block_chars // 4, "keys": "chars"}  # ~4 characters a token
