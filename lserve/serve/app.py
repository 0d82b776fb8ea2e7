"""The Ray Serve application: builder for ``serve run`` and :func:`serve_main` for ``lserve serve``.

Two deployments: ``LServeEngine`` (replicas of :class:`~lserve.serve.replica.EngineReplica`, one
engine each, routed by :class:`~lserve.serve.ray_router.PrefixAwareRequestRouter`) behind
``LServeIngress`` (the OpenAI-compatible FastAPI app of :mod:`lserve.serve.openai_app`).

* ``serve run deploy/serve_config.yaml`` calls :func:`build_app` with the YAML's ``args``.
* ``lserve serve`` calls :func:`serve_main`, which starts a local Ray, runs the app and blocks until
  SIGINT or SIGTERM (sent to it or to its process group), then drains (new requests get 503,
  running ones get ``shutdown_grace_s`` to finish, the rest end with an SSE error event) and shuts
  everything down.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time
from typing import Any

from lserve.config import ConfigError
from lserve.serve.metrics import MULTIPROC_ENV, new_metrics_dir
from lserve.serve.ray_head import RayHead
from lserve.serve.settings import API_KEY_ENV, ServeSettings

log = logging.getLogger("lserve.serve")

ENGINE_DEPLOYMENT = "LServeEngine"
INGRESS_DEPLOYMENT = "LServeIngress"
#: Ray Serve warns about replicas that take longer than this to start (its default, 30 s, is
#: shorter than a first start on a small CPU machine, which dequantizes the model).
SLOW_STARTUP_WARNING_S = 180
#: Seconds beyond the shutdown grace period that Ray Serve gives a replica before killing it.
SHUTDOWN_MARGIN_S = 5.0


def stop_timeouts_s(grace_s: float) -> dict[str, float]:
    """Seconds Ray Serve gives each deployment's replicas to stop before killing them.

    Engine replicas get the grace period for their running requests plus a margin; the ingress
    one margin more, so it can still end cut streams with their final events. A Kubernetes pod's
    termination grace period must cover the longest (``deploy/render_k8s.py``).

    Parameters
    ----------
    grace_s : float
        ``ServeSettings.shutdown_grace_s``.

    Returns
    -------
    dict
        Deployment name -> ``graceful_shutdown_timeout_s``.
    """
    return {ENGINE_DEPLOYMENT: grace_s + SHUTDOWN_MARGIN_S, INGRESS_DEPLOYMENT: grace_s + 2 * SHUTDOWN_MARGIN_S}


class OpenAIIngress:
    """Ingress deployment: builds the FastAPI app around an :class:`OpenAIServer` at replica start.

    Parameters
    ----------
    settings : dict
        :meth:`ServeSettings.to_dict` output.
    engine : DeploymentHandle
        Handle of the engine deployment (Ray Serve passes it for the bound engine).
    """

    def __init__(self, settings: dict[str, Any], engine) -> None:
        from lserve.serve.ingress import OpenAIServer
        from lserve.serve.replica import _replica_id

        self.server = OpenAIServer(ServeSettings.from_dict(settings), engine, replica=_replica_id())

    def __serve_build_asgi_app__(self):
        from lserve.serve.openai_app import build_openai_app

        return build_openai_app(self.server)

    async def drain(self, grace_s: float) -> dict[str, Any]:
        """Shutdown drain of this ingress (see :meth:`lserve.serve.lifecycle.Lifecycle.drain`)."""
        return await self.server.lifecycle.drain(grace_s)


def build_app_from_settings(settings: ServeSettings, total_cpus: float | None = None):
    """The Ray Serve :class:`~ray.serve.Application` for ``settings``.

    Parameters
    ----------
    settings : ServeSettings
    total_cpus : float, optional
        CPUs of the Ray cluster, to share out among replicas when ``num_cpus`` is 0.
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from lserve.serve.ray_router import PrefixAwareRequestRouter
    from lserve.serve.replica import EngineReplica

    s = settings
    if not s.metrics_dir:
        s.metrics_dir = new_metrics_dir(s.app_name)
    env = {MULTIPROC_ENV: s.metrics_dir}
    ingress_env = dict(env)
    if os.environ.get(API_KEY_ENV):
        ingress_env[API_KEY_ENV] = os.environ[API_KEY_ENV]
    policy: dict[str, Any] = {}
    if s.request_router == "prefix":  # else Ray Serve's default class (power of two choices)
        policy = {"request_router_class": PrefixAwareRequestRouter,
                  "request_router_kwargs": {"min_prefix_blocks": s.min_prefix_blocks,
                                            "imbalance_tokens": s.imbalance_tokens,
                                            "imbalance_ratio": s.imbalance_ratio}}
    router = RequestRouterConfig(
        **policy, request_routing_stats_period_s=s.routing_stats_period_s,
        request_routing_stats_timeout_s=max(5.0, 4 * s.routing_stats_period_s))
    engine_opts: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": s.replica_num_cpus(total_cpus), "num_gpus": s.replica_num_gpus(),
                              "runtime_env": {"env_vars": env}},
        "max_ongoing_requests": s.replica_max_ongoing,
        # The ingress admits at most replicas * max_ongoing + max_queued_requests at once and answers
        # the rest with 429/503 itself (OpenAI-shaped); admitted requests may wait in the router.
        "max_queued_requests": -1,
        "health_check_period_s": s.health_check_period_s,
        "health_check_timeout_s": s.health_check_timeout_s,
        # Ray Serve stopping a replica (serve run, scale-down, Kubernetes) waits for its requests.
        "graceful_shutdown_timeout_s": stop_timeouts_s(s.shutdown_grace_s)[ENGINE_DEPLOYMENT],
        "graceful_shutdown_wait_loop_s": 0.5,
        "max_constructor_retry_count": 2,
        "request_router_config": router,
    }
    if s.autoscaling:
        engine_opts["autoscaling_config"] = {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                                             "initial_replicas": s.replicas,
                                             "target_ongoing_requests": s.target_ongoing_requests}
    else:
        engine_opts["num_replicas"] = s.replicas
    engine = serve.deployment(EngineReplica).options(**engine_opts)
    # One ingress replica: a drain (POST /admin/drain, lserve drain) reaches all of it in one call.
    ingress = serve.deployment(serve.ingress()(OpenAIIngress)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=s.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": s.ingress_num_cpus, "runtime_env": {"env_vars": ingress_env}},
        max_constructor_retry_count=2, graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=stop_timeouts_s(s.shutdown_grace_s)[INGRESS_DEPLOYMENT])
    conf = s.to_dict()
    return ingress.bind(conf, engine.bind(conf))


def build_app(args: dict[str, Any] | None = None):
    """Application builder for ``serve run`` (import path ``lserve.serve.app:build_app``).

    Parameters
    ----------
    args : dict, optional
        :class:`ServeSettings` fields (the YAML ``args`` block, or ``key=value`` pairs given to
        ``serve run``); missing ones take their defaults.
    """
    settings = ServeSettings.from_dict(args)
    settings.check_model_available()
    return build_app_from_settings(settings)


def _drain(settings: ServeSettings) -> None:
    """Drain the ingress (new requests 503, running ones finish up to the grace period, then cut)."""
    from ray import serve

    from lserve.serve.lifecycle import Lifecycle

    grace = settings.shutdown_grace_s
    print(f"lserve: shutting down: refusing new requests, giving running ones up to {grace:g}s "
          "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=settings.app_name)
    try:
        out = handle.drain.remote(grace).result(timeout_s=grace + Lifecycle.CUT_FLUSH_S + 30)
    except KeyboardInterrupt:
        print("lserve: stopping now", file=sys.stderr, flush=True)
        return
    except Exception as e:  # noqa: BLE001 - the ingress is gone: nothing left to drain
        print(f"lserve: could not drain the ingress ({type(e).__name__}); stopping now", file=sys.stderr, flush=True)
        return
    if out["cut"]:  # the grace period of the drain, which `lserve drain` may have started earlier
        print(f"lserve: {out['cut']} request(s) still running after {out['grace_s']:g}s ended with an error",
              file=sys.stderr, flush=True)
    elif out["in_flight"]:
        print(f"lserve: {out['in_flight']} running request(s) finished", file=sys.stderr, flush=True)


def _shutdown(settings: ServeSettings, head: RayHead | None) -> None:
    """Stop Serve, then Ray's head, without being interrupted half-way (a third Ctrl-C would print tracebacks)."""
    import ray
    from ray import serve

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if head is not None and head.alive() and ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()
        if head is not None:
            head.stop()
        if settings.metrics_dir:
            shutil.rmtree(settings.metrics_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _sparsity_summary(settings: ServeSettings) -> str:
    """The sparsity in effect, asked of an engine replica: the ``summary`` that ``/v1/models``
    shows in its ``sparsity`` field (:func:`lserve.sparsity.in_effect.summary`)."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=settings.app_name)
        return handle.info.remote().result(timeout_s=60)["sparsity"]["summary"]
    except Exception as e:  # noqa: BLE001 - the server runs anyway; /v1/models asks again
        return f"unknown (no engine replica answered: {type(e).__name__})"


def _app_running(settings: ServeSettings) -> bool:
    """Whether Serve reports the app as running (False where it cannot be asked)."""
    from ray import serve

    try:
        app = serve.status().applications.get(settings.app_name)
    except Exception:  # noqa: BLE001 - Ray going away: nothing to drain
        return False
    return app is not None and app.status == "RUNNING"  # ApplicationStatus is a str enum


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve_main(args: argparse.Namespace) -> int:
    """``lserve serve``: start Ray and the app, print where it listens, block until SIGINT or SIGTERM.

    Then drain (:func:`_drain`) and shut everything down. SIGINT and SIGTERM are handled alike,
    SIGINT even when it was inherited as ignored (a server started with ``cmd &`` from a script).
    Ray's head runs in a session of its own (:class:`~lserve.serve.ray_head.RayHead`), so a
    signal sent to this process's whole group reaches this process only and the drain still
    works; Ray is stopped after it, and with this process if it dies.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed ``lserve serve`` flags (``--host``, ``--port``, ``--replicas`` and the engine flags).

    Returns
    -------
    int
        Process exit status (0 after a signal, drained or not; 1 if the app or Ray failed).
    """
    settings = ServeSettings.from_args(args)
    settings.check_model_available()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Read by the Serve controller, a child of the Ray started below.
    os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", str(SLOW_STARTUP_WARNING_S))
    import ray
    from ray import serve

    cpus = os.cpu_count() or 1
    gpus = 0
    if settings.uses_gpu:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < settings.replicas:
            raise ConfigError(f"{settings.replicas} GPU replicas asked for but {gpus} CUDA GPU(s) are visible")
    quiet = os.environ.get("LSERVE_LOG", "WARNING").upper()
    logging.getLogger("ray.serve").setLevel(quiet)
    logs = {"log_level": quiet, "enable_access_log": quiet in ("DEBUG", "INFO")}
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    head = None
    started = running = False  # Serve is up; the app's deployment returned
    try:
        print(f"lserve: starting Ray and {settings.replicas} engine replica(s) of {settings.model_name}",
              file=sys.stderr, flush=True)
        try:
            head = RayHead.start(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, logging_level=quiet)
        except RuntimeError as e:
            print(f"lserve: error: {e}", file=sys.stderr)
            return 1
        ray.init(address=head.address, namespace="lserve", logging_level=quiet, configure_logging=True)
        for sig in previous:  # ray.init installs a SIGTERM handler of its own (Ray's C++ core)
            signal.signal(sig, _interrupt)
        serve.start(http_options={"host": settings.host, "port": settings.port,
                                  "request_timeout_s": settings.request_timeout_s}, logging_config=logs)
        started = True
        try:
            serve.run(build_app_from_settings(settings, total_cpus=cpus), name=settings.app_name, route_prefix="/",
                      logging_config=logs)
        except RuntimeError as e:
            print(f"lserve: error: the deployment failed to start: {e}", file=sys.stderr)
            return 1
        running = True
        print(f"lserve: sparsity: {_sparsity_summary(settings)}", flush=True)
        key = " (API key required)" if os.environ.get(API_KEY_ENV) else ""
        print(f"lserve: serving {settings.model_name} at http://{settings.host}:{settings.port}/v1 with "
              f"{settings.replicas} engine replica(s){key}; Ctrl-C to stop", flush=True)
        while head.alive():
            time.sleep(1.0)
        print(f"lserve: error: Ray's head process ended (status {head.proc.returncode}); stopping",
              file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        # the app serves (and /health answers 200) before serve.run returns: a signal in between
        # must drain too, not drop the requests already accepted
        if running or (started and _app_running(settings)):
            _drain(settings)
        else:
            print("lserve: shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        _shutdown(settings, head)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
