"""Serving settings: one validated dataclass shared by ``lserve serve``, the YAML config and tests.

The engine fields carry the CLI flag names (``--token-budget`` -> ``token_budget``) so that a
``serve run`` YAML file, the command line and :func:`lserve.config.engine_config_from_args` all speak
the same language. Everything crosses process boundaries as a plain dict (:meth:`to_dict`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from lserve.config import ConfigError, EngineConfig, SparsityConfig, engine_config_from_args, engine_flag_defaults

#: Fields that describe the engine (names of the ``lserve`` CLI flags, with underscores).
ENGINE_FIELDS = (
    "model", "device", "dtype", "backend", "max_model_len", "max_num_seqs", "max_batched_tokens", "seed",
    "pattern", "static_sparsity", "sink", "local", "token_budget", "reuse_interval", "dynamic_threshold",
    "dense_layers", "select_mode", "select_layers", "adaptive_budgets", "prefill_sparsity", "prefill_sparsity_min_len",
    "prefill_block", "prefill_q_block", "prefill_estimator", "page_size", "logical_page_size", "kv_quant",
    "max_cache_tokens", "host_kv_gib",
    "cuda_graphs", "fused_ops", "async_decode", "step_time_target", "itl_slo_ms", "min_prefill_share",
    "prefix_cache", "allow_long_max_model_len",
)

_D = engine_flag_defaults()
API_KEY_ENV = "LSERVE_API_KEY"
#: Seconds a shutdown lets running requests finish (Kubernetes' default termination grace period;
#: vLLM-style servers drain for about as long). The one default of ``--shutdown-grace-s``.
DEFAULT_SHUTDOWN_GRACE_S = 30.0
#: Seconds of silence after which a stream sends an SSE comment line (well under the 60 s idle
#: timeout common in proxies and load balancers). The one default of ``--sse-keepalive-s``.
DEFAULT_SSE_KEEPALIVE_S = 10.0


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _coerce(name: str, value: Any, type_name: str) -> Any:
    """Convert a string to the field's declared type (``int``, ``float``, ``bool``, optional)."""
    if not isinstance(value, str):
        return value
    if name == "prefill_sparsity":  # a number or "auto"
        return SparsityConfig.parse_prefill_sparsity(value)
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
        _check(low in ("1", "0", "true", "false", "yes", "no", "on", "off"), f"{name} must be true or false, got {value!r}")
        return low in ("1", "true", "yes", "on")
    return value


@dataclass
class ServeSettings:
    """Everything a deployment needs; validated on construction.

    Parameters
    ----------
    model ... max_cache_tokens
        Engine settings, as the ``lserve`` flags of the same names. ``device="auto"`` (the serving
        default) becomes ``"cuda"`` (one GPU per replica) when a CUDA GPU is visible, else ``"cpu"``.
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
    metrics_dir : str or None
        ``PROMETHEUS_MULTIPROC_DIR`` shared by the ingress and engine replicas on one host (None: a
        fresh temporary folder per deployment).
    """

    # -- engine (CLI flag names) --------------------------------------------------------------
    # Defaults from lserve.config.engine_flag_defaults (as the CLI); "device" alone differs here:
    # "auto" picks a GPU when one is visible.
    model: str = _D["model"]
    device: str = "auto"
    dtype: str = _D["dtype"]
    backend: str = _D["backend"]
    max_model_len: int = _D["max_model_len"]
    max_num_seqs: int = _D["max_num_seqs"]
    max_batched_tokens: int = _D["max_batched_tokens"]
    seed: int = _D["seed"]
    pattern: str | None = _D["pattern"]
    static_sparsity: float = _D["static_sparsity"]
    sink: int = _D["sink"]
    local: int = _D["local"]
    token_budget: int = _D["token_budget"]
    reuse_interval: int = _D["reuse_interval"]
    dynamic_threshold: int = _D["dynamic_threshold"]
    dense_layers: int = _D["dense_layers"]
    select_mode: str = _D["select_mode"]
    select_layers: str = _D["select_layers"]
    adaptive_budgets: str = _D["adaptive_budgets"]
    prefill_sparsity: float = _D["prefill_sparsity"]
    prefill_sparsity_min_len: int = _D["prefill_sparsity_min_len"]
    prefill_block: int = _D["prefill_block"]
    prefill_q_block: int = _D["prefill_q_block"]
    prefill_estimator: str = _D["prefill_estimator"]
    page_size: int = _D["page_size"]
    logical_page_size: int = _D["logical_page_size"]
    kv_quant: str = _D["kv_quant"]
    max_cache_tokens: int = _D["max_cache_tokens"]
    host_kv_gib: float = _D["host_kv_gib"]
    cuda_graphs: bool = _D["cuda_graphs"]
    fused_ops: bool = _D["fused_ops"]
    async_decode: bool = _D["async_decode"]
    step_time_target: float = _D["step_time_target"]
    itl_slo_ms: float = _D["itl_slo_ms"]
    min_prefill_share: float = _D["min_prefill_share"]
    prefix_cache: bool = _D["prefix_cache"]
    allow_long_max_model_len: bool = _D["allow_long_max_model_len"]
    # -- serving ------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "lserve"
    served_model_name: str | None = None
    replicas: int = 1
    autoscaling: bool = False
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 0
    max_queued_requests: int = 64
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
    max_body_bytes: int = 16 * 1024 * 1024
    default_max_tokens: int = 1024
    request_timeout_s: float | None = None
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S
    metrics_dir: str | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":  # one GPU per replica when this machine has one, else the CPU
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        _check(1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}")
        _check(self.replicas >= 1, f"replicas must be >= 1, got {self.replicas}")
        if self.autoscaling:
            _check(1 <= self.min_replicas <= self.replicas <= self.max_replicas,
                   f"autoscaling needs 1 <= min_replicas ({self.min_replicas}) <= replicas ({self.replicas}) "
                   f"<= max_replicas ({self.max_replicas})")
            _check(self.target_ongoing_requests > 0, "target_ongoing_requests must be > 0")
        _check(self.max_ongoing_requests >= 0, f"max_ongoing_requests must be >= 0, got {self.max_ongoing_requests}")
        _check(self.max_queued_requests >= -1, "max_queued_requests must be >= 0 (or -1 for no limit)")
        _check(self.overload_status_code in (429, 503),
               f"overload_status_code must be 429 or 503, got {self.overload_status_code}")
        _check(self.retry_after_s >= 0, "retry_after_s must be >= 0")
        _check(self.num_cpus >= 0 and self.num_gpus >= 0 and self.ingress_num_cpus >= 0,
               "num_cpus, num_gpus and ingress_num_cpus must be >= 0")
        _check(self.ingress_max_ongoing_requests >= 1, "ingress_max_ongoing_requests must be >= 1")
        _check(self.torch_threads >= 0, "torch_threads must be >= 0")
        _check(self.health_check_period_s > 0 and self.health_check_timeout_s > 0,
               "health check period and timeout must be > 0")
        _check(self.routing_stats_period_s > 0, "routing_stats_period_s must be > 0")
        _check(self.prefix_block_chars >= 1 and self.min_prefix_blocks >= 1,
               "prefix_block_chars and min_prefix_blocks must be >= 1")
        _check(self.imbalance_tokens >= 0 and self.imbalance_ratio >= 1.0,
               "imbalance_tokens must be >= 0 and imbalance_ratio >= 1")
        _check(self.request_router in ("prefix", "default"),
               f"request_router must be prefix or default, got {self.request_router!r}")
        _check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _check(self.default_max_tokens >= 1, "default_max_tokens must be >= 1")
        _check(self.request_timeout_s is None or self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _check(self.shutdown_grace_s >= 0, f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        _check(self.sse_keepalive_s >= 0, f"sse_keepalive_s must be >= 0 (0: off), got {self.sse_keepalive_s}")
        self.engine_config()  # validates the engine fields with the engine's own messages

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ServeSettings:
        """Settings from a plain dict (YAML ``args`` or ``serve run ... key=value`` strings).

        Dashes in keys are accepted, strings are converted to the field's type, unknown keys are
        rejected.
        """
        d = {str(k).replace("-", "_"): v for k, v in (d or {}).items()}
        types = {f.name: str(f.type) for f in fields(cls)}
        unknown = sorted(set(d) - set(types))
        _check(not unknown, f"unknown serve setting(s): {', '.join(unknown)}")
        return cls(**{k: _coerce(k, v, types[k]) for k, v in d.items()})

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
            _check((path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()),
                   f"model {self.model!r} not found: give a .gguf file, a Hugging Face directory, 'default' or a preset")
            if path.is_dir():
                hf_dir_tokenizer(path)
        if self.max_model_len:
            self.engine_config().check_max_model_len(load_model_config(self.model))

    # -- derived ------------------------------------------------------------------------------
    def engine_config(self) -> EngineConfig:
        """The engine's :class:`EngineConfig` (built by the CLI's own flag mapping)."""
        return engine_config_from_args(argparse.Namespace(**{k: getattr(self, k) for k in ENGINE_FIELDS}))

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
