"""Configuration dataclasses: each engine setting declared once, validated in one place.

Every user-facing knob of the engine lives here as a dataclass field. A field made with
:func:`setting` also carries its ``lserve`` flag in its metadata (help text, choices, the command
line's default where it differs, the flag name where it is not the field's); the CLI's engine flags
(:func:`lserve.cli.add_engine_args`) and the serve settings (:class:`lserve.serve.settings.ServeSettings`)
are built from that metadata (:func:`engine_flags`), and :func:`engine_config_from_args` maps the flags
back. Each dataclass checks its own fields in ``__post_init__`` and raises :class:`ConfigError`
with a one-line message, which the CLI and the HTTP layer show as-is.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

KV_QUANT_CHOICES = ("none", "int8", "int4")
SELECT_MODES = ("kv", "query")
PREFILL_ESTIMATORS = ("antidiagonal", "bound")
# prefill_sparsity_min_len "auto" without a profile of this device and model shape
PREFILL_MIN_LEN_UNPROFILED = 4096
BACKENDS = ("torch", "cupy")
#: Model families the forward implements (``ModelConfig.architecture``).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")
#: MLP gate activations: SiLU (every supported family's default) and the GELU variants.
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")
DTYPES = ("auto", "float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """An invalid setting; the message is meant for the user, one line."""


def require(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``: the one check of every config's validation."""
    if not cond:
        raise ConfigError(msg)


def setting(default: Any, help: str = "", *, flag: str = "", choices: tuple = (),
            parse: Callable[[str], Any] | None = None, cli_default: Any = MISSING) -> Any:
    """A dataclass field with its default and, when ``help`` is given, the flag that sets it.

    Parameters
    ----------
    default
        The library's default (what ``EngineConfig()`` gets).
    help : str
        The flag's help text; a field without one is not a flag (library-only).
    flag : str
        The flag's name with underscores (``--sink`` -> ``"sink"``), when not the field's own.
    choices : tuple
        The values the flag takes (``__post_init__`` checks the same tuple).
    parse : callable, optional
        Turns a string (a flag, a YAML or ``key=value`` setting) into the value; raises
        :class:`ConfigError`. Without one the field's type (int, float, bool, str) decides.
    cli_default
        The default of the command line and the serve settings, where it departs from ``default``.
    """
    meta: dict[str, Any] = {}
    if help:
        meta.update(help=help, flag=flag, choices=tuple(choices), parse=parse,
                    cli_default=default if cli_default is MISSING else cli_default)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Flag:
    """One ``lserve`` flag (and serve setting), read off a config field made with :func:`setting`.

    ``name`` is the flag with underscores (``--token-budget`` -> ``token_budget``, also the serve
    setting's key); ``owner`` and ``field_name`` say which dataclass field it sets; ``annotation`` is
    that field's type as written; ``default`` the command line's default.
    """

    name: str
    owner: type
    field_name: str
    annotation: str
    default: Any
    help: str
    choices: tuple = ()
    parse: Callable[[str], Any] | None = None

    @property
    def kind(self) -> str:
        """``"int"``, ``"float"``, ``"bool"`` or ``"str"`` (anything else is given as text)."""
        return self.annotation if self.annotation in ("int", "float", "bool") else "str"


def flags_of(cls: type) -> tuple[Flag, ...]:
    """The flags a dataclass declares: its fields made with :func:`setting` and a help text."""
    return tuple(Flag(f.metadata["flag"] or f.name, cls, f.name, str(f.type), f.metadata["cli_default"],
                      f.metadata["help"], f.metadata["choices"], f.metadata["parse"])
                 for f in fields(cls) if f.metadata.get("help"))


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
        Hugging Face style: ``{"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ...}``, or
        ``{"rope_type": "freq_factors", "factors": [D/2 floats]}`` (each frequency divided by its
        factor: llama.cpp's ``rope_freqs`` tensor, how a Llama 3.1+ GGUF stores its llama3 scaling).
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
        require(self.num_layers > 0 and self.hidden_size > 0, "model must have layers and a hidden size")
        require(self.num_heads % self.num_kv_heads == 0,
               f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            require(kind in ROPE_TYPES, f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        require(self.architecture in ARCHITECTURES,
               f"unsupported architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        require(self.hidden_act in HIDDEN_ACTS,
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

            require(Path(text).is_file(), f"select_layers: calibration file not found: {text}")
            return text
        items = [t for t in re.split(r"[,;\s]+", text) if t]
        require(bool(items) and all(t.isdigit() for t in items),
               f"select_layers must be auto, all, none, layer indices like 0,5,7 or a calibration .json, "
               f"got {spec!r}")
        spec = [int(t) for t in items]
    require(isinstance(spec, (list, tuple)) and all(isinstance(i, int) and i >= 0 for i in spec),
           f"select_layers indices must be integers >= 0, got {spec!r}")
    return tuple(sorted(set(spec)))


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
        every causal block; -1 (auto, the default): per-layer values calibrated for the model
        (``lserve calibrate-prefill``, :mod:`lserve.calibration.prefill`), on only where they ship
        and the length below is measured (``LLMEngine``'s ``resolve_prefill``).
    prefill_sparsity_min_len : int
        Context (cached + chunk tokens) from which a prefill chunk is block-sparse; -1 (auto):
        the length from which it paid on this device and model shape
        (``lserve bench profile-prefill-threshold``), else :data:`PREFILL_MIN_LEN_UNPROFILED` for a
        set tau (an "auto" tau without a profile is off).
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

    pattern: str | None = setting(
        None, "head pattern: 'auto' (the model's shipped learned pattern, if any), 'none', 'random' "
              "or a DuoAttention-format dir/TSV", cli_default="auto")
    static_sparsity: float = setting(0.5, "fraction of KV heads made streaming")
    sink_tokens: int = setting(128, "streaming heads: sink tokens", flag="sink")
    local_tokens: int = setting(256, "streaming heads: local window tokens", flag="local")
    token_budget: int = setting(4096, "dense heads' decode budget (0: off)")
    reuse_interval: int = setting(4, "run the page selector every C steps")
    dynamic_threshold: int = setting(
        -1, "context below which selection is off (-1: the profiled length for this device, "
            "see lserve bench profile-threshold)")
    dense_layers: int = setting(0, "first N layers stay fully dense")
    select_mode: str = setting("kv", "dynamic selection once per KV head (kv) or per query head (query)",
                               choices=SELECT_MODES)
    pattern_seed: int = 0
    select_layers: str | tuple[int, ...] = setting(
        "auto", "layers where dense heads select pages: 'auto' (the model's shipped calibration, see "
                "lserve calibrate-selection; else all), 'all', 'none', indices '0,5,7' or a calibration .json")
    adaptive_budgets: str = setting(
        "", "per-layer decode budgets around the mean --token-budget: 'auto' (the model's shipped "
            "calibration, see lserve calibrate-budgets), a calibration .json, or '' (off)")
    prefill_sparsity: float = setting(
        -1.0, "dynamic block-sparse prefill of dense heads: estimated attention mass each query "
              "block keeps, in [0, 1] (0: off; torch and cupy backends), or 'auto' (the default): the "
              "model's calibrated per-layer values (lserve calibrate-prefill) from the length this "
              "device's profile says it pays (lserve bench profile-prefill-threshold); off where either is missing",
        parse=parse_prefill_sparsity)
    prefill_sparsity_min_len: int = setting(
        -1, "context (cached + chunk tokens) from which a prefill chunk is block-sparse "
            "(-1: auto, from lserve bench profile-prefill-threshold's profile of this device)")
    prefill_block: int = setting(64, "block-sparse prefill: tokens per key block")
    prefill_q_block: int = setting(
        2048, "block-sparse prefill: query positions sharing one block list (a multiple of --prefill-block)")
    prefill_estimator: str = setting("antidiagonal", "block-sparse prefill: how a block's attention mass is estimated",
                                     choices=PREFILL_ESTIMATORS)
    prefill_stride: int = 16

    def __post_init__(self) -> None:
        self.select_layers = _layer_spec(self.select_layers)
        require(0.0 <= self.static_sparsity <= 1.0,
               f"static_sparsity must be in [0, 1], got {self.static_sparsity}")
        require(self.sink_tokens >= 0 and self.local_tokens >= 1,
               f"sink_tokens must be >= 0 and local_tokens >= 1, got {self.sink_tokens}/{self.local_tokens}")
        require(self.token_budget >= 0, f"token_budget must be >= 0, got {self.token_budget}")
        require(self.reuse_interval >= 1, f"reuse_interval must be >= 1, got {self.reuse_interval}")
        require(self.dynamic_threshold >= -1,
               f"dynamic_threshold must be >= 0 (or -1: auto), got {self.dynamic_threshold}")
        require(self.dense_layers >= 0, f"dense_layers must be >= 0, got {self.dense_layers}")
        require(0.0 <= self.prefill_sparsity <= 1.0 or self.prefill_sparsity == -1.0,
               f"prefill_sparsity must be in [0, 1] (0: off) or -1 (auto), got {self.prefill_sparsity}")
        require(self.prefill_sparsity_min_len >= -1,
               f"prefill_sparsity_min_len must be >= 0 (or -1: auto), got {self.prefill_sparsity_min_len}")
        require(self.prefill_stride >= 1, f"prefill_stride must be >= 1, got {self.prefill_stride}")
        require(self.prefill_block >= 8 and self.prefill_block % self.prefill_stride == 0,
               f"prefill_block must be a multiple of prefill_stride ({self.prefill_stride}) and >= 8, "
               f"got {self.prefill_block}")
        require(self.prefill_q_block >= self.prefill_block and self.prefill_q_block % self.prefill_block == 0,
               f"prefill_q_block must be a multiple of prefill_block ({self.prefill_block}), "
               f"got {self.prefill_q_block}")
        require(self.prefill_estimator in PREFILL_ESTIMATORS,
               f"prefill_estimator must be one of {PREFILL_ESTIMATORS}, got {self.prefill_estimator!r}")
        require(self.select_mode in SELECT_MODES,
               f"select_mode must be one of {SELECT_MODES}, got {self.select_mode!r}")

    @property
    def dynamic(self) -> bool:
        return self.token_budget > 0

    def streaming_enabled(self) -> bool:
        return self.pattern not in (None, "none") and self.static_sparsity > 0

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
        Dense-pool pages; 0 sizes the pool from ``dense_pool_tokens``.
    dense_pool_tokens : int
        Tokens the dense pool holds (``--max-cache-tokens``), when ``num_pages`` is 0.
    kv_quant : str
        ``"none"``, ``"int8"`` or ``"int4"`` storage of K/V.
    host_kv_gib : float
        Host memory (GiB) for dense heads' pages past the device-resident set (``num_pages`` of
        them); 0: off (``docs/host_kv_tier.md``). Refused above the host's available memory.
    """

    page_size: int = setting(64, "physical page N_P")
    logical_page_size: int = setting(16, "logical page N_L")
    num_pages: int = 0
    dense_pool_tokens: int = setting(65536, "dense-pool capacity in tokens", flag="max_cache_tokens")
    kv_quant: str = setting("none", "KV cache quantization", choices=KV_QUANT_CHOICES)
    host_kv_gib: float = setting(0.0, "host memory (GiB) for dense heads' KV pages past the --max-cache-tokens "
                                      "resident on the device (torch and cupy backends; 0: off)")

    def __post_init__(self) -> None:
        require(self.page_size > 0 and self.logical_page_size > 0, "page sizes must be positive")
        require(self.page_size % self.logical_page_size == 0,
               f"page_size {self.page_size} must be a multiple of logical_page_size {self.logical_page_size}")
        require(self.kv_quant in KV_QUANT_CHOICES,
               f"kv_quant must be one of {KV_QUANT_CHOICES}, got {self.kv_quant!r}")
        require(self.num_pages >= 0 and self.dense_pool_tokens > 0,
               f"num_pages must be >= 0 and dense_pool_tokens (--max-cache-tokens) > 0, got "
               f"{self.num_pages}/{self.dense_pool_tokens}")
        if self.num_pages == 0:
            self.num_pages = -(-self.dense_pool_tokens // self.page_size)
        require(self.host_kv_gib >= 0, f"host_kv_gib must be >= 0 (0: off), got {self.host_kv_gib}")
        if self.host_kv_gib:
            free = available_host_bytes()
            require(self.host_kv_gib * 2**30 <= free,
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

    # The command line's defaults (cli_default) aim steps at 0.25 s within 8192 token-equivalents,
    # steps that carry decodes at 100 ms (issue 40's ITL bound; lserve.engine.step_budget), and use
    # the model's shipped head pattern; the library keeps the deterministic 2048-token cap.
    model: str = setting("default", "'default' (SmolLM2-135M-Instruct), a preset (llama3-8b, llama2-7b, minitron-4b, "
                                    "qwen2.5-7b, qwen3-8b, mistral-7b, tiny), a .gguf file or a Hugging Face directory")
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    device: str = setting("cpu", "cpu or cuda[:N]")
    dtype: str = setting("auto", "activations and KV cache (auto: float32 on a CPU, bfloat16 on a GPU)", choices=DTYPES)
    backend: str = setting("torch", "attention backend", choices=BACKENDS)
    max_model_len: int = setting(0, "context limit (0: the model's)")
    allow_long_max_model_len: bool = setting(
        False, "accept a --max-model-len past the model's context (its trained length, stretched by its "
               "rope scaling), whose outputs there are unreliable")
    max_num_seqs: int = setting(16, "sequences decoded together at most")
    max_batched_tokens: int = setting(
        2048, "token-equivalents per step at most (long prompts are prefilled in chunks)", cli_default=8192)
    step_time_target: float = setting(
        0.0, "seconds a step with prefill should take, from measured speed (0: token cap only)", cli_default=0.25)
    itl_slo_ms: float = setting(
        0.0, "ms a step that carries decodes may take (the ITL of running requests while prompts are "
             "prefilled); prefill gets the rest, never less than --min-prefill-share (0: the step target)",
        cli_default=100.0)
    min_prefill_share: float = setting(
        0.3, "least fraction of the time of steps with decodes that prefill gets (at its own speed), "
             "however many requests decode")
    seed: int = setting(0, "seed for random-weight presets")
    cuda_graphs: bool = setting(True, "replay decode steps as CUDA graphs (cupy backend)")
    fused_ops: bool = setting(True, "fused CUDA kernels for RMSNorm/RoPE/SiLU (cupy backend; self-checked at start)")
    async_decode: bool = setting(
        True, "launch each greedy decode step before reading the previous one's tokens (same outputs)")
    prefix_cache: bool = setting(
        True, "reuse the KV pages of prompt prefixes seen before (--no-prefix-cache: recompute every prompt)")

    def __post_init__(self) -> None:
        require(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(self.max_batched_tokens >= 16, f"max_batched_tokens must be >= 16, got {self.max_batched_tokens}")
        require(self.max_model_len >= 0, f"max_model_len must be >= 0, got {self.max_model_len}")
        require(0 <= self.step_time_target <= 60, f"step_time_target must be in [0, 60] seconds, got {self.step_time_target}")
        require(0 <= self.itl_slo_ms <= 60000, f"itl_slo_ms must be in [0, 60000] ms, got {self.itl_slo_ms}")
        require(0 < self.min_prefill_share < 1, f"min_prefill_share must be in (0, 1), got {self.min_prefill_share}")
        for flag in ("cuda_graphs", "fused_ops", "async_decode", "prefix_cache", "allow_long_max_model_len"):
            require(isinstance(getattr(self, flag), bool), f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.backend == "cupy":
            require(self.device.startswith("cuda"), "the cupy backend needs a CUDA device (--device cuda)")
        sparsity, page = self.sparsity, self.cache.page_size
        require(sparsity.sink_tokens % page == 0 and sparsity.local_tokens % page == 0,
               f"sink_tokens ({sparsity.sink_tokens}) and local_tokens ({sparsity.local_tokens}) must be multiples "
               f"of the page size ({page})")
        if sparsity.token_budget:
            require(sparsity.token_budget >= 2 * page,
                   f"token_budget ({sparsity.token_budget}) must be 0 (off) or at least two pages "
                   f"({2 * page} tokens)")

    def check_max_model_len(self, mc: ModelConfig) -> None:
        """Refuse a ``max_model_len`` past what model ``mc`` is made for (:attr:`ModelConfig.context_limit`)
        unless ``allow_long_max_model_len`` accepts that (outputs there are unreliable). The command
        line and the serve settings call it before starting; the Python API leaves it to its caller.

        Raises
        ------
        ConfigError
        """
        limit = mc.context_limit
        require(self.max_model_len <= limit or self.allow_long_max_model_len,
               f"max_model_len {self.max_model_len} is longer than the {limit} tokens model {self.model!r} "
               f"supports ({'its rope scaling included' if mc.rope_scaling else 'no rope scaling configured'}); "
               f"use at most {limit}, or --allow-long-max-model-len (allow_long_max_model_len: true) "
               "to accept unreliable outputs past it")

    def prefix_namespace(self) -> dict[str, Any]:
        """What, besides the tokens, decides a KV page's contents: the prefix cache's hash seed
        (:func:`lserve.cache.page_hash.namespace_seed`), computed alike by the router."""
        sparsity, cache = self.sparsity, self.cache
        # dtype as given (not resolved by device): every replica of a deployment shares its settings
        return {"model": self.model, "dtype": self.dtype, "backend": self.backend, "seed": self.seed,
                "max_model_len": self.max_model_len, "page_size": cache.page_size,
                "logical_page_size": cache.logical_page_size, "kv_quant": cache.kv_quant, "pattern": sparsity.pattern,
                "static_sparsity": sparsity.static_sparsity if sparsity.streaming_enabled() else 0.0,
                "sink": sparsity.sink_tokens, "local": sparsity.local_tokens, "dense_layers": sparsity.dense_layers,
                "pattern_seed": sparsity.pattern_seed,
                # block-sparse prefill changes later layers' K/V (only named when on: old hashes stay)
                **({"prefill": [sparsity.prefill_sparsity, sparsity.prefill_sparsity_min_len, sparsity.prefill_block,
                                sparsity.prefill_q_block, sparsity.prefill_estimator, sparsity.prefill_stride]}
                   if sparsity.prefill_sparsity != 0 else {})}

    def torch_dtype(self):
        """The activation/cache dtype: fp32 on CPU, bf16 on CUDA unless set."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


def engine_flags() -> tuple[Flag, ...]:
    """Every engine flag, in help order: those of :class:`EngineConfig`, :class:`SparsityConfig`
    and :class:`CacheConfig` (the fields made with :func:`setting` and a help text)."""
    return flags_of(EngineConfig) + flags_of(SparsityConfig) + flags_of(CacheConfig)


def engine_flag_defaults() -> dict[str, Any]:
    """The default of every engine flag (flag names, underscores), as the command line has them."""
    return {f.name: f.default for f in engine_flags()}


def engine_config_from_args(a) -> EngineConfig:
    """Build (and validate) an :class:`EngineConfig` from parsed ``lserve`` engine flags (an
    ``argparse.Namespace``, or anything with an attribute per :func:`engine_flags` name: the serve
    settings pass themselves)."""
    values: dict[type, dict[str, Any]] = {EngineConfig: {}, SparsityConfig: {}, CacheConfig: {}}
    for f in engine_flags():
        values[f.owner][f.field_name] = getattr(a, f.name)
    return EngineConfig(sparsity=SparsityConfig(**values[SparsityConfig]), cache=CacheConfig(**values[CacheConfig]),
                        **values[EngineConfig])
