"""Time the serving layer's per-request CPU work for a long token-id prompt, stage by stage.

Stages a cached follow-up pays between the client and the engine (no model, no Ray cluster):
JSON parsing of the body, pydantic validation of ``CompletionRequest``, the router's page hashing
(:func:`lserve.cache.page_hash.page_hashes`, as ``PrefixKeys.route`` calls it), the token-list copy
of ``encode_prompt`` and a pickle round trip of the payload (what a Ray handle call serializes).

Usage: ``python scripts/time_serving_path.py --tokens 32768 131072``
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import time

from lserve.cache.page_hash import page_hashes
from lserve.serve.protocol import CompletionRequest
from lserve.serve.router import MAX_BLOCKS


def best_of(fn, repeat: int = 5) -> float:
    """Fastest of ``repeat`` runs of ``fn()``, in seconds (the machine is shared: the minimum is the cost)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def stage_times(ids: list[int], page_size: int) -> dict[str, float]:
    """Milliseconds per stage for one prompt of token ids."""
    seed = bytes(16)
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
    obj = json.loads(body)
    payload = {"prompt": CompletionRequest.model_validate(obj).prompt, "max_tokens": 1}
    rows = {
        "json_loads": best_of(lambda: json.loads(body)),
        "pydantic_validate": best_of(lambda: CompletionRequest.model_validate(obj)),
        "pydantic_validate_json": best_of(lambda: CompletionRequest.model_validate_json(body)),
        "token_list_copy": best_of(lambda: [int(t) for t in ids]),
        "page_hashes": best_of(lambda: page_hashes(ids, page_size, seed, MAX_BLOCKS)),
        "page_hashes_all_pages": best_of(lambda: page_hashes(ids, page_size, seed)),
        "pickle_roundtrip": best_of(lambda: pickle.loads(pickle.dumps(payload))),
    }
    return {"body_bytes": len(body), **{k: round(v * 1e3, 2) for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--page-size", type=int, default=64, help="N_P (the engine default)")
    args = ap.parse_args()
    rng = random.Random(0)
    for n in args.tokens:
        ids = [rng.randrange(128256) for _ in range(n)]
        print(json.dumps({"tokens": n, **stage_times(ids, args.page_size)}))

if __name__ == "__main__":
    main()
