"""The load generator's parts: datasets, arrival schedules, statistics, the CLI, and request timing.

Request timing is checked against a small SSE server written here (on 127.0.0.1) whose token
delays are known, so TTFT and ITL can be compared with what was sent; the real server is loaded
in test_serve_observability.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from deploy_helpers import REPO

from load_tests.cli import build_parser, check_loopback, load_shape
from load_tests.client import RequestOptions, RequestResult, send_request
from load_tests.datasets import RequestSpec, load_tokenizer, passkey_dataset, random_dataset, shared_prefix_dataset
from load_tests.runner import LoadShape, run_load
from load_tests.stats import describe_ms, meets_slos, parse_slos, summarize


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level tokenizer (every byte one token, one special token), saved as tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = i + 1
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    t.save(str(path))
    return load_tokenizer(str(path))


# -- datasets -----------------------------------------------------------------------------------
def test_tokenizer_loads_from_a_json_file(tok):
    assert tok.vocab_size == 257 and tok.special_ids == {0}
    assert tok.decode(tok.encode("pass key 42")) == "pass key 42"


def test_random_prompts_have_exact_lengths_and_no_special_tokens(tok):
    specs = random_dataset(tok, 20, input_len=100, output_len=10, seed=3)
    assert all(s.input_len == len(s.prompt) == 100 and s.output_len == 10 for s in specs)
    assert not any(t in tok.special_ids for s in specs for t in s.prompt)
    assert len({tuple(s.prompt) for s in specs}) == 20
    again = random_dataset(tok, 20, input_len=100, output_len=10, seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in specs]
    varied = random_dataset(tok, 200, input_len=100, output_len=10, range_ratio=0.5, seed=1)
    lens = [s.input_len for s in varied]
    assert 50 <= min(lens) < 70 and 130 < max(lens) <= 150


def test_shared_prefix_prompts_share_exactly_their_prefix(tok):
    specs = shared_prefix_dataset(tok, 9, prefix_len=64, num_prefixes=3, input_len=16, output_len=4, seed=0)
    assert [s.group for s in specs] == [0, 1, 2] * 3
    assert all(len(s.prompt) == s.input_len == 80 for s in specs)
    for s in specs:
        same = [o for o in specs if o.group == s.group]
        assert all(o.prompt[:64] == s.prompt[:64] for o in same)
        assert all(o.prompt[64:] != s.prompt[64:] for o in same if o is not s)
    assert len({tuple(s.prompt[:64]) for s in specs}) == 3


def test_passkey_prompts_carry_their_answers(tok):
    specs = passkey_dataset(tok, 3, context_len=600, output_len=8, seed=1)
    assert [s.meta["depth"] for s in specs] == [0.0, 0.5, 1.0]
    keys = [s.answer for s in specs]
    assert len(set(keys)) == 3 and all(k.isdigit() and len(k) == 5 for k in keys)
    for s in specs:
        text = tok.decode(s.prompt)
        assert f"The pass key is {s.answer}." in text and text.endswith("What is the pass key? The pass key is")
        assert abs(s.input_len - 600) <= 1
    as_text = passkey_dataset(tok, 1, context_len=600, seed=1, as_text=True)[0]
    assert isinstance(as_text.prompt, str) and as_text.answer in as_text.prompt


@pytest.mark.parametrize("bad", [dict(num=0), dict(input_len=0), dict(range_ratio=1.0)])
def test_dataset_arguments_are_checked(tok, bad):
    kwargs = dict(num=2, input_len=8, output_len=2, range_ratio=0.0) | bad
    with pytest.raises(ValueError):
        random_dataset(tok, **kwargs)


# -- arrivals -----------------------------------------------------------------------------------
def test_poisson_arrivals_have_the_asked_rate():
    times = LoadShape("poisson", rate=4.0, seed=7).arrival_times(4000)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps > 0)
    assert abs(gaps.mean() - 0.25) < 0.02  # exponential gaps: mean 1/rate, std 1/rate
    assert abs(gaps.std() - 0.25) < 0.03
    assert LoadShape("poisson", rate=4.0, seed=7).arrival_times(10) == times[:10]
    assert LoadShape("burst").arrival_times(5) == [0.0] * 5


@pytest.mark.parametrize("kwargs", [dict(mode="poisson", rate=0.0), dict(mode="concurrency", concurrency=0),
                                    dict(mode="waves")])
def test_bad_load_shapes_are_refused(kwargs):
    with pytest.raises(ValueError):
        LoadShape(**kwargs)


# -- statistics ---------------------------------------------------------------------------------
def _result(i, ttft, e2e, out, itl=None, ok=True, answer_ok=None):
    return RequestResult(index=i, success=ok, error="" if ok else "HTTP 503: busy", start=float(i), ttft=ttft, e2e=e2e,
                         itl=itl or [], input_len=10, output_tokens=out, answer_ok=answer_ok)


def test_describe_matches_numpy():
    vals = [0.1, 0.2, 0.3, 0.4, 1.0]
    d = describe_ms(vals)
    assert d["count"] == 5 and d["mean"] == pytest.approx(400.0) and d["max"] == pytest.approx(1000.0)
    assert d["p50"] == pytest.approx(300.0) and d["p90"] == pytest.approx(np.percentile(vals, 90) * 1000, abs=1e-3)
    assert describe_ms([])["p99"] is None


def test_summary_throughput_tpot_and_goodput():
    results = [
        _result(0, ttft=0.5, e2e=1.5, out=11, itl=[0.1] * 10),   # TPOT 100 ms
        _result(1, ttft=2.5, e2e=3.5, out=11, itl=[0.1] * 10),   # misses the TTFT SLO
        _result(2, ttft=0.5, e2e=2.5, out=5, itl=[0.5] * 4),     # TPOT 500 ms: misses the TPOT SLO
        _result(3, ttft=0.3, e2e=0.3, out=1),                    # no TPOT: passes it
        _result(4, ttft=0, e2e=0.01, out=0, ok=False),
    ]
    s = summarize(results, duration_s=10.0, slos_ms=parse_slos(["ttft:1000", "tpot:200"]))
    assert (s["sent"], s["successful"], s["failed"]) == (5, 4, 1)
    assert s["errors"] == [{"error": "HTTP 503: busy", "count": 1}]
    assert s["output_tokens"] == 28 and s["input_tokens"] == 40
    assert s["request_throughput"] == pytest.approx(0.4) and s["output_token_throughput"] == pytest.approx(2.8)
    assert s["total_token_throughput"] == pytest.approx(6.8)
    assert s["tpot_ms"]["count"] == 3 and s["tpot_ms"]["mean"] == pytest.approx((100 + 100 + 500) / 3, abs=1e-3)
    assert s["itl_ms"]["count"] == 24
    assert s["goodput"]["good_requests"] == 2 and s["goodput"]["goodput_rps"] == pytest.approx(0.2)
    assert s["goodput"]["good_fraction"] == pytest.approx(0.4)
    assert "answers" not in s


def test_itl_and_e2e_slos_and_answers():
    r = _result(0, ttft=0.1, e2e=1.0, out=4, itl=[0.1, 0.6, 0.2], answer_ok=True)
    assert meets_slos(r, {"e2e": 1000.0}) and not meets_slos(r, {"e2e": 999.0})
    assert not meets_slos(r, {"itl": 500.0}) and meets_slos(r, {"itl": 600.0})
    # three events of four tokens each (a server's --stream-interval 4): a 400 ms gap is 100 ms a token
    chunked = RequestResult(index=5, success=True, ttft=0.1, e2e=1.0, itl=[0.4, 0.3], output_tokens=12, chunks=3)
    assert meets_slos(chunked, {"itl": 100.0}) and not meets_slos(chunked, {"itl": 99.0})
    s = summarize([r, _result(1, 0.1, 1.0, 4, answer_ok=False), _result(2, 0, 0.1, 0, ok=False, answer_ok=False)], 2.0)
    assert s["answers"] == {"checked": 3, "correct": 1, "accuracy": pytest.approx(1 / 3, abs=1e-4)}


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "latency:5", "ttft:-1", "tpot:inf", "e2e:abc"])
def test_bad_slos_are_refused(bad):
    with pytest.raises(ValueError):
        parse_slos([bad])


# -- CLI ----------------------------------------------------------------------------------------
def test_help_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "load_tests", "--help"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0
    for flag in ("--request-rate", "--concurrency", "--burst", "--dataset", "--slo", "--time-limit", "--out"):
        assert flag in r.stdout


def test_remote_targets_are_refused_without_a_flag():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    check_loopback("http://[::1]:8000")
    with pytest.raises(ValueError, match="allow-remote"):
        check_loopback("http://10.1.2.3:8000")
    r = subprocess.run([sys.executable, "-m", "load_tests", "--base-url", "http://192.0.2.10:8000", "--no-progress"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "non-loopback" in r.stderr


def test_load_shape_flags():
    p = build_parser()
    assert load_shape(p.parse_args([])).mode == "poisson"
    assert load_shape(p.parse_args(["--request-rate", "3"])).rate == 3.0
    assert load_shape(p.parse_args(["--concurrency", "4"])).concurrency == 4
    assert load_shape(p.parse_args(["--burst", "--max-concurrency", "2"])).mode == "burst"
    with pytest.raises(SystemExit):
        p.parse_args(["--burst", "--concurrency", "2"])


# -- request timing against a scripted SSE server -----------------------------------------------
class ScriptedServer:
    """aiohttp server on 127.0.0.1: ``first_s`` before the first token, then a token every ``gap_s``."""

    def __init__(self, tokens=5, first_s=0.2, gap_s=0.05, status=200, error_after=None, per_event=1):
        self.tokens, self.first_s, self.gap_s, self.status, self.error_after = tokens, first_s, gap_s, status, error_after
        self.per_event = per_event  # tokens per text event after the first (a server's --stream-interval)
        self.bodies: list[dict] = []

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "at capacity", "type": "server_overloaded"}},
                                     status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.first_s)
        starts = [0, *range(1, self.tokens, self.per_event)]
        for i, (a, b) in enumerate(zip(starts, [*starts[1:], self.tokens])):
            if i:
                await asyncio.sleep(self.gap_s)
            if self.error_after is not None and i == self.error_after:
                await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
                return resp
            text = "".join(f"t{t} " for t in range(a, b))
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": self.tokens}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def __aenter__(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def _spec(answer=None):
    return RequestSpec(prompt=[5, 6, 7], input_len=3, output_len=5, kind="random", answer=answer)


def test_client_measures_ttft_and_itl():
    async def go():
        import aiohttp

        async with ScriptedServer(tokens=5, first_s=0.3, gap_s=0.1) as srv, aiohttp.ClientSession() as session:
            opts = RequestOptions(url=srv.url, model="m")
            r = await send_request(session, opts, _spec(), 0, t0=0.0)
            return r, srv.bodies[0]

    r, body = asyncio.run(go())
    assert r.success and r.error == "" and r.output_tokens == 5 and r.input_len == 7
    assert r.text == "t0 t1 t2 t3 t4 "
    assert 0.3 <= r.ttft < 1.5
    assert len(r.itl) == 4 and all(0.09 <= g < 0.6 for g in r.itl)
    assert r.e2e >= r.ttft + sum(r.itl) - 1e-6
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 4)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 5 and body["ignore_eos"] is True


def test_multi_token_events_are_one_arrival_each_and_tokens_come_from_usage():
    # a server streaming 4 tokens per event after the first (--stream-interval 4): 9 tokens, 3 events
    async def go():
        import aiohttp

        async with ScriptedServer(tokens=9, first_s=0.2, gap_s=0.1, per_event=4) as srv, \
                aiohttp.ClientSession() as session:
            return await send_request(session, RequestOptions(url=srv.url, model="m"), _spec(), 0, t0=0.0)

    r = asyncio.run(go())
    assert r.success and r.output_tokens == 9 and r.chunks == 3
    assert r.text == "".join(f"t{i} " for i in range(9))
    assert len(r.itl) == 2 and all(0.09 <= g < 0.6 for g in r.itl)  # gaps between events, as vLLM's bench
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 8)  # per token, from usage
    s = summarize([r], 1.0)
    assert s["output_tokens"] == 9 and s["tokens_per_chunk"] == 3.0


def test_client_records_http_and_stream_errors_and_answers():
    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with ScriptedServer(status=429) as srv:
                busy = await send_request(session, RequestOptions(url=srv.url, model="m"), _spec(), 0, 0.0)
            async with ScriptedServer(tokens=4, first_s=0.01, gap_s=0.01, error_after=2) as srv:
                broken = await send_request(session, RequestOptions(url=srv.url, model="m"), _spec(), 1, 0.0)
            async with ScriptedServer(tokens=3, first_s=0.01, gap_s=0.01) as srv:
                right = await send_request(session, RequestOptions(url=srv.url, model="m"), _spec("t1"), 2, 0.0)
                wrong = await send_request(session, RequestOptions(url=srv.url, model="m"), _spec("99999"), 3, 0.0)
                passkey_body = srv.bodies[0]
        return busy, broken, right, wrong, passkey_body

    busy, broken, right, wrong, passkey_body = asyncio.run(go())
    assert not busy.success and busy.error == "HTTP 429: at capacity"
    assert not broken.success and broken.error == "stream error: engine died"
    assert right.success and right.answer_ok is True
    assert wrong.success and wrong.answer_ok is False
    assert "ignore_eos" not in passkey_body  # a passkey answer may end the text


@pytest.mark.parametrize("shape", [LoadShape("concurrency", concurrency=2), LoadShape("burst"),
                                   LoadShape("poisson", rate=50.0, concurrency=2, seed=1)])
def test_run_load_sends_every_request(shape):
    async def go():
        async with ScriptedServer(tokens=3, first_s=0.05, gap_s=0.02) as srv:
            specs = [_spec() for _ in range(6)]
            return await run_load(specs, RequestOptions(url=srv.url, model="m"), shape, time_limit_s=30, progress=False)

    results, duration, not_sent = asyncio.run(go())
    assert [r.index for r in results] == list(range(6)) and all(r.success for r in results)
    assert not_sent == 0 and duration > 0.05
    if shape.mode == "concurrency":  # two clients back to back: three rounds of ~0.09 s
        assert duration >= 0.25


def test_time_limit_cancels_in_flight_requests_and_stops_sending():
    async def go():
        async with ScriptedServer(tokens=50, first_s=0.05, gap_s=0.1) as srv:  # 5 s per request
            specs = [_spec() for _ in range(4)]
            shape = LoadShape("poisson", rate=1.0, seed=0)  # arrivals at 0 s and ~1 s later
            return await run_load(specs, RequestOptions(url=srv.url, model="m"), shape, time_limit_s=1.0,
                                  progress=False)

    results, duration, not_sent = asyncio.run(go())
    assert results and all(not r.success and r.error == "cancelled at the time limit" for r in results)
    assert not_sent == 4 - len(results) and not_sent >= 1
    assert math.isfinite(duration) and duration <= 2.0
