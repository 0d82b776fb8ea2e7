"""The reasoning workload of the load generator (long prompts, long outputs, Poisson arrivals),
and runs that send for a while and then let the requests in flight finish."""

from __future__ import annotations

import asyncio

import pytest
from test_load_tests import ScriptedServer, tok  # noqa: F401 - the byte tokenizer fixture

from load_tests.cli import build_parser, load_shape, make_dataset
from load_tests.client import RequestOptions
from load_tests.datasets import reasoning_dataset
from load_tests.runner import LoadShape, run_load


def test_reasoning_prompts_are_long_unique_and_ask_for_long_outputs(tok):  # noqa: F811
    specs = reasoning_dataset(tok, 40, prompt_len=400, output_len=200, prompt_range=0.25, output_range=0.5, seed=5)
    assert all(s.kind == "reasoning" and len(s.prompt) == s.input_len for s in specs)
    assert all(300 <= s.input_len <= 500 and 100 <= s.output_len <= 300 for s in specs)
    assert max(s.output_len for s in specs) - min(s.output_len for s in specs) > 100  # outputs vary
    assert all(s.meta["output_len"] == s.output_len for s in specs)
    assert len({tuple(s.prompt[:64]) for s in specs}) == 40  # no shared prefix
    assert [s.prompt for s in reasoning_dataset(tok, 40, 400, 200, 0.25, 0.5, seed=5)] == [s.prompt for s in specs]
    with pytest.raises(ValueError):
        reasoning_dataset(tok, 4, 400, 200, output_range=1.0)


def test_cli_builds_a_poisson_reasoning_load(tok):  # noqa: F811
    p = build_parser()
    a = p.parse_args(["--dataset", "reasoning", "--tokenizer", tok.source, "--num-prompts", "6",
                      "--reasoning-prompt-len", "300", "--reasoning-output-len", "50", "--request-rate", "0.5"])
    _, specs, info = make_dataset(a)
    assert len(specs) == 6 and info["name"] == "reasoning" and info["output_len"] == 50
    assert all(25 <= s.output_len <= 75 and 225 <= s.input_len <= 375 for s in specs)
    shape = load_shape(a)
    assert shape.mode == "poisson" and shape.rate == 0.5


def test_reasoning_requests_ask_for_their_own_output_lengths(tok):  # noqa: F811
    """Sent with Poisson arrivals to a scripted server: each request's max_tokens is its length."""
    specs = reasoning_dataset(tok, 5, prompt_len=60, output_len=8, output_range=0.5, seed=2)

    async def go():
        async with ScriptedServer(tokens=3, first_s=0.02, gap_s=0.01) as srv:
            res = await run_load(specs, RequestOptions(url=srv.url, model="m"), LoadShape("poisson", rate=50.0, seed=1),
                                 time_limit_s=30, progress=False)
            return res, srv.bodies

    (results, _, not_sent), bodies = asyncio.run(go())
    assert not_sent == 0 and all(r.success for r in results)
    assert sorted(b["max_tokens"] for b in bodies) == sorted(s.output_len for s in specs)


@pytest.mark.parametrize("shape", [LoadShape("concurrency", concurrency=2), LoadShape("poisson", rate=40.0, seed=3)])
def test_send_for_stops_sending_and_lets_requests_finish(shape):
    """``send_for_s``: after it no new request goes out (once ``min_requests`` did), and the ones
    in flight complete instead of being cancelled."""
    from test_load_tests import _spec

    async def go(send_for_s, min_requests):
        async with ScriptedServer(tokens=4, first_s=0.05, gap_s=0.05) as srv:  # ~0.2 s per request
            return await run_load([_spec() for _ in range(200)], RequestOptions(url=srv.url, model="m"), shape,
                                  time_limit_s=30, progress=False, send_for_s=send_for_s, min_requests=min_requests)

    results, duration, not_sent = asyncio.run(go(0.5, 0))
    assert all(r.success for r in results) and 2 <= len(results) < 40
    assert all(r.start < 0.6 for r in results) and duration < 2.0 and not_sent == 200 - len(results)
    results, _, _ = asyncio.run(go(0.0, 12))
    assert len(results) >= 12 and all(r.success for r in results)
