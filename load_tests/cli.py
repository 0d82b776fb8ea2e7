"""``python -m load_tests``: load an OpenAI-compatible server and write an SLO report.

Example (Poisson arrivals at 2 requests/s, random 256-token prompts, 64 output tokens)::

    python -m load_tests --base-url http://127.0.0.1:8000 --dataset random --num-prompts 50 \\
        --input-len 256 --output-len 64 --request-rate 2 --slo ttft:2000 --slo tpot:200 \\
        --out benchmarks/loadtest_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import ipaddress
import json
import os
import shlex
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from load_tests.client import RequestOptions
from load_tests.datasets import (
    chat_dataset,
    doc_qa_dataset,
    load_tokenizer,
    passkey_dataset,
    random_dataset,
    reasoning_dataset,
    shared_prefix_dataset,
)
from load_tests.report import write_json, write_png
from load_tests.runner import LoadShape, run_load
from load_tests.stats import parse_slos, summarize

DATASETS = ("random", "shared-prefix", "doc-qa", "chat", "reasoning", "passkey")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser.

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(
        prog="python -m load_tests",
        description="Async HTTP load generator for OpenAI-compatible servers (streaming /v1/completions): "
                    "TTFT, TPOT, ITL and end-to-end latency percentiles, throughput and goodput under SLOs, "
                    "written as JSON and PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    t.add_argument("--endpoint", default="/v1/completions", help="streaming completions path")
    t.add_argument("--model", default=None, help="model id to send (default: the first one /v1/models lists)")
    t.add_argument("--api-key", default=None,
                   help="bearer token (default: $LSERVE_API_KEY, then $OPENAI_API_KEY)")
    t.add_argument("--allow-remote", action="store_true",
                   help="allow a target that is not a loopback address (refused by default)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random prompts; long prompts sharing prefixes; document QA (N docs x M questions); "
                        "multi-turn chats; reasoning (long prompts, long outputs); passkey prompts with checked answers")
    d.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    d.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens (random) or unique suffix tokens after the prefix (shared-prefix)")
    d.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    d.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    d.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix: tokens of each shared prefix")
    d.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    d.add_argument("--context-len", type=int, default=2048, help="passkey: prompt tokens")
    d.add_argument("--num-docs", type=int, default=8, help="doc-qa: documents")
    d.add_argument("--questions-per-doc", type=int, default=6, help="doc-qa: questions per document")
    d.add_argument("--doc-len", type=int, default=4500, help="doc-qa: mean document tokens")
    d.add_argument("--doc-range", type=float, default=1 / 3, help="doc-qa: lengths uniform in len*(1 +- r)")
    d.add_argument("--question-len", type=int, default=32, help="doc-qa: tokens per question")
    d.add_argument("--conversations", type=int, default=8, help="chat: conversations")
    d.add_argument("--turns", type=int, default=5, help="chat: turns per conversation")
    d.add_argument("--system-len", type=int, default=512, help="chat: system prompt tokens")
    d.add_argument("--user-len", type=int, default=64, help="chat: tokens per user message")
    d.add_argument("--reply-len", type=int, default=128, help="chat: tokens per (fixed) assistant reply in the history")
    d.add_argument("--think-time", type=float, default=1.0, help="chat: seconds between a reply and the next turn")
    d.add_argument("--reasoning-prompt-len", type=int, default=16384, help="reasoning: mean prompt tokens")
    d.add_argument("--reasoning-output-len", type=int, default=2048, help="reasoning: mean output tokens")
    d.add_argument("--reasoning-range", type=float, default=0.5,
                   help="reasoning: output lengths uniform in len*(1 +- r) (prompts: len*(1 +- r/2))")
    d.add_argument("--tokenizer", default="default",
                   help="'default' (the bundled model's), a tokenizer.json, a model directory, a .gguf file or "
                        "preset:VOCAB (LServe's random-weight presets, e.g. preset:128256 for llama3-8b)")
    d.add_argument("--send-text", action="store_true", help="send decoded text instead of token ids")
    d.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    lo = p.add_argument_group("load shape (pick one; default: --request-rate 1)")
    m = lo.add_mutually_exclusive_group()
    m.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests per second")
    m.add_argument("--concurrency", type=int, default=None, help="closed loop: this many clients back to back")
    m.add_argument("--burst", action="store_true", help="send every request at once")
    lo.add_argument("--max-concurrency", type=int, default=0,
                    help="Poisson/burst: cap on requests in flight (0: none)")
    lo.add_argument("--time-limit", type=float, default=600.0,
                    help="seconds; then no new request is sent and the ones in flight are cancelled")
    lo.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    r = p.add_argument_group("requests")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: ask for exactly --output-len tokens)")
    o = p.add_argument_group("report")
    o.add_argument("--slo", action="append", default=[], metavar="METRIC:MS",
                   help="SLO for goodput, repeatable: ttft, tpot, itl (worst gap of a request) or e2e, in ms")
    o.add_argument("--out", default="loadtest.json", help="JSON report path; the PNG goes next to it")
    o.add_argument("--no-png", action="store_true", help="skip the PNG")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--label", default="", help="free text recorded in the report (e.g. the server's settings)")
    return p


def check_loopback(url: str) -> None:
    """Raise ValueError unless every address of ``url``'s host is a loopback address.

    Parameters
    ----------
    url : str
    """
    host = urlparse(url).hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    addrs = {info[4][0] for info in infos}
    bad = sorted(a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if bad:
        raise ValueError(f"{host} resolves to non-loopback address(es) {', '.join(bad)}; "
                         "pass --allow-remote to load a remote server")


def first_model(base_url: str, api_key: str | None, timeout: float = 30.0) -> str:
    """The first model id that ``GET /v1/models`` lists.

    Parameters
    ----------
    base_url : str
    api_key : str or None
    timeout : float

    Returns
    -------
    str
    """
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.load(resp)
    models = [m["id"] for m in data.get("data", [])]
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]


def make_dataset(a: argparse.Namespace):
    """Tokenizer and request specs for the parsed flags.

    Parameters
    ----------
    a : argparse.Namespace

    Returns
    -------
    (Tokenizer, list of RequestSpec, dict)
        The tokenizer, the requests and the dataset settings for the report.
    """
    tok = load_tokenizer(a.tokenizer)
    info = {"name": a.dataset, "num_prompts": a.num_prompts, "output_len": a.output_len, "seed": a.seed,
            "tokenizer": tok.source, "send_text": a.send_text}
    if a.dataset == "random":
        specs = random_dataset(tok, a.num_prompts, a.input_len, a.output_len, a.range_ratio, a.seed, a.send_text)
        info.update(input_len=a.input_len, range_ratio=a.range_ratio)
    elif a.dataset == "shared-prefix":
        specs = shared_prefix_dataset(tok, a.num_prompts, a.prefix_len, a.num_prefixes, a.input_len, a.output_len,
                                      a.seed, a.send_text)
        info.update(prefix_len=a.prefix_len, num_prefixes=a.num_prefixes, suffix_len=a.input_len)
    elif a.dataset == "doc-qa":
        specs = doc_qa_dataset(tok, a.num_docs, a.questions_per_doc, a.doc_len, a.doc_range, a.question_len,
                               a.output_len, a.seed, a.send_text)
        info.update(num_prompts=len(specs), num_docs=a.num_docs, questions_per_doc=a.questions_per_doc,
                    doc_len=a.doc_len, doc_range=a.doc_range, question_len=a.question_len)
    elif a.dataset == "chat":
        specs = chat_dataset(tok, a.conversations, a.turns, a.system_len, a.user_len, a.reply_len, a.output_len,
                             a.think_time, a.seed, a.send_text)
        info.update(num_prompts=len(specs), conversations=a.conversations, turns=a.turns, system_len=a.system_len,
                    user_len=a.user_len, reply_len=a.reply_len, think_time=a.think_time)
    elif a.dataset == "reasoning":
        specs = reasoning_dataset(tok, a.num_prompts, a.reasoning_prompt_len, a.reasoning_output_len,
                                  a.reasoning_range / 2, a.reasoning_range, a.seed, a.send_text)
        info.update(output_len=a.reasoning_output_len, prompt_len=a.reasoning_prompt_len,
                    output_range=a.reasoning_range, prompt_range=a.reasoning_range / 2)
    else:
        specs = passkey_dataset(tok, a.num_prompts, a.context_len, a.output_len, a.seed, a.send_text)
        info.update(context_len=a.context_len)
    return tok, specs, info


def load_shape(a: argparse.Namespace) -> LoadShape:
    """The :class:`LoadShape` for the parsed flags (Poisson at 1 request/s when none is given).

    Parameters
    ----------
    a : argparse.Namespace

    Returns
    -------
    LoadShape
    """
    if a.burst:
        return LoadShape("burst", concurrency=a.max_concurrency, seed=a.seed)
    if a.concurrency is not None:
        return LoadShape("concurrency", concurrency=a.concurrency, seed=a.seed)
    return LoadShape("poisson", rate=a.request_rate if a.request_rate is not None else 1.0,
                     concurrency=a.max_concurrency, seed=a.seed)


def main(argv: list[str] | None = None) -> int:
    """Run the load test; returns the exit status (0: at least one request succeeded).

    Parameters
    ----------
    argv : list of str, optional
        Arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        slos = parse_slos(a.slo)
        shape = load_shape(a)
        if not a.allow_remote:
            check_loopback(a.base_url)
        if a.time_limit <= 0 or a.request_timeout <= 0:
            raise ValueError("--time-limit and --request-timeout must be > 0")
        api_key = a.api_key or os.environ.get("LSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        model = a.model or first_model(a.base_url, api_key)
        _, specs, data_info = make_dataset(a)
    except (ValueError, OSError, urllib.error.URLError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    opts = RequestOptions(url=a.base_url.rstrip("/") + a.endpoint, model=model, temperature=a.temperature,
                          ignore_eos=not a.no_ignore_eos, api_key=api_key, timeout_s=a.request_timeout)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    results, duration, not_sent = asyncio.run(run_load(specs, opts, shape, a.time_limit, progress=not a.no_progress))
    summary = summarize(results, duration, slos, not_sent)
    report = {
        "tool": "load_tests",
        "command": "python -m load_tests " + shlex.join(argv),
        "label": a.label,
        "started_at": started,
        "endpoint": opts.url,
        "model": model,
        "dataset": data_info,
        "load": {"mode": shape.mode, "request_rate": shape.rate if shape.mode == "poisson" else None,
                 "concurrency": shape.concurrency or None, "time_limit_s": a.time_limit,
                 "request_timeout_s": a.request_timeout, "temperature": a.temperature,
                 "ignore_eos": not a.no_ignore_eos},
        "results": summary,
        "requests": [dict(r.to_dict(), text=r.text[:120]) for r in results],
    }
    path = write_json(a.out, report)
    if not a.no_png:
        write_png(Path(a.out).with_suffix(".png"), results, summary,
                  f"{a.dataset} x{a.num_prompts}, {shape.mode} load on {opts.url}")
    _print_summary(summary, path)
    return 0 if summary["successful"] else 1


def _print_summary(s: dict, path: Path) -> None:
    lines = [f"requests: {s['successful']} ok, {s['failed']} failed, {s['not_sent']} not sent "
             f"in {s['duration_s']:.2f} s",
             f"throughput: {s['request_throughput']:.3f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
             f"{s['total_token_throughput']:.1f} total tok/s"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        if d["count"]:
            lines.append(f"{key[:-3].upper():5s} ms: mean {d['mean']:.1f}  p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  "
                         f"p99 {d['p99']:.1f}")
    g = s["goodput"]
    if g["slos_ms"]:
        lines.append(f"goodput: {g['goodput_rps']:.3f} req/s ({g['good_requests']} requests met {g['slos_ms']})")
    if "answers" in s:
        lines.append(f"answers: {s['answers']['correct']}/{s['answers']['checked']} correct")
    for e in s["errors"]:
        lines.append(f"error x{e['count']}: {e['error']}")
    lines.append(f"report: {path}")
    print("\n".join(lines), flush=True)
