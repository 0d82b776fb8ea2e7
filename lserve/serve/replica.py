"""The engine replica: one :class:`~lserve.engine.async_engine.AsyncEngine` per Ray Serve replica.

The engine loop runs in its own thread; :meth:`EngineReplica.generate` is an async generator that
streams one plain-dict event per engine output to the caller (the ingress), so nothing but dicts
crosses process boundaries:

* ``{"type": "accepted", "replica", "prompt_tokens"}`` once the request is tokenized and checked;
  (plus ``"prompt_text"`` when the params ask for ``echo``);
* ``{"type": "delta", "text", "num_tokens", "finished", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens"}`` per engine step that touched the request (with
  ``stream_interval`` N > 1 or a ``stream_interval_ms``: the first tokens at once, then outputs merged
  into events of at least N tokens and that many ms apart, :mod:`lserve.serve.stream_interval`),
  with ``"logprobs"`` (the new tokens') when asked
  for, and ``"prompt_logprobs"`` once, in the first delta after prefill, when asked for (entries
  as :mod:`lserve.serve.logprobs` describes);
* ``{"type": "error", "status", "message", "param", "code"}`` instead, for a request the engine
  cannot serve (400) or a dead engine (503).

Closing the generator (a client that went away) closes the engine stream, which aborts the request
and frees its KV pages before the next step. ``check_health`` raises once the engine loop has died,
so Ray Serve replaces the replica; ``record_routing_stats`` feeds the router's token-load view; a
background thread exports engine gauges and counters to Prometheus.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

from lserve.cache.host_tier import HostKVStats
from lserve.config import ConfigError
from lserve.engine.async_engine import AsyncEngine, EngineDeadError
from lserve.engine.request_check import CONTEXT_LENGTH_EXCEEDED, RequestError
from lserve.engine.sampling import SamplingParams
from lserve.engine.sequence import RequestOutput
from lserve.serve.logprobs import TokenTexts
from lserve.serve.metrics import EngineMetrics, get_engine_metrics
from lserve.serve.settings import ServeSettings
from lserve.serve.stream_interval import ChunkBuffer

#: Seconds of prefix-cache evictions each routing report repeats (reports are polled about every second).
EVICTION_WINDOW_S = 60.0
#: At most this many (the newest) evicted hashes per report: a router that finds more evictions
#: than listed since its last read forgets the replica's prefixes instead (bounded payload).
EVICTED_REPORT_CAP = 256
log = logging.getLogger("lserve.serve")

STATS_PERIOD_S = 0.5


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (plain use, unit tests)
        return f"local-{os.getpid()}"


class EngineReplica:
    """One engine behind Ray Serve (wrapped by ``serve.deployment`` in :mod:`lserve.serve.app`).

    Parameters
    ----------
    settings : dict
        :meth:`ServeSettings.to_dict` output.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        import torch

        self.settings = ServeSettings.from_dict(settings)
        if not self.settings.uses_gpu:
            torch.set_num_threads(self.settings.replica_torch_threads())
        cfg = self.settings.engine_config()
        if self.settings.uses_gpu:
            cfg.device = "cuda"  # Ray exposes this replica's GPU as device 0
        self.engine = AsyncEngine(cfg)
        self.replica_id = _replica_id()
        self.model_name = self.settings.model_name
        facts = self.engine.describe()
        self.page_size = facts["page_size"]
        self.max_model_len = facts["max_model_len"]
        self.sparsity = facts["sparsity"]
        self.metrics: EngineMetrics = get_engine_metrics(self.model_name, self.replica_id)
        self.metrics.init_series(host_kv=self.engine.stats().host_kv is not None)
        self._itl = self.metrics.of(self.metrics.itl)  # observed per token: its labelled series, looked up once
        self._queued: dict[str, int] = {}  # request id -> prompt tokens not yet prefilled
        self._ids = itertools.count()
        self.aborted = 0  # see _count_end
        self._stop = threading.Event()
        self._static_gauges(facts)
        self._poller = threading.Thread(target=self._poll_stats, name="lserve-metrics", daemon=True)
        self._poller.start()
        log.info("engine replica %s ready: model %s, max_model_len %d", self.replica_id, self.model_name,
                 self.max_model_len)

    # -- requests -----------------------------------------------------------------------------
    def _params(self, p: dict[str, Any], prompt_len: int) -> SamplingParams:
        p = dict(p)
        p.pop("echo", None)  # the ingress's business (the prompt text comes back in "accepted")
        if p.get("max_tokens") is None:
            room = self.max_model_len - prompt_len
            if room < 1:
                raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but the "
                                   f"prompt has {prompt_len}", code=CONTEXT_LENGTH_EXCEEDED)
            p["max_tokens"] = min(self.settings.default_max_tokens, room)
        return SamplingParams(**p)

    async def generate(self, request: dict[str, Any], lserve_route: dict | None = None):
        """Stream the events of one request (see the module docstring).

        Parameters
        ----------
        request : dict
            ``{"request_id", "prompt" (text, token ids or chat messages), "chat", "params", "stream"
            (False: the client waits for the whole answer; default True)}`` where
            ``params`` are :class:`SamplingParams` fields (``max_tokens`` None: as much as fits,
            capped at ``default_max_tokens``).
        lserve_route : dict, optional
            Routing hints read by the router (unused here).
        """
        t_recv = time.monotonic()
        rid = f"{request.get('request_id') or 'req'}-{next(self._ids)}"
        try:
            self.engine.check_health()
            ids = await asyncio.to_thread(self.engine.encode, request["prompt"],
                                          bool(request.get("chat")))
            params = self._params(request.get("params") or {}, len(ids))
            self.engine.validate(ids, params)
            echo = bool((request.get("params") or {}).get("echo"))
        except EngineDeadError as e:
            yield {"type": "error", "status": 503, "message": f"the engine of replica {self.replica_id} has stopped "
                   f"and is being replaced; retry shortly ({e})", "code": "engine_dead"}
            return
        except RequestError as e:
            code = e.code
            yield {"type": "error", "status": 400, "message": str(e), "param": getattr(e, "param", None) or
                   ("messages" if request.get("chat") else "prompt"), "code": code}
            return
        except (ConfigError, ValueError, TypeError) as e:  # bad sampling fields, no chat template
            yield {"type": "error", "status": 400, "message": str(e), "param": None, "code": None}
            return
        self._queued[rid] = len(ids)
        finished, reason = False, "abort"
        stream = None
        # the engine's outputs merged into events of --stream-interval tokens, --stream-interval-ms
        # apart, or, for a client that does not stream, into its first tokens and its finish (the
        # ITL metric below still sees each output as the engine made it)
        chunks = ChunkBuffer(self.settings.stream_interval if request.get("stream", True) else None,
                             self.settings.stream_interval_ms / 1e3)
        prompt_lps_sent = False
        try:
            accepted = {"type": "accepted", "replica": self.replica_id, "prompt_tokens": len(ids)}
            if echo:
                prompt = request["prompt"]
                accepted["prompt_text"] = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)
            yield accepted
            stream = self.engine.generate(ids, params, request_id=rid)
            last = None
            async for out in stream:
                now = time.monotonic()
                self._queued.pop(rid, None)
                n_new = len(out.delta_token_ids)
                if last is not None and n_new:
                    per = (now - last) / n_new
                    for _ in range(n_new):
                        self._itl.observe(per)
                if n_new:
                    last = now
                if out.finished:
                    finished, reason = True, out.finish_reason or "stop"
                    self._observe_finished(out.metrics, t_recv, now, len(out.token_ids))
                due = chunks.add(out)
                if due is not None:
                    ev = self._delta_event(due, prompt_logprobs=not prompt_lps_sent)
                    prompt_lps_sent = prompt_lps_sent or "prompt_logprobs" in ev
                    yield ev
            held = chunks.flush()  # only when the stream ended unfinished (a finish is always due)
            if held is not None:
                yield self._delta_event(held, prompt_logprobs=not prompt_lps_sent)
        except EngineDeadError as e:
            reason = "error"
            held = chunks.flush()  # what was held goes out before the error event
            if held is not None:
                yield self._delta_event(held, prompt_logprobs=not prompt_lps_sent)
            yield {"type": "error", "status": 503, "message": f"the engine stopped while generating ({e}); retry",
                   "code": "engine_dead"}
        finally:
            self._queued.pop(rid, None)
            if stream is not None and not finished:
                await stream.aclose()  # aborts the request: its pages are freed before the next step
            self._count_end(reason)

    def _delta_event(self, out: RequestOutput, prompt_logprobs: bool) -> dict[str, Any]:
        """The ``delta`` event of an output (merged or not); its prompt logprobs only when
        ``prompt_logprobs`` (they go out once, with the first event that has them)."""
        ev = {"type": "delta", "text": out.delta_text, "num_tokens": len(out.delta_token_ids),
              "finished": out.finished, "finish_reason": out.finish_reason,
              "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
              "cached_tokens": out.metrics.get("cached_tokens", 0)}
        if out.delta_logprobs is not None:
            ev["logprobs"] = self._token_texts().entries(out.delta_logprobs)
        if out.prompt_logprobs is not None and prompt_logprobs:
            first = (out.prompt_token_ids[0], None, None)  # the first prompt token has no logprob
            ev["prompt_logprobs"] = self._token_texts().entries([first, *out.prompt_logprobs[1:]])
        return ev

    def _count_end(self, reason: str) -> None:
        """Count an accepted request's end, by finish reason (stop, length, abort, error).

        The one definition of an abort: a request this replica accepted that ended before the
        engine finished it, because its caller went away (client disconnect, cancellation,
        a shutdown's cut). ``request_success{finished_reason="abort"}``,
        ``num_aborted_requests`` and ``engine_stats()["aborted"]`` all count these events, here.
        """
        m = self.metrics
        m.of(m.finished, finished_reason=reason).inc()
        if reason == "abort":
            self.aborted += 1
            m.of(m.aborts).inc()

    def _token_texts(self) -> TokenTexts:
        """Token texts for logprobs (built on first use, cached per token)."""
        texts = getattr(self, "_texts", None)
        if texts is None:
            texts = self._texts = TokenTexts(self.engine.tokenizer)
        return texts

    def _observe_finished(self, em: dict, t_recv: float, now: float, n_out: int) -> None:
        m = self.metrics
        first_token, first_sched, arrival = em.get("first_token"), em.get("first_scheduled"), em.get("arrival")
        m.of(m.e2e).observe(now - t_recv)
        if first_token is not None:
            m.of(m.ttft).observe(max(0.0, first_token - t_recv))
            m.of(m.decode).observe(max(0.0, now - first_token))
            if n_out > 1:
                m.of(m.tpot).observe(max(0.0, now - first_token) / (n_out - 1))
        if first_sched is not None and arrival is not None:
            m.of(m.queue).observe(max(0.0, first_sched - arrival))
            if first_token is not None:
                m.of(m.prefill).observe(max(0.0, first_token - first_sched))

    # -- health, routing, admin ---------------------------------------------------------------
    def check_health(self, lserve_target: str | None = None) -> None:
        """Raise if the engine loop has died (Ray Serve then restarts this replica).

        ``lserve_target`` lets a handle call reach one given replica (drills, tests).
        """
        self.engine.check_health()

    def engine_stats(self, lserve_target: str | None = None) -> dict[str, Any]:
        """This replica's engine state (for admin views and tests)."""
        st = self.engine.stats()
        return {"replica": self.replica_id, "alive": self.engine.is_alive, "running": st.running,
                "waiting": st.waiting, "kv_usage": dict(st.kv_usage), "dense_pages_used": st.dense_pages_used,
                "dense_pages_total": st.dense_pages_total,
                "stream_pages_used": st.stream_pages_used, "all_pages_free": st.all_pages_free,
                "queued_prompt_tokens": sum(self._queued.values()), "num_preemptions": st.num_preemptions,
                "aborted": self.aborted, "steps": st.steps, "step_kinds": st.step_kinds,
                "host_kv": asdict(st.host_kv) if st.host_kv is not None else None,
                "step_seconds": st.step_seconds, "budget": st.budget}

    def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"prompt": text, "add_special_tokens": bool}`` or ``{"messages": chat}`` -> ``{"tokens": ids}``
        with this engine's own tokenizer (as :meth:`generate` encodes), or ``{"error": message}``."""
        try:
            if "messages" in request:
                ids = self.engine.encode(request["messages"], True)
            else:
                ids = self.engine.tokenizer.encode(request["prompt"], request.get("add_special_tokens", True))
        except (ValueError, TypeError) as e:  # no chat template
            return {"error": str(e)}
        return {"tokens": [int(t) for t in ids], "max_model_len": self.max_model_len}

    def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        """Token ids -> ``{"prompt": text}`` (as generated text is decoded), or ``{"error": message}``."""
        vocab = self.engine.tokenizer.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            return {"error": f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"}
        return {"prompt": self.engine.tokenizer.decode(tokens)}

    def info(self) -> dict[str, Any]:
        """Model facts the ingress shows in ``/v1/models``."""
        return {"replica": self.replica_id, "model": self.model_name, "max_model_len": self.max_model_len,
                "page_size": self.page_size, "sparsity": self.sparsity}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Token load for the router (prompt tokens queued + KV tokens in use) and the engine state.

        Ray Serve calls this every ``routing_stats_period_s`` outside the request slots, so the
        ingress's admin and health views read it without waiting behind busy requests.
        """
        stats = self.engine_stats()
        now = time.time()
        st = self.engine.stats()
        # Pages this replica's prefix cache dropped lately, so routers stop sending their prefixes
        # here; a router that missed some (more evictions than listed) forgets this replica instead.
        evicted = [h for t, h in st.prefix_recent_evicted if t >= now - EVICTION_WINDOW_S][-EVICTED_REPORT_CAP:]
        stats.update(ts=now, kv_tokens=stats["dense_pages_used"] * self.page_size, prefix_evicted=evicted,
                     prefix_evictions=st.prefix_evictions)
        return stats

    def kill_engine(self, lserve_target: str | None = None) -> str:
        """Failure drill: stop the engine loop as a crash would; returns this replica's id.

        Only reachable through a deployment handle (never over HTTP); ``lserve_target`` (a replica
        id) makes the router deliver the call to that replica.
        """
        log.warning("engine of replica %s killed on request", self.replica_id)
        self.engine.kill()
        return self.replica_id

    # -- metrics ------------------------------------------------------------------------------
    def _static_gauges(self, facts: dict) -> None:
        m = self.metrics
        m.of(m.token_budget).set(facts["token_budget"])
        m.of(m.streaming_heads).set(facts["streaming_fraction"])

    def _poll_stats(self) -> None:
        m = self.metrics
        last: dict[str, float] = {"prompt": 0, "gen": 0, "pre": 0, "steps": 0, "pc_q": 0, "pc_h": 0,
                                  "runs": 0, "reuses": 0, "pages": 0,
                                  "seconds": 0.0, "kv_read": 0, "kv_dense": 0}
        host_before = HostKVStats()
        while not self._stop.wait(STATS_PERIOD_S):
            try:
                st = self.engine.stats()
                m.of(m.running).set(st.running)
                m.of(m.waiting).set(st.waiting)
                for pool, frac in st.kv_usage.items():
                    m.of(m.kv_usage, pool=pool).set(frac)
                m.of(m.dense_pages).set(st.dense_pages_used)
                m.of(m.queued_prompt).set(sum(self._queued.values()))
                info = st.last_step
                if info:
                    m.of(m.step_time).set(info.get("seconds", 0.0))
                sel = st.selector
                if sel is not None:
                    runs, pages = sel.runs - last["runs"], sel.pages - last["pages"]
                    if runs > 0:
                        m.of(m.selected_pages).set(pages / runs)
                    for key, counter in (("runs", m.selector_runs), ("reuses", m.selector_reuses),
                                         ("pages", m.selector_pages), ("seconds", m.selector_time)):
                        value = getattr(sel, key)
                        if value > last[key]:
                            m.of(counter).inc(value - last[key])
                        last[key] = value
                kv = st.kv_read
                if kv is not None and kv.dense > last["kv_dense"]:
                    read, dense = kv.read - last["kv_read"], kv.dense - last["kv_dense"]
                    m.of(m.kv_read_fraction).set(read / dense)
                    m.of(m.kv_read_tokens).inc(read)
                    m.of(m.kv_dense_tokens).inc(dense)
                    last.update(kv_read=kv.read, kv_dense=kv.dense)
                now = {"prompt": st.prompt_tokens, "gen": st.generation_tokens, "pre": st.num_preemptions,
                       "steps": st.steps, "pc_q": st.prefix_cache_queries, "pc_h": st.prefix_cache_hits}
                m.of(m.prefix_pages).set(st.prefix_cached_pages)
                if st.host_kv is not None:
                    m.export_host_kv(st.host_kv, host_before, st.steps - last["steps"])
                    host_before = st.host_kv
                for key, counter in (("prompt", m.prompt_tokens), ("gen", m.generation_tokens),
                                     ("pre", m.preemptions), ("steps", m.steps), ("pc_q", m.prefix_queries),
                                     ("pc_h", m.prefix_hits)):
                    if now[key] > last[key]:
                        m.of(counter).inc(now[key] - last[key])
                last.update(now)
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                log.exception("metrics poll failed")

    def shutdown(self) -> None:
        """Stop the metrics poller and the engine loop. Ray Serve calls it through ``__del__``; a
        replica made in-process (tests, ``lserve bench host-step``) must call it: the poller thread
        holds the replica, so it (with its engine, weights and KV pool) is never freed before."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            poller = getattr(self, "_poller", None)
            if poller is not None and poller is not threading.current_thread():
                poller.join(timeout=10)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()

