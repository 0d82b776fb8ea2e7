"""Summary statistics of a run: throughput, latency percentiles and goodput under SLOs.

Definitions (all latencies over successful requests only):

* TTFT: send to first text event; E2E: send to end of stream;
* TPOT: ``(E2E - TTFT) / (output tokens - 1)`` per request with at least two output tokens;
* ITL: every gap between consecutive text events, pooled over all requests;
* throughput: successful requests, output tokens and prompt + output tokens per second of the
  run's duration (first send to last completion);
* goodput: successful requests per second that met every SLO given (a request with one output
  token has no TPOT and passes a TPOT SLO).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from load_tests.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """SLOs in milliseconds from ``metric:ms`` strings.

    Parameters
    ----------
    items : list of str
        E.g. ``["ttft:2000", "tpot:100"]``. ``itl`` bounds a request's worst inter-token gap.

    Returns
    -------
    dict
        Metric name to milliseconds.

    Raises
    ------
    ValueError
        For an unknown metric, a missing value or a value that is not > 0.
    """
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"an SLO is METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"SLO {item!r} must be a positive number of milliseconds")
        out[name] = ms
    return out


def describe_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """Mean, standard deviation, min, max and percentiles of seconds, in milliseconds.

    Parameters
    ----------
    values_s : list of float
        Seconds.

    Returns
    -------
    dict
        ``count``, ``mean``, ``std``, ``min``, ``p50``, ``p90``, ``p99``, ``max`` (None when empty).
    """
    if not values_s:
        return {"count": 0, "mean": None, "std": None, "min": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | int | None] = {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()),
                                          "min": float(a.min())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    out["max"] = float(a.max())
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether one successful request met every SLO.

    Parameters
    ----------
    r : RequestResult
    slos_ms : dict
        From :func:`parse_slos`.

    Returns
    -------
    bool
    """
    if not r.success:
        return False
    # ITL per token: a server streaming several tokens per event (--stream-interval) spaces its
    # events further apart; each gap is shared out over the request's tokens per event
    per_event = r.output_tokens / r.chunks if r.chunks and r.output_tokens > r.chunks else 1.0
    checks = {"ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot, "itl": max(r.itl) / per_event if r.itl else None}
    for name, limit in slos_ms.items():
        value = checks[name]
        if value is not None and value * 1000.0 > limit:
            return False
    return True


def summarize(results: list[RequestResult], duration_s: float, slos_ms: dict[str, float] | None = None,
              not_sent: int = 0) -> dict:
    """The report's ``results`` block.

    Parameters
    ----------
    results : list of RequestResult
        Every request that was sent.
    duration_s : float
        First send to last completion.
    slos_ms : dict, optional
        From :func:`parse_slos`; goodput counts requests meeting all of them.
    not_sent : int
        Requests of the dataset that the time limit kept from being sent.

    Returns
    -------
    dict
    """
    slos_ms = slos_ms or {}
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    in_tok = sum(r.input_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    good = [r for r in ok if meets_slos(r, slos_ms)]
    errors = Counter(r.error for r in failed)
    out = {
        "sent": len(results), "successful": len(ok), "failed": len(failed), "not_sent": not_sent,
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(10)],
        "duration_s": round(duration_s, 3),
        "input_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": round(len(ok) / duration_s, 4),
        "output_token_throughput": round(out_tok / duration_s, 3),
        "total_token_throughput": round((in_tok + out_tok) / duration_s, 3),
        "ttft_ms": describe_ms([r.ttft for r in ok]),
        "tpot_ms": describe_ms([t for t in (r.tpot for r in ok) if t is not None]),
        "itl_ms": describe_ms([x for r in ok for x in r.itl]),
        # > 1 when the server streams several tokens per event: ITL is then per event
        "tokens_per_chunk": round(out_tok / chunks, 3) if chunks else None,
        "e2e_ms": describe_ms([r.e2e for r in ok]),
        "goodput": {"slos_ms": dict(slos_ms), "good_requests": len(good),
                    "goodput_rps": round(len(good) / duration_s, 4),
                    "good_fraction": round(len(good) / len(results), 4) if results else 0.0},
    }
    checked = [r for r in results if r.answer_ok is not None]
    if checked:
        correct = sum(1 for r in checked if r.answer_ok)
        out["answers"] = {"checked": len(checked), "correct": correct, "accuracy": round(correct / len(checked), 4)}
    return out
