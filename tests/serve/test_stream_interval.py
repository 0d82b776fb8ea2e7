"""``lserve serve --stream-interval N``: a stream's tokens sent in fewer, larger chunks, nothing lost.

The buffering rule on its own (:class:`~lserve.serve.stream_interval.ChunkBuffer`), an engine
replica in this process (its events against the engine's own outputs, and an engine that dies
while tokens are held), and a real ``lserve serve --stream-interval 4`` read with the ``openai``
client: streamed text equals the non-streamed text and the engine's greedy text, the first chunk
carries one token and the others at least four, also for chat with ``n=2``.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import tempfile
import time
import weakref

import openai
import pytest
from ports import free_port
from test_shutdown import served

from lserve.cli import main as lserve_main
from lserve.engine.sequence import RequestOutput
from lserve.serve.stream_interval import ChunkBuffer

PROMPT = "The three most important ideas in computer science are"


# -- the buffering rule ----------------------------------------------------------------------------
def _outputs(steps: list[list[int]], logprobs: bool = True) -> list[RequestOutput]:
    """Snapshots of one request whose engine steps produced ``steps`` (token ids per step); token
    ``t`` reads ``<t>``, its logprob is ``-t``; the last snapshot finishes it."""
    out, ids = [], []
    for i, new in enumerate(steps):
        ids = ids + new
        last = i == len(steps) - 1
        lps = [(t, -float(t), ()) for t in new] if logprobs else None
        out.append(RequestOutput("r", [1, 2], list(ids), "".join(f"<{t}>" for t in ids),
                                 "".join(f"<{t}>" for t in new), list(new), last, "length" if last else None,
                                 {"step": i}, None, lps))
    return out


def _buffered(outputs: list[RequestOutput], interval: int) -> list[RequestOutput]:
    buf = ChunkBuffer(interval)
    sent = [d for d in (buf.add(o) for o in outputs) if d is not None]
    assert buf.flush() is None  # the finishing output took everything with it
    return sent


@pytest.mark.parametrize("interval", [1, 2, 3, 4, 7, 100])
def test_chunks_carry_every_token_in_order(interval):
    steps = [[10 + i] for i in range(11)]  # one token per step, as the engine makes them
    outs = _outputs(steps)
    sent = _buffered(outs, interval)
    sizes = [len(s.delta_token_ids) for s in sent]
    assert "".join(s.delta_text for s in sent) == outs[-1].text
    assert [t for s in sent for t in s.delta_token_ids] == outs[-1].token_ids
    assert [lp for s in sent for lp in s.delta_logprobs] == [(t, -float(t), ()) for t in outs[-1].token_ids]
    # the first token at once, then exactly `interval` per chunk, the finish with what is left
    assert sizes[0] == 1 and all(n == interval for n in sizes[1:-1]) and 1 <= sizes[-1] <= interval
    assert len(sent) == 1 + math.ceil(10 / interval)
    assert sent[-1].finished and sent[-1].finish_reason == "length" and sent[-1].metrics == {"step": 10}
    assert all(not s.finished for s in sent[:-1])


def test_a_multi_token_output_counts_all_its_tokens():
    # outputs the engine already merged (a slow consumer): a chunk is due once >= interval are pending
    outs = _outputs([[1, 2], [3], [4, 5, 6, 7, 8], [9], [10], [11]])
    sent = _buffered(outs, 4)
    assert [s.delta_token_ids for s in sent] == [[1, 2], [3, 4, 5, 6, 7, 8], [9, 10, 11]]


def test_held_outputs_are_flushed_and_a_finish_goes_at_once():
    outs = _outputs([[5], [6], [7], [8]], logprobs=False)
    buf = ChunkBuffer(10)
    assert buf.add(outs[0]) is outs[0]  # the first token: at once
    assert buf.add(outs[1]) is None and buf.add(outs[2]) is None
    held = buf.flush()  # an error: what is held goes out first
    assert held.delta_token_ids == [6, 7] and held.delta_text == "<6><7>" and held.delta_logprobs is None
    assert buf.flush() is None
    assert buf.add(outs[3]).finished  # a finishing output is due whatever is pending


def test_a_request_nobody_streams_gets_its_first_tokens_and_its_finish():
    outs = _outputs([[10 + i] for i in range(9)])
    sent = _buffered(outs, None)
    assert [s.delta_token_ids for s in sent] == [[10], list(range(11, 19))] and sent[-1].finished
    assert "".join(s.delta_text for s in sent) == outs[-1].text


def test_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="interval must be >= 1"):
        ChunkBuffer(0)
    with pytest.raises(ValueError, match="min_gap_s must be >= 0"):
        ChunkBuffer(1, -0.001)


@pytest.mark.parametrize("interval, step_ms, sizes", [
    (1, 5, [1, 4, 4, 2]),      # 5 ms steps, a 20 ms floor: a chunk every fourth step
    (1, 30, [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),  # steps slower than the floor: nothing held
    (3, 10, [1, 3, 3, 3, 1]),  # both bounds: 3 tokens and 20 ms (the tokens bind)
    (2, 5, [1, 4, 4, 2]),      # both bounds: the time binds
])
def test_a_time_floor_spaces_chunks_and_holds_nothing_when_steps_are_slower(interval, step_ms, sizes):
    clock = iter(i * step_ms / 1e3 for i in range(100))  # an output every step_ms, one token each
    outs = _outputs([[10 + i] for i in range(11)])
    buf = ChunkBuffer(interval, min_gap_s=0.020, clock=lambda: next(clock))
    sent = [d for d in (buf.add(o) for o in outs) if d is not None]
    assert [len(s.delta_token_ids) for s in sent] == sizes and buf.flush() is None
    assert [t for s in sent for t in s.delta_token_ids] == outs[-1].token_ids and sent[-1].finished


# -- an engine replica in this process --------------------------------------------------------------
@pytest.fixture
def replica_of(monkeypatch, tmp_path):
    """``replica_of(interval)``: an engine replica of the default model on the CPU (stopped after the test)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from lserve.bench.host_step import make_replica

    made = []

    def make(interval: int, interval_ms: float = 0.0):
        made.append(make_replica(4, stream_interval=interval, stream_interval_ms=interval_ms))
        return made[-1]

    yield make
    for r in made:
        r.shutdown()


def test_a_replica_shut_down_is_freed_with_its_engine(monkeypatch, tmp_path):
    """``shutdown()`` stops the metrics poller, whose thread holds the replica: dropping it then frees
    its engine (the fixture above and ``lserve bench host-step`` make one per call)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from lserve.bench.host_step import make_replica

    replica = make_replica(4)
    freed = weakref.ref(replica.engine.engine)
    replica.shutdown()
    del replica
    assert freed() is None


async def _events(agen) -> list[dict]:
    return [ev async for ev in agen]


def test_replica_events_are_the_engines_outputs_merged(replica_of):
    from lserve.engine.sampling import SamplingParams

    replica = replica_of(3)
    params = {"max_tokens": 11, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    events = asyncio.run(_events(replica.generate({"request_id": "a", "prompt": PROMPT, "params": params})))
    deltas = [e for e in events if e["type"] == "delta"]
    assert events[0]["type"] == "accepted" and len(deltas) == len(events) - 1

    async def engine_outputs():  # interval 1's truth: the engine's own snapshots of the same request
        ids = replica.engine.encode(PROMPT)
        return [o async for o in replica.engine.generate(ids, SamplingParams(**params))]

    outs = asyncio.run(engine_outputs())
    final = outs[-1]
    assert "".join(d["text"] for d in deltas) == final.text
    assert [e[1] for d in deltas for e in d["logprobs"]] == pytest.approx([lp for _, lp, _ in final.logprobs])
    sizes = [d["num_tokens"] for d in deltas]
    assert sum(sizes) == 11 and sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1])
    assert len(deltas) <= 1 + math.ceil(10 / 3)
    assert [len(d["logprobs"]) for d in deltas] == sizes
    assert deltas[-1]["finished"] and deltas[-1]["completion_tokens"] == 11 and deltas[-1]["finish_reason"] == "length"


def test_a_request_the_client_does_not_stream_is_two_events(replica_of):
    """``"stream": False`` (the ingress's non-streaming completions): the replica sends the first
    tokens and the finish, whatever the interval, with every token and logprob in them."""
    replica = replica_of(1)
    params = {"max_tokens": 9, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    run = {}
    for stream in (True, False):
        req = {"request_id": "a", "prompt": PROMPT, "params": params, "stream": stream}
        run[stream] = [e for e in asyncio.run(_events(replica.generate(req))) if e["type"] == "delta"]
    assert len(run[True]) > 2 and [d["num_tokens"] for d in run[False]] == [1, 8]
    for key in ("text", "logprobs"):
        assert [x for d in run[False] for x in d[key]] == [x for d in run[True] for x in d[key]]


def test_a_replica_with_a_time_floor_holds_tokens_until_it_passes(replica_of):
    """``stream_interval_ms`` from the replica's settings: with a floor longer than the request, the
    first token goes at once and everything else with the finish."""
    replica = replica_of(1, 10_000)
    req = {"request_id": "t", "prompt": PROMPT, "params": {"max_tokens": 9, "temperature": 0, "ignore_eos": True}}
    deltas = [e for e in asyncio.run(_events(replica.generate(req))) if e["type"] == "delta"]
    assert [d["num_tokens"] for d in deltas] == [1, 8] and deltas[-1]["finished"]


def test_an_engine_death_sends_the_held_tokens_then_the_error(replica_of):
    replica = replica_of(1000)
    request = {"request_id": "k", "prompt": PROMPT, "params": {"max_tokens": 400, "temperature": 0,
                                                               "ignore_eos": True}}

    async def go() -> list[dict]:
        agen = replica.generate(request)
        got = [await agen.__anext__(), await agen.__anext__()]  # accepted, then the first token at once
        steps0 = replica.engine_stats()["steps"]
        nxt = asyncio.ensure_future(agen.__anext__())  # consumes (and holds) the engine's outputs
        deadline = time.monotonic() + 60
        while replica.engine_stats()["steps"] < steps0 + 4:
            assert time.monotonic() < deadline and not nxt.done()
            await asyncio.sleep(0.01)
        replica.kill_engine()
        got.append(await nxt)
        got += [ev async for ev in agen]
        return got

    accepted, first, held, *rest = asyncio.run(go())
    assert accepted["type"] == "accepted" and first["num_tokens"] == 1
    assert held["type"] == "delta" and held["num_tokens"] >= 3 and not held["finished"]
    assert held["completion_tokens"] == 1 + held["num_tokens"]  # nothing lost between the two
    assert [e["type"] for e in rest] == ["error"] and rest[0]["status"] == 503


# -- the command line --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_stream_interval_is_one_line(value, capsys):
    assert lserve_main(["serve", "--stream-interval", value, "--port", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: stream_interval must be an integer >= 1"), err


@pytest.mark.parametrize("value", ["-1", "10001"])
def test_bad_stream_interval_ms_is_one_line(value, capsys):
    assert lserve_main(["serve", "--stream-interval-ms", value, "--port", "9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lserve: error: stream_interval_ms must be in 0..10000"), err
    with pytest.raises(SystemExit) as e:  # not a number: argparse's usage line and message
        lserve_main(["serve", "--stream-interval-ms", "soon", "--port", "9"])
    assert e.value.code == 2 and "invalid float value: 'soon'" in capsys.readouterr().err


# -- a real server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def si_server(tmp_path_factory):
    """``lserve serve --stream-interval 4 --stream-interval-ms 1`` (default model, one CPU replica; its
    steps take far more than 1 ms, so the token count binds): its OpenAI client."""
    port, log = free_port(), tmp_path_factory.mktemp("si") / "server.log"
    ray_tmp = tempfile.mkdtemp(prefix="lsi-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("LSERVE_API_KEY", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, LSERVE_LOG="WARNING")
    cmd = [sys.executable, "-m", "lserve.cli", "serve", "--port", str(port), "--device", "cpu", "--replicas", "1",
           "--max-num-seqs", "4", "--max-cache-tokens", "4096", "--max-model-len", "2048", "--token-budget", "0",
           "--shutdown-grace-s", "1", "--stream-interval", "4", "--stream-interval-ms", "1"]  # steps >> 1 ms
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with served(proc, url, log, ray_tmp):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        yield c, c.models.list().data[0].id


@pytest.fixture(scope="module")
def greedy_text(smol):
    """The engine's own greedy text of :data:`PROMPT` (``n`` tokens), in this process."""
    from lserve.config import EngineConfig
    from lserve.engine import LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="default", max_model_len=2048), smol)
    return lambda n: engine.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text


def test_streamed_completion_comes_in_chunks_of_four(si_server, greedy_text):
    c, model = si_server
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 13, "temperature": 0, "logprobs": 1,
          "extra_body": {"ignore_eos": True}}
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    sizes = [len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices and ch.choices[0].logprobs
             and ch.choices[0].logprobs.tokens]
    whole = c.completions.create(**kw)
    assert "".join(texts) == whole.choices[0].text == greedy_text(13)
    assert [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == \
        whole.choices[0].logprobs.tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 13 == sum(sizes)
    # the first token at once, then at least four per chunk (more where the engine's outputs queued)
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and 2 <= len(sizes) <= 1 + math.ceil(12 / 4)


def test_streamed_chat_with_two_choices_equals_the_whole_answer(si_server):
    c, model = si_server
    kw = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10,
          "temperature": 0.8, "seed": 7, "n": 2, "extra_body": {"ignore_eos": True}}
    parts: dict[int, list[str]] = {0: [], 1: []}
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            if choice.delta.content:
                parts[choice.index].append(choice.delta.content)
    whole = c.chat.completions.create(**kw)
    assert ["".join(parts[i]) for i in (0, 1)] == [ch.message.content for ch in sorted(whole.choices,
                                                                                         key=lambda x: x.index)]
    assert whole.usage.completion_tokens == 20
    assert all(len(p) <= 1 + math.ceil(9 / 4) for p in parts.values()), parts
