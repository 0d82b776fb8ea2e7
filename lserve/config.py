"""Configuration dataclasses: one source of defaults, validated in one place.

Every user-facing knob of the engine lives here. Each dataclass checks its own fields in
``__post_init__`` and raises :class:`ConfigError` with a one-line message, which the CLI
and the HTTP layer show as-is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

KV_QUANT_CHOICES = ("none", "int8", "int4")
SELECT_MODES = ("kv", "query")
PREFILL_ESTIMATORS = ("antidiagonal", "bound")
# prefill_sparsity_min_len "auto" without a profile of this device and model shape
PREFILL_MIN_LEN_UNPROFILED = 4096
BACKENDS = ("torch", "cupy")
#: Model families the forward implements (``ModelConfig.architecture``).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
#: MLP gate activations: SiLU (every supported family's default) and the GELU variants.
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """An invalid setting; the message is meant for the user, one line."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def available_host_bytes() -> int:
    """Memory this host can still give (``MemAvailable`` of /proc/meminfo, else free pages)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3).

    Parameters
    ----------
    rope_scaling : dict or None
        Hugging Face style: ``{"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ...}``.
    architecture : str
        The family (:data:`ARCHITECTURES`); the fields below say how its forward differs.
    qkv_bias, o_bias, mlp_bias : bool
        Bias vectors on the q/k/v projections, the output projection, the MLP projections.
    qk_norm : bool
        Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    hidden_act : str
        The MLP's gate activation (:data:`HIDDEN_ACTS`).
    fingerprint : str
        A digest of a few weights (:func:`lserve.identity.fingerprint`), set by the loader;
        with the shapes it identifies the model for its shipped calibrations.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    architecture: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        _check(self.num_layers > 0 and self.hidden_size > 0, "model must have layers and a hidden size")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        _check(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            _check(kind in ROPE_TYPES, f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        _check(self.architecture in ARCHITECTURES,
               f"unsupported architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        _check(self.hidden_act in HIDDEN_ACTS,
               f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(HIDDEN_ACTS)})")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def context_limit(self) -> int:
        """The longest context the model is made for: its trained length, stretched by a
        ``linear`` or ``dynamic`` rope scaling (``factor`` times the original length; a
        ``llama3`` scaling is already counted in ``max_position_embeddings``, as in Hugging
        Face configs)."""
        rs = self.rope_scaling or {}
        if rs.get("rope_type", rs.get("type")) in ("linear", "dynamic"):
            original = int(rs.get("original_max_position_embeddings", self.max_position_embeddings))
            return max(self.max_position_embeddings, int(original * float(rs["factor"])))
        return self.max_position_embeddings


SELECT_LAYER_WORDS = ("auto", "all", "none")


def _layer_spec(spec) -> str | tuple[int, ...]:
    """``select_layers`` normalised: a keyword, a calibration JSON path or sorted layer indices."""
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() in SELECT_LAYER_WORDS:
            return text.lower()
        if text.endswith(".json"):
            from pathlib import Path

            _check(Path(text).is_file(), f"select_layers: calibration file not found: {text}")
            return text
        items = [t for t in re.split(r"[,;\s]+", text) if t]
        _check(bool(items) and all(t.isdigit() for t in items),
               f"select_layers must be auto, all, none, layer indices like 0,5,7 or a calibration .json, "
               f"got {spec!r}")
        spec = [int(t) for t in items]
    _check(isinstance(spec, (list, tuple)) and all(isinstance(i, int) and i >= 0 for i in spec),
           f"select_layers indices must be integers >= 0, got {spec!r}")
    return tuple(sorted(set(spec)))


@dataclass
class SparsityConfig:
    """Unified block-sparse attention settings (SPEC.md sections 2-4).

    Parameters
    ----------
    pattern : str or None
        Head pattern: a DuoAttention-format directory/TSV path, ``"random"``, ``"auto"`` (the
        learned pattern shipped for this model, if any), or None/``"none"`` for no streaming heads.
    static_sparsity : float
        Fraction of KV heads that become streaming heads (quantile of the gate values).
    sink_tokens, local_tokens : int
        The Λ mask of streaming heads: first ``sink_tokens`` and last ``local_tokens``.
    token_budget : int
        Tokens each dense head attends to at decode (0 disables dynamic selection).
    reuse_interval : int
        Run the page selector every ``reuse_interval`` decode steps (C in the paper).
    dynamic_threshold : int
        Context length below which dynamic selection is off (dense heads read every page);
        -1 ("auto"): the length profiled for this device and model shape by ``lserve bench
        profile-threshold`` (:mod:`lserve.sparsity.threshold`), 0 when none is on record.
    dense_layers : int
        The first ``dense_layers`` layers keep every head dense and unselected.
    select_mode : str
        ``"kv"`` selects once per KV head (group scores max-reduced), ``"query"`` per query head.
    select_layers : str or tuple of int
        Layers where dense heads use dynamic selection (elsewhere they read every page):
        ``"auto"`` (the calibration shipped for the model, see
        :mod:`lserve.sparsity.layer_select`; every layer when none ships), ``"all"``, ``"none"``,
        layer indices (a tuple, or a string ``"0,5,7"``) or a calibration JSON path written by
        ``lserve calibrate-selection``. Normalised here: indices become a sorted tuple.
    adaptive_budgets : str
        Per-layer decode budgets (torch and cupy backends; :mod:`lserve.sparsity.adaptive_budget`):
        ``""`` (off: every selecting layer keeps ``token_budget``), ``"auto"`` (the calibration
        shipped beside the model's pattern) or a JSON written by ``lserve calibrate-budgets``;
        ``token_budget`` is then the dense-head-weighted mean budget.
    prefill_sparsity : float
        Dynamic block-sparse prefill of dense heads (:mod:`lserve.sparsity.prefill_blocks`): the
        estimated attention mass each (KV head, query block) keeps, in [0, 1]; 0 is off, 1 keeps
        every causal block; -1 (auto): per-layer values calibrated for the model (``lserve
        calibrate-prefill``, :mod:`lserve.calibration.prefill`), off without one.
    prefill_sparsity_min_len : int
        Context (cached + chunk tokens) from which a prefill chunk is block-sparse; -1 (auto):
        the length from which it paid on this device and model shape
        (``lserve bench profile-prefill-threshold``), else :data:`PREFILL_MIN_LEN_UNPROFILED`.
    prefill_block : int
        Tokens per KV block of the block list (a multiple of ``prefill_stride``).
    prefill_q_block : int
        Query positions sharing one block list (a multiple of ``prefill_block``): large rows let
        the kept keys of a row gather into one dense attention call on a GPU.
    prefill_estimator : str
        ``"antidiagonal"`` or ``"bound"``: how a block's attention mass is estimated.
    prefill_stride : int
        Antidiagonal stride S: the estimate costs about 1/S of the attention's score products.
    """

    pattern: str | None = None
    static_sparsity: float = 0.5
    sink_tokens: int = 128
    local_tokens: int = 256
    token_budget: int = 4096
    reuse_interval: int = 4
    dynamic_threshold: int = -1
    dense_layers: int = 0
    select_mode: str = "kv"
    pattern_seed: int = 0
    select_layers: str | tuple[int, ...] = "auto"
    adaptive_budgets: str = ""
    prefill_sparsity: float = 0.0
    prefill_sparsity_min_len: int = -1
    prefill_block: int = 64
    prefill_q_block: int = 2048
    prefill_estimator: str = "antidiagonal"
    prefill_stride: int = 16

    def __post_init__(self) -> None:
        self.select_layers = _layer_spec(self.select_layers)
        _check(0.0 <= self.static_sparsity <= 1.0,
               f"static_sparsity must be in [0, 1], got {self.static_sparsity}")
        _check(self.sink_tokens >= 0 and self.local_tokens >= 1,
               f"sink_tokens must be >= 0 and local_tokens >= 1, got {self.sink_tokens}/{self.local_tokens}")
        _check(self.token_budget >= 0, f"token_budget must be >= 0, got {self.token_budget}")
        _check(self.reuse_interval >= 1, f"reuse_interval must be >= 1, got {self.reuse_interval}")
        _check(self.dynamic_threshold >= -1,
               f"dynamic_threshold must be >= 0 (or -1: auto), got {self.dynamic_threshold}")
        _check(self.dense_layers >= 0, f"dense_layers must be >= 0, got {self.dense_layers}")
        _check(0.0 <= self.prefill_sparsity <= 1.0 or self.prefill_sparsity == -1.0,
               f"prefill_sparsity must be in [0, 1] (0: off) or -1 (auto), got {self.prefill_sparsity}")
        _check(self.prefill_sparsity_min_len >= -1,
               f"prefill_sparsity_min_len must be >= 0 (or -1: auto), got {self.prefill_sparsity_min_len}")
        _check(self.prefill_stride >= 1, f"prefill_stride must be >= 1, got {self.prefill_stride}")
        _check(self.prefill_block >= 8 and self.prefill_block % self.prefill_stride == 0,
               f"prefill_block must be a multiple of prefill_stride ({self.prefill_stride}) and >= 8, "
               f"got {self.prefill_block}")
        _check(self.prefill_q_block >= self.prefill_block and self.prefill_q_block % self.prefill_block == 0,
               f"prefill_q_block must be a multiple of prefill_block ({self.prefill_block}), "
               f"got {self.prefill_q_block}")
        _check(self.prefill_estimator in PREFILL_ESTIMATORS,
               f"prefill_estimator must be one of {PREFILL_ESTIMATORS}, got {self.prefill_estimator!r}")
        _check(self.select_mode in SELECT_MODES,
               f"select_mode must be one of {SELECT_MODES}, got {self.select_mode!r}")

    @property
    def dynamic(self) -> bool:
        return self.token_budget > 0

    def streaming_enabled(self) -> bool:
        return self.pattern not in (None, "none") and self.static_sparsity > 0

    @staticmethod
    def parse_prefill_sparsity(spec: str | float) -> float:
        """A ``prefill_sparsity`` as a flag or a config file writes it: a number, or "auto" (-1)."""
        if isinstance(spec, str):
            if spec.strip().lower() == "auto":
                return -1.0
            try:
                return float(spec)
            except ValueError:
                raise ConfigError(f"prefill_sparsity must be a number in [0, 1] or 'auto', got {spec!r}") from None
        return float(spec)

    def request_prefill_sparsity(self, override: float | None) -> float:
        """A request's prefill tau: its own (``SamplingParams.prefill_sparsity``), else this config's."""
        return self.prefill_sparsity if override is None else override


@dataclass
class CacheConfig:
    """Two-way paged KV cache.

    Parameters
    ----------
    page_size : int
        Physical page N_P (tokens per page in memory).
    logical_page_size : int
        Logical page N_L for key statistics; ``page_size`` must be a multiple of it.
    num_pages : int
        Dense-pool pages; 0 sizes the pool from ``max_tokens``.
    kv_quant : str
        ``"none"``, ``"int8"`` or ``"int4"`` storage of K/V.
    host_kv_gib : float
        Host memory (GiB) for dense heads' pages past the device-resident set (``num_pages`` of
        them); 0: off (``docs/host_kv_tier.md``). Refused above the host's available memory.
    """

    page_size: int = 64
    logical_page_size: int = 16
    num_pages: int = 0
    max_tokens: int = 65536
    kv_quant: str = "none"
    host_kv_gib: float = 0.0

    def __post_init__(self) -> None:
        _check(self.page_size > 0 and self.logical_page_size > 0, "page sizes must be positive")
        _check(self.page_size % self.logical_page_size == 0,
               f"page_size {self.page_size} must be a multiple of logical_page_size {self.logical_page_size}")
        _check(self.kv_quant in KV_QUANT_CHOICES,
               f"kv_quant must be one of {KV_QUANT_CHOICES}, got {self.kv_quant!r}")
        _check(self.num_pages >= 0 and self.max_tokens > 0, "num_pages must be >= 0 and max_tokens > 0")
        if self.num_pages == 0:
            self.num_pages = -(-self.max_tokens // self.page_size)
        _check(self.host_kv_gib >= 0, f"host_kv_gib must be >= 0 (0: off), got {self.host_kv_gib}")
        if self.host_kv_gib:
            free = available_host_bytes()
            _check(self.host_kv_gib * 2**30 <= free,
                   f"--host-kv-gib {self.host_kv_gib:g} is more than the {free / 2**30:.1f} GiB of memory this host "
                   "has available")

    @property
    def pages_per_logical(self) -> int:
        """g = N_P / N_L."""
        return self.page_size // self.logical_page_size


@dataclass
class EngineConfig:
    """Everything an engine needs; builds on the three configs above.

    Parameters
    ----------
    model : str
        ``"default"`` (bundled SmolLM2-135M-Instruct), a preset name, a ``.gguf`` file or a
        Hugging Face directory.
    max_num_seqs : int
        Sequences running at once (decode batch).
    max_batched_tokens : int
        Tokens per step; longer prompts are prefilled in chunks of this size.
    cuda_graphs : bool
        Replay decode-only steps as CUDA graphs (cupy backend; see
        :mod:`lserve.engine.cuda_graphs`).
    fused_ops : bool
        Residual add + RMSNorm, RoPE and SiLU-mul as fused CUDA kernels (cupy backend; see
        :mod:`lserve.models.fused`). Each engine checks them against the torch code on random
        inputs at start and keeps the torch path if they disagree or do not build.
    async_decode : bool
        Launch each greedy decode step before reading the previous step's tokens, so the host
        work of one overlaps the GPU work of the other (see :mod:`lserve.engine.async_decode`);
        outputs are unchanged.
    step_time_target : float
        Seconds a step with prefill should take (0: no time model, ``max_batched_tokens`` alone
        bounds a step). The prefill budget then follows measured speed and an attention-aware
        cost per chunk (:mod:`lserve.engine.step_budget`), so steps stay short at any context.
    itl_slo_ms : float
        Milliseconds a step that carries decodes should take at most (the inter-token latency
        running requests see while prompts are prefilled); 0: ``step_time_target`` bounds such
        steps too. Prefill gets what the decodes leave, never less than ``min_prefill_share``
        (:mod:`lserve.engine.step_budget` states the rule).
    min_prefill_share : float
        The least fraction of the time of steps that carry decodes that goes to prefill, counted
        at the prefill-only rate, in (0, 1): a waiting prompt's TTFT stays within about its
        prefill time alone over this, however many decodes run.
    prefix_cache : bool
        Keep full prompt pages after their request and reuse them for later prompts that start
        the same way (:mod:`lserve.cache.prefix_cache`); idle cached pages are evicted, least
        recently used first, only when an allocation needs them.
    """

    model: str = "default"
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    backend: str = "torch"
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 16
    max_batched_tokens: int = 2048
    max_model_len: int = 0  # 0 -> model's max_position_embeddings
    allow_long_max_model_len: bool = False
    seed: int = 0
    cuda_graphs: bool = True
    fused_ops: bool = True
    async_decode: bool = True
    step_time_target: float = 0.0
    itl_slo_ms: float = 0.0
    min_prefill_share: float = 0.3
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        _check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check(self.dtype in ("auto", "float32", "float16", "bfloat16"),
               f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_batched_tokens >= 16, f"max_batched_tokens must be >= 16, got {self.max_batched_tokens}")
        _check(self.max_model_len >= 0, f"max_model_len must be >= 0, got {self.max_model_len}")
        _check(0 <= self.step_time_target <= 60, f"step_time_target must be in [0, 60] seconds, got {self.step_time_target}")
        _check(0 <= self.itl_slo_ms <= 60000, f"itl_slo_ms must be in [0, 60000] ms, got {self.itl_slo_ms}")
        _check(0 < self.min_prefill_share < 1, f"min_prefill_share must be in (0, 1), got {self.min_prefill_share}")
        for flag in ("cuda_graphs", "fused_ops", "async_decode", "prefix_cache", "allow_long_max_model_len"):
            _check(isinstance(getattr(self, flag), bool), f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.backend == "cupy":
            _check(self.device.startswith("cuda"), "the cupy backend needs a CUDA device (--device cuda)")
            _check(not self.cache.host_kv_gib, "the host KV tier (--host-kv-gib) runs on the torch backend only so far")
        sp, cc = self.sparsity, self.cache
        _check(sp.sink_tokens % cc.page_size == 0 and sp.local_tokens % cc.page_size == 0,
               f"sink_tokens ({sp.sink_tokens}) and local_tokens ({sp.local_tokens}) must be multiples "
               f"of the page size ({cc.page_size})")
        if sp.token_budget:
            _check(sp.token_budget >= 2 * cc.page_size,
                   f"token_budget ({sp.token_budget}) must be 0 (off) or at least two pages "
                   f"({2 * cc.page_size} tokens)")

    def check_max_model_len(self, mc: ModelConfig) -> None:
        """Refuse a ``max_model_len`` past what model ``mc`` is made for (:attr:`ModelConfig.context_limit`)
        unless ``allow_long_max_model_len`` accepts that (outputs there are unreliable). The command
        line and the serve settings call it before starting; the Python API leaves it to its caller.

        Raises
        ------
        ConfigError
        """
        limit = mc.context_limit
        _check(self.max_model_len <= limit or self.allow_long_max_model_len,
               f"max_model_len {self.max_model_len} is longer than the {limit} tokens model {self.model!r} "
               f"supports ({'its rope scaling included' if mc.rope_scaling else 'no rope scaling configured'}); "
               f"use at most {limit}, or --allow-long-max-model-len (allow_long_max_model_len: true) "
               "to accept unreliable outputs past it")

    def prefix_namespace(self) -> dict[str, Any]:
        """What, besides the tokens, decides a KV page's contents: the prefix cache's hash seed
        (:func:`lserve.cache.page_hash.namespace_seed`), computed alike by the router."""
        sp, cc = self.sparsity, self.cache
        # dtype as given (not resolved by device): every replica of a deployment shares its settings
        return {"model": self.model, "dtype": self.dtype, "backend": self.backend, "seed": self.seed,
                "max_model_len": self.max_model_len, "page_size": cc.page_size,
                "logical_page_size": cc.logical_page_size, "kv_quant": cc.kv_quant, "pattern": sp.pattern,
                "static_sparsity": sp.static_sparsity if sp.streaming_enabled() else 0.0,
                "sink": sp.sink_tokens, "local": sp.local_tokens, "dense_layers": sp.dense_layers,
                "pattern_seed": sp.pattern_seed,
                # block-sparse prefill changes later layers' K/V (only named when on: old hashes stay)
                **({"prefill": [sp.prefill_sparsity, sp.prefill_sparsity_min_len, sp.prefill_block, sp.prefill_q_block,
                                sp.prefill_estimator, sp.prefill_stride]} if sp.prefill_sparsity != 0 else {})}

    def torch_dtype(self):
        """The activation/cache dtype: fp32 on CPU, bf16 on CUDA unless set."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


def engine_config_from_args(a) -> EngineConfig:
    """Build (and validate) an :class:`EngineConfig` from parsed ``lserve`` engine flags (an
    ``argparse.Namespace``, or anything with the same attributes: the serve settings pass theirs)."""
    sd = SparsityConfig  # the class's field defaults, for namespaces without the newer flags
    sp = SparsityConfig(pattern=a.pattern, static_sparsity=a.static_sparsity, sink_tokens=a.sink,
                        local_tokens=a.local, token_budget=a.token_budget, reuse_interval=a.reuse_interval,
                        dynamic_threshold=a.dynamic_threshold, dense_layers=a.dense_layers,
                        select_mode=a.select_mode, select_layers=a.select_layers,
                        adaptive_budgets=getattr(a, "adaptive_budgets", ""),
                        prefill_sparsity=getattr(a, "prefill_sparsity", sd.prefill_sparsity),
                        prefill_sparsity_min_len=getattr(a, "prefill_sparsity_min_len", sd.prefill_sparsity_min_len),
                        prefill_block=getattr(a, "prefill_block", sd.prefill_block),
                        prefill_q_block=getattr(a, "prefill_q_block", sd.prefill_q_block),
                        prefill_estimator=getattr(a, "prefill_estimator", sd.prefill_estimator))
    cc = CacheConfig(page_size=a.page_size, logical_page_size=a.logical_page_size, kv_quant=a.kv_quant,
                     max_tokens=a.max_cache_tokens, host_kv_gib=getattr(a, "host_kv_gib", 0.0))
    return EngineConfig(model=a.model, sparsity=sp, cache=cc, backend=a.backend, device=a.device, dtype=a.dtype,
                        max_num_seqs=a.max_num_seqs, max_batched_tokens=a.max_batched_tokens,
                        max_model_len=a.max_model_len, seed=a.seed,
                        allow_long_max_model_len=getattr(a, "allow_long_max_model_len", False),
                        cuda_graphs=a.cuda_graphs, fused_ops=a.fused_ops, async_decode=a.async_decode,
                        step_time_target=a.step_time_target, itl_slo_ms=a.itl_slo_ms,
                        min_prefill_share=a.min_prefill_share,
                        prefix_cache=getattr(a, "prefix_cache", True))


#: Where the command line (``lserve generate`` / ``lserve serve`` flags, the serve settings)
#: departs from the dataclasses' library defaults: the model's shipped head pattern, and steps
#: that aim at 0.25 s within 8192 token-equivalents, steps that carry decodes at most 100 ms (issue
#: 40's default ITL bound; see :mod:`lserve.engine.step_budget`; the library keeps the deterministic
#: 2048-token cap).
CLI_OVERRIDES = {"pattern": "auto", "max_batched_tokens": 8192, "step_time_target": 0.25, "itl_slo_ms": 100.0}
#: Engine flag name -> (config object, field) where its default lives.
_FLAG_FIELDS = {"sink": ("sparsity", "sink_tokens"), "local": ("sparsity", "local_tokens"),
                "max_cache_tokens": ("cache", "max_tokens")}


def engine_flag_defaults() -> dict[str, Any]:
    """The default of every engine flag (CLI names, underscores): the config dataclasses' own
    values with :data:`CLI_OVERRIDES` applied. The CLI and the serve settings read theirs here."""
    objs = {"engine": EngineConfig(), "sparsity": SparsityConfig(), "cache": CacheConfig()}
    flags = ("model", "device", "dtype", "backend", "max_model_len", "max_num_seqs", "max_batched_tokens", "seed",
             "cuda_graphs", "fused_ops", "async_decode", "step_time_target", "itl_slo_ms", "min_prefill_share",
             "prefix_cache", "allow_long_max_model_len")
    out = {f: getattr(objs["engine"], f) for f in flags}
    for f in ("pattern", "static_sparsity", "token_budget", "reuse_interval", "dynamic_threshold", "dense_layers",
              "select_mode", "select_layers", "adaptive_budgets", "prefill_sparsity", "prefill_sparsity_min_len",
              "prefill_block", "prefill_q_block", "prefill_estimator"):
        out[f] = getattr(objs["sparsity"], f)
    for f in ("page_size", "logical_page_size", "kv_quant", "host_kv_gib"):
        out[f] = getattr(objs["cache"], f)
    for flag, (obj, name) in _FLAG_FIELDS.items():
        out[flag] = getattr(objs[obj], name)
    out.update(CLI_OVERRIDES)
    return out

