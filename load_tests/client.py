"""One streaming ``POST /v1/completions`` request, timed token by token.

Times are taken with :func:`time.perf_counter` on arrival of each server-sent event that carries
text: the first one gives the time to first token (TTFT), the gaps between later ones the
inter-token latencies (ITL). Output tokens are the server's ``usage.completion_tokens`` (asked for
with ``stream_options.include_usage``), or the number of text events when it sends no usage.
An event that carries several tokens (a server's ``--stream-interval``) is one arrival, as
``vllm bench serve`` counts it: its ITL is the gap between events, while TPOT stays per token.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

from load_tests.datasets import RequestSpec


@dataclass
class RequestResult:
    """What happened to one request; times in seconds.

    Parameters
    ----------
    index : int
        Position in the dataset.
    success : bool
    error : str
        Why it failed ('' on success).
    start : float
        Send time, seconds after the run started.
    ttft, e2e : float
        Time to first token and end-to-end latency (0 when unknown).
    itl : list of float
        Gaps between consecutive text events.
    input_len, output_tokens : int
        Prompt tokens (server's count when reported) and generated tokens.
    chunks : int
        Text events received (fewer than ``output_tokens`` when events carry several tokens).
    text : str
        Generated text.
    answer_ok : bool or None
        Whether the expected answer (passkey) appears in the text; None when nothing is expected.
    """

    index: int
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    input_len: int = 0
    output_tokens: int = 0
    chunks: int = 0
    text: str = ""
    answer_ok: bool | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        """A JSON-able dict (times rounded to microseconds)."""
        d = asdict(self)
        for k in ("start", "ttft", "e2e"):
            d[k] = round(d[k], 6)
        d["itl"] = [round(x, 6) for x in self.itl]
        d["tpot"] = None if self.tpot is None else round(self.tpot, 6)
        return d


@dataclass
class RequestOptions:
    """Request fields shared by every request of a run.

    Parameters
    ----------
    url : str
        Full URL of the completions endpoint.
    model : str
    temperature : float
    ignore_eos : bool
        Ask the server to generate exactly ``max_tokens`` (an LServe/vLLM extension).
    api_key : str or None
    timeout_s : float
        Per-request limit.
    """

    url: str
    model: str
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0

    def headers(self) -> dict[str, str]:
        """HTTP headers of every request (JSON body, SSE answer, bearer token when set).

        Returns
        -------
        dict
        """
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, spec: RequestSpec) -> dict:
        """JSON body of the streaming completion request for ``spec``.

        Parameters
        ----------
        spec : RequestSpec

        Returns
        -------
        dict
        """
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.output_len,
                "temperature": self.temperature, "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos and spec.answer is None:  # passkey answers end the text on their own
            body["ignore_eos"] = True
        return body


async def send_request(session, opts: RequestOptions, spec: RequestSpec, index: int, t0: float) -> RequestResult:
    """Send one request and read its event stream to the end.

    Parameters
    ----------
    session : aiohttp.ClientSession
    opts : RequestOptions
    spec : RequestSpec
    index : int
        Dataset position, copied into the result.
    t0 : float
        :func:`time.perf_counter` at the start of the run (``start`` is relative to it).

    Returns
    -------
    RequestResult
        Never raises for HTTP or network problems: they are recorded as a failure.
    """
    import aiohttp

    res = RequestResult(index=index, input_len=spec.input_len, answer_ok=None if spec.answer is None else False)
    chunks: list[str] = []
    usage_tokens = None
    text_events = 0
    last = None
    sent = time.perf_counter()
    res.start = sent - t0
    try:
        timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
        async with session.post(opts.url, json=opts.body(spec), headers=opts.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                res.error = f"HTTP {resp.status}: {_error_message(body)}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    now = time.perf_counter()
                    for line in event.split(b"\n"):
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        msg = json.loads(payload)
                        if "error" in msg:
                            raise _StreamError(_error_message(json.dumps(msg)))
                        text = "".join(c.get("text") or "" for c in msg.get("choices") or [])
                        if msg.get("usage"):
                            usage_tokens = int(msg["usage"].get("completion_tokens", 0))
                            res.input_len = int(msg["usage"].get("prompt_tokens", res.input_len))
                        if text:
                            text_events += 1
                            if last is None:
                                res.ttft = now - sent
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks.append(text)
        res.e2e = time.perf_counter() - sent
        res.text = "".join(chunks)
        res.output_tokens = usage_tokens if usage_tokens is not None else text_events
        res.chunks = text_events
        if res.output_tokens == 0 or last is None:
            res.error = "the stream ended without any token"
            return res
        res.success = True
        if spec.answer is not None:
            res.answer_ok = spec.answer in res.text
    except _StreamError as e:
        res.error = f"stream error: {e}"
    except asyncio.TimeoutError:
        res.error = f"timed out after {opts.timeout_s:g}s"
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"
    except (ValueError, KeyError) as e:  # malformed JSON in the stream
        res.error = f"bad response: {e}"
    if not res.e2e:  # failed early: time until the failure
        res.e2e = time.perf_counter() - sent
    return res


class _StreamError(Exception):
    pass


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)[:200]
    except (ValueError, AttributeError):
        pass
    return body.strip()[:200]
