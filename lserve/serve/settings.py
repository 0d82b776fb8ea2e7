"""Serving settings: one validated dataclass shared by ``lserve serve``, the YAML config and tests.

:class:`ServeSettings` holds the serving fields declared here plus one field per engine flag, made
from the config dataclasses' metadata (:func:`lserve.config.engine_flags`): named as the flags
(``--token-budget`` -> ``token_budget``), with the command line's defaults, so that a ``serve run``
YAML file, the command line and :func:`lserve.config.engine_config_from_args` all speak the same
language. The serving fields made with :func:`lserve.config.setting` and a help text are also
``lserve serve`` flags (:data:`SERVE_FLAGS`). Everything crosses process boundaries as a plain dict
(:meth:`ServeSettings.to_dict`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

from lserve.config import (
    ConfigError,
    EngineConfig,
    engine_config_from_args,
    engine_flags,
    flags_of,
    require,
    setting,
)

#: Fields that describe the engine (names of the ``lserve`` engine flags, with underscores).
ENGINE_FIELDS = tuple(f.name for f in engine_flags())
#: Where serving departs from the engine flags' defaults: ``device`` "auto" becomes ``"cuda"``
#: (one GPU per replica) when a CUDA GPU is visible, else ``"cpu"``.
SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"device": "auto"}

API_KEY_ENV = "LSERVE_API_KEY"
#: Seconds a shutdown lets running requests finish (Kubernetes' default termination grace period;
#: vLLM-style servers drain for about as long). The one default of ``--shutdown-grace-s``.
DEFAULT_SHUTDOWN_GRACE_S = 30.0
#: Seconds of silence after which a stream sends an SSE comment line (well under the 60 s idle
#: timeout common in proxies and load balancers). The one default of ``--sse-keepalive-s``.
DEFAULT_SSE_KEEPALIVE_S = 10.0
#: Generated tokens per streamed event: every token as it comes (vLLM's default). The one default
#: of ``--stream-interval``.
DEFAULT_STREAM_INTERVAL = 1
#: Least milliseconds between two streamed events of one stream: none (vLLM's behaviour). The one
#: default of ``--stream-interval-ms``.
DEFAULT_STREAM_INTERVAL_MS = 0.0


def _coerce(name: str, value: Any, type_name: str, parse=None) -> Any:
    """Convert a string to the field's declared type (``int``, ``float``, ``bool``, optional), or
    with the field's own ``parse`` (its :func:`~lserve.config.setting` metadata) when it has one."""
    if not isinstance(value, str):
        return value
    if parse is not None:
        return parse(value)
    base = type_name.replace(" | None", "").strip()
    if "None" in type_name and value.strip().lower() in ("", "none", "null"):
        return None
    try:
        if base == "int":
            return int(value)
        if base == "float":
            return float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if base == "bool":
        low = value.strip().lower()
        require(low in ("1", "0", "true", "false", "yes", "no", "on", "off"), f"{name} must be true or false, got {value!r}")
        return low in ("1", "true", "yes", "on")
    return value


# The serving half of ServeSettings, which adds the engine fields at the end of this module
# (the methods read both halves; not used alone).
@dataclass
class _Serving:
    """Everything a deployment needs; validated on construction.

    Parameters
    ----------
    model ... prefix_cache
        Engine settings (:data:`ENGINE_FIELDS`), as the ``lserve`` flags of the same names.
        ``device="auto"`` (the serving default) becomes ``"cuda"`` (one GPU per replica) when a
        CUDA GPU is visible, else ``"cpu"``.
    host, port
        Where the HTTP API listens.
    served_model_name : str or None
        The ``model`` id clients send and ``/v1/models`` lists (default: the ``model`` string).
    replicas : int
        Engine replicas (fixed count, or the initial count when autoscaling).
    autoscaling : bool
        Let Ray Serve scale engine replicas between ``min_replicas`` and ``max_replicas`` aiming at
        ``target_ongoing_requests`` per replica.
    max_ongoing_requests : int
        Requests one engine replica holds at once (running + waiting in its engine); 0 means
        ``2 * max_num_seqs``.
    max_queued_requests : int
        Requests the ingress queues for the engine deployment when every replica is full; beyond
        that a request is refused with ``overload_status_code`` and ``Retry-After: retry_after_s``.
    num_cpus, num_gpus : float
        Ray resources of one engine replica; 0 picks a default (one GPU for a CUDA device; CPUs
        shared out so every replica fits on a small machine).
    torch_threads : int
        Intra-op threads of each engine replica (0: the machine's cores divided by the replicas).
    health_check_period_s, health_check_timeout_s : float
        Ray Serve health checks of engine replicas (a dead engine loop fails them).
    routing_stats_period_s : float
        How often replicas report their token load to the router.
    prefix_block_chars, min_prefix_blocks, imbalance_tokens, imbalance_ratio
        Router policy, see :class:`lserve.serve.router.PrefixAffinityPolicy`.
    request_router : str
        ``"prefix"`` (prefix affinity and token load, the default) or ``"default"`` (Ray Serve's
        own power-of-two-choices router, for comparison).
    engine_calls_by_value : bool
        The ingress calls engine replicas over Ray Serve's gRPC transport, each streamed item sent
        by value, instead of through Ray object references (``_by_reference=False``): about half
        the replica's host CPU per streamed item (``host_step_cpu_by_value.json``).
    max_body_bytes : int
        Larger request bodies get HTTP 413.
    default_max_tokens : int
        ``max_tokens`` of a chat request that gives none (capped by the context left).
    request_timeout_s : float or None
        End-to-end HTTP timeout of Ray Serve's proxy (None: no limit).
    shutdown_grace_s : float
        At shutdown, new requests get 503 at once; running ones get this long to finish, then
        streams end with an SSE error event (``lserve serve``). Engine replicas stopped by Ray
        Serve (``serve run``, Kubernetes) wait as long for their requests.
    sse_keepalive_s : float
        A stream silent for this long (waiting in the engine's queue, a long prefill) sends an SSE
        comment line ``: keep-alive``, so idle timeouts of proxies keep the connection (0: never).
    stream_interval : int
        Generated tokens an engine replica gathers per streamed event (vLLM's ``--stream-interval``):
        1 sends every token as it comes; N > 1 sends the first token at once, then events of at least
        N tokens (the last one, an error or a finish whatever is pending), so each stream costs the
        replica's host CPU (Ray's per-item streaming) about 1/N as often.
    stream_interval_ms : float
        Least milliseconds between two events with tokens of one stream (0: no floor), as Ray Serve
        LLM's ``stream_batching_interval_ms``; with ``stream_interval`` an event waits for both.
        Unlike a token count it holds nothing back when engine steps are already this slow.
    metrics_dir : str or None
        ``PROMETHEUS_MULTIPROC_DIR`` shared by the ingress and engine replicas on one host (None: a
        fresh temporary folder per deployment).
    """

    # Fields with a help text are also `lserve serve` flags (SERVE_FLAGS); the engine fields are
    # added below, from the config dataclasses (ServeSettings).
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = setting(8000, "HTTP port of the OpenAI-compatible API")
    app_name: str = "lserve"
    served_model_name: str | None = setting(None, "model id in the API (default: the --model value)")
    replicas: int = setting(1, "engine replicas (the initial count with --autoscaling)")
    autoscaling: bool = setting(False, "let Ray Serve scale engine replicas between --min-replicas and --max-replicas")
    min_replicas: int = setting(1, "with --autoscaling: fewest engine replicas")
    max_replicas: int = setting(1, "with --autoscaling: most engine replicas")
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = setting(0, "requests one engine replica holds at once (0: 2 x --max-num-seqs)")
    max_queued_requests: int = setting(64, "requests admitted beyond what the replicas hold; more get 429 + Retry-After")
    overload_status_code: int = 429
    retry_after_s: float = 1.0
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    ingress_num_cpus: float = 0.1
    ingress_max_ongoing_requests: int = 4096
    torch_threads: int = 0
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 10.0
    routing_stats_period_s: float = 1.0
    prefix_block_chars: int = 256
    min_prefix_blocks: int = 2
    imbalance_tokens: int = 2048
    imbalance_ratio: float = 2.0
    request_router: str = "prefix"
    engine_calls_by_value: bool = setting(
        True, "the ingress calls engine replicas over Ray Serve's gRPC transport, streamed items sent by value "
              "(about half the replica CPU per streamed token); off: through Ray object references")
    max_body_bytes: int = 16 * 1024 * 1024
    default_max_tokens: int = 1024
    request_timeout_s: float | None = None
    shutdown_grace_s: float = setting(
        DEFAULT_SHUTDOWN_GRACE_S, "on Ctrl-C/SIGTERM: refuse new requests (503), give running ones this long to "
                                  "finish, then end them with an error event")
    sse_keepalive_s: float = setting(
        DEFAULT_SSE_KEEPALIVE_S, "a stream silent this long (queued, prefilling) sends an SSE comment line "
                                 "': keep-alive' (0: never)")
    stream_interval: int = setting(
        DEFAULT_STREAM_INTERVAL, "generated tokens per streamed chunk: 1 streams every token; N > 1 sends the "
                                 "first token at once, then chunks of N tokens (fewer, larger chunks: less host CPU "
                                 "per token, burstier streams)")
    stream_interval_ms: float = setting(
        DEFAULT_STREAM_INTERVAL_MS, "least milliseconds between two streamed chunks of one stream (0: none; the "
                                    "first token and the finish go at once): fewer chunks with many streams, "
                                    "nothing held when engine steps are slower than this")
    metrics_dir: str | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":  # one GPU per replica when this machine has one, else the CPU
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        require(1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}")
        require(self.replicas >= 1, f"replicas must be >= 1, got {self.replicas}")
        if self.autoscaling:
            require(1 <= self.min_replicas <= self.replicas <= self.max_replicas,
                   f"autoscaling needs 1 <= min_replicas ({self.min_replicas}) <= replicas ({self.replicas}) "
                   f"<= max_replicas ({self.max_replicas})")
            require(self.target_ongoing_requests > 0, "target_ongoing_requests must be > 0")
        require(self.max_ongoing_requests >= 0, f"max_ongoing_requests must be >= 0, got {self.max_ongoing_requests}")
        require(self.max_queued_requests >= -1, "max_queued_requests must be >= 0 (or -1 for no limit)")
        require(self.overload_status_code in (429, 503),
               f"overload_status_code must be 429 or 503, got {self.overload_status_code}")
        require(self.retry_after_s >= 0, "retry_after_s must be >= 0")
        require(self.num_cpus >= 0 and self.num_gpus >= 0 and self.ingress_num_cpus >= 0,
               "num_cpus, num_gpus and ingress_num_cpus must be >= 0")
        require(self.ingress_max_ongoing_requests >= 1, "ingress_max_ongoing_requests must be >= 1")
        require(self.torch_threads >= 0, "torch_threads must be >= 0")
        require(self.health_check_period_s > 0 and self.health_check_timeout_s > 0,
               "health check period and timeout must be > 0")
        require(self.routing_stats_period_s > 0, "routing_stats_period_s must be > 0")
        require(self.prefix_block_chars >= 1 and self.min_prefix_blocks >= 1,
               "prefix_block_chars and min_prefix_blocks must be >= 1")
        require(self.imbalance_tokens >= 0 and self.imbalance_ratio >= 1.0,
               "imbalance_tokens must be >= 0 and imbalance_ratio >= 1")
        require(self.request_router in ("prefix", "default"),
               f"request_router must be prefix or default, got {self.request_router!r}")
        require(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        require(self.default_max_tokens >= 1, "default_max_tokens must be >= 1")
        require(self.request_timeout_s is None or self.request_timeout_s > 0, "request_timeout_s must be > 0")
        require(self.shutdown_grace_s >= 0, f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        require(self.sse_keepalive_s >= 0, f"sse_keepalive_s must be >= 0 (0: off), got {self.sse_keepalive_s}")
        require(isinstance(self.stream_interval, int) and not isinstance(self.stream_interval, bool)
               and self.stream_interval >= 1,
               f"stream_interval must be an integer >= 1 (1: stream every token), got {self.stream_interval!r}")
        require(0 <= self.stream_interval_ms <= 10_000,
               f"stream_interval_ms must be in 0..10000 (0: no floor), got {self.stream_interval_ms}")
        self.engine_config()  # validates the engine fields with the engine's own messages

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ServeSettings:
        """Settings from a plain dict (YAML ``args`` or ``serve run ... key=value`` strings).

        Dashes in keys are accepted, strings are converted to the field's type, unknown keys are
        rejected.
        """
        d = {str(k).replace("-", "_"): v for k, v in (d or {}).items()}
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        require(not unknown, f"unknown serve setting(s): {', '.join(unknown)}")
        return cls(**{k: _coerce(k, v, str(known[k].type), known[k].metadata.get("parse")) for k, v in d.items()})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        """Settings from parsed ``lserve serve`` flags (flags the parser lacks keep their defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        """A plain, picklable and JSON-able dict (what deployments receive)."""
        return asdict(self)

    def check_model_available(self) -> None:
        """Fail fast (:class:`ConfigError`) when ``model`` names nothing loadable on this machine (a
        Hugging Face directory without a tokenizer included), or when ``max_model_len`` is past the
        model's context (:meth:`EngineConfig.check_max_model_len`)."""
        from pathlib import Path

        from lserve.models import presets
        from lserve.models.loader import default_model_path, hf_dir_tokenizer, load_model_config

        if self.model == "default":
            default_model_path()
        elif self.model not in presets.PRESETS:
            path = Path(self.model).expanduser()
            require((path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()),
                   f"model {self.model!r} not found: give a .gguf file, a Hugging Face directory, 'default' or a preset")
            if path.is_dir():
                hf_dir_tokenizer(path)
        if self.max_model_len:
            self.engine_config().check_max_model_len(load_model_config(self.model))

    # -- derived ------------------------------------------------------------------------------
    def engine_config(self) -> EngineConfig:
        """The engine's :class:`EngineConfig` (built by the CLI's own flag mapping)."""
        return engine_config_from_args(self)

    @property
    def model_name(self) -> str:
        """The id of the served model in the OpenAI API."""
        return self.served_model_name or self.model

    @property
    def uses_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def replica_max_ongoing(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_num_seqs

    @property
    def peak_replicas(self) -> int:
        return self.max_replicas if self.autoscaling else self.replicas

    def replica_num_cpus(self, total_cpus: float | None = None) -> float:
        """CPUs one engine replica asks Ray for: explicit, else a share that lets every replica fit."""
        if self.num_cpus:
            return self.num_cpus
        if self.uses_gpu:
            return 1.0
        total = float(total_cpus or os.cpu_count() or 1)
        share = (total - self.ingress_num_cpus) / self.peak_replicas
        return max(0.05, min(1.0, round(share * 0.9, 2)))

    def replica_num_gpus(self) -> float:
        return self.num_gpus or (1.0 if self.uses_gpu else 0.0)

    def replica_torch_threads(self) -> int:
        if self.torch_threads:
            return self.torch_threads
        return max(1, (os.cpu_count() or 1) // self.peak_replicas)


#: The ``lserve serve`` flags of the serving fields (the engine flags come from the config).
SERVE_FLAGS = flags_of(_Serving)


def _engine_field(flag) -> tuple[str, str, Any]:
    """A :class:`ServeSettings` field for one engine flag: its name, type and (serving) default."""
    meta = {"parse": flag.parse} if flag.parse else {}
    return flag.name, flag.annotation, field(default=SERVE_ENGINE_DEFAULTS.get(flag.name, flag.default), metadata=meta)


#: The settings class: the serving fields above, then one field per engine flag.
ServeSettings = make_dataclass("ServeSettings", [_engine_field(f) for f in engine_flags()], bases=(_Serving,),
                               namespace={"__module__": __name__, "__doc__": _Serving.__doc__})
