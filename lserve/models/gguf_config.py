"""The transformers config of a GGUF file, checked and completed from the file's own metadata.

Transformers' GGUF reader maps only some of llama.cpp's metadata keys: it ignores the head size
of ``qwen2``/``qwen3`` files (taking the class default), rope scaling and sliding windows of these
architectures, and calls a ``llama`` file ``mistral`` (which it then cannot load) when its
``general.name`` is exactly ``mistral``. The forward of a GGUF is the one llama.cpp computes from
its metadata; here every key that changes it is carried into the config or refused.
"""

from __future__ import annotations

import copy
import mmap
import struct
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from lserve.config import ConfigError

#: llama.cpp architectures (``general.architecture``) we read, and what they hold. llama.cpp
#: converts ``MistralForCausalLM`` checkpoints to the ``llama`` architecture.
GGUF_ARCHITECTURES = {"llama": "Llama, Mistral", "qwen2": "Qwen2, Qwen2.5", "qwen3": "Qwen3"}
SUPPORTED = ", ".join(f"{a} ({what})" for a, what in GGUF_ARCHITECTURES.items())
#: llama.cpp rope scaling types -> ours (with ``factor``; yarn also with the original context).
ROPE_SCALING = {"linear": "linear", "yarn": "yarn"}
#: llama.cpp yarn keys that tune it away from the Hugging Face defaults we implement.
#: What transformers raises for a GGUF it cannot read or load (its configs validate as strict dataclasses).
READ_ERRORS = (ValueError, OSError, KeyError, NotImplementedError, RuntimeError, StrictDataclassError)
YARN_TUNING = ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
               "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_log_multiplier")


def _refuse(path: Path, what: str) -> None:
    raise ConfigError(f"GGUF file {path}: {what} is not supported (LServe would compute a different forward)")


#: GGUF value type -> struct format of one value (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_header(path: Path) -> tuple[dict, list[str]]:
    """The metadata of the GGUF at ``path`` without its arrays (the tokenizer's vocabulary and
    merges, which the ``gguf`` package's reader takes seconds to index), and its tensor names."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
            raise ValueError("not a little-endian GGUF file of version 2 or 3")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24

        def take(fmt: str):
            nonlocal pos
            out = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return out[0] if len(out) == 1 else out

        def text() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def value(kind: int):
            nonlocal pos
            if kind == 8:
                return text()
            if kind != 9:
                return take(_SCALARS[kind])
            sub, count = take("I"), take("Q")
            if sub in _SCALARS:  # arrays are skipped, not read
                pos += struct.calcsize("<" + _SCALARS[sub]) * count
            else:
                for _ in range(count):
                    value(sub)
            return None

        meta = {}
        for _ in range(n_kv):
            key = text()
            meta[key] = value(take("I"))
        names = []
        for _ in range(n_tensors):
            names.append(text())
            take(f"{take('I')}Q")  # dims
            take("IQ")  # type, offset
    return meta, names


def _metadata(path: Path) -> tuple[str, dict, list[str]]:
    try:
        meta, tensors = read_gguf_header(path)
    except (ValueError, OSError, KeyError, struct.error) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from None
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"GGUF file {path}: architecture {arch!r} is not supported: LServe reads GGUF files "
                          f"of {SUPPORTED}")
    return arch, meta, tensors


def _forward_fields(path: Path, arch: str, meta: dict, tensors: list[str]) -> tuple[int, dict | None]:
    """Head size and rope scaling from the file's own keys (llama.cpp's, prefixed by ``arch``);
    ConfigError for a forward we do not implement."""
    def get(key: str):
        return meta.get(f"{arch}.{key}")

    if get("attention.sliding_window") is not None:
        _refuse(path, f"sliding-window attention (window {get('attention.sliding_window')})")
    if not (get("embedding_length") and get("attention.head_count")):
        raise ConfigError(f"cannot read GGUF file {path}: it has no {arch}.embedding_length or "
                          f"{arch}.attention.head_count")
    head_dim = get("attention.key_length") or get("embedding_length") // get("attention.head_count")
    if (get("attention.value_length") or head_dim) != head_dim:
        _refuse(path, f"a value head size ({get('attention.value_length')}) other than the key's ({head_dim})")
    if (get("rope.dimension_count") or head_dim) != head_dim:
        _refuse(path, f"rotary embeddings on {get('rope.dimension_count')} of {head_dim} head dimensions")
    kind = get("rope.scaling.type") or ("linear" if get("rope.scale_linear") else "none")
    if "rope_freqs.weight" in tensors:  # how llama.cpp stores Llama 3.1+'s llama3 scaling
        if kind != "none":
            _refuse(path, f"per-frequency rope factors (rope_freqs) together with rope scaling {kind!r}")
        return head_dim, {"rope_type": "freq_factors", "factors": _rope_freqs(path, head_dim)}
    if kind == "none":
        return head_dim, None
    if kind not in ROPE_SCALING or any(get(k) is not None for k in YARN_TUNING):
        _refuse(path, f"rope scaling {kind!r} with these parameters")
    scaling = {"rope_type": ROPE_SCALING[kind], "factor": float(get("rope.scaling.factor") or get("rope.scale_linear"))}
    if kind == "yarn":
        if get("rope.scaling.original_context_length") is None:
            _refuse(path, "yarn rope scaling without its original context length")
        scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    return head_dim, scaling


def _rope_freqs(path: Path, head_dim: int) -> list[float]:
    """The ``rope_freqs`` tensor of a GGUF (one factor per rotary frequency), read with the ``gguf``
    package (only such files pay for its full read)."""
    from gguf import GGUFReader

    (t,) = [t for t in GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight"]
    factors = [float(x) for x in t.data.reshape(-1)]
    if len(factors) != head_dim // 2 or not all(f > 0 for f in factors):
        _refuse(path, f"rope_freqs with {len(factors)} factors for head size {head_dim} (or not all positive)")
    return factors


def gguf_hf_config(path: Path):
    """The transformers config of the GGUF at ``path``, with what transformers' reader misses
    (head size, rope scaling) set from the file and what we do not implement refused.

    Raises
    ------
    ConfigError
        For another architecture than :data:`GGUF_ARCHITECTURES`, a sliding window, partial
        rotary embeddings, per-frequency rope factors (``rope_freqs``) beside another scaling, or
        another rope scaling.
    """
    from transformers import AutoConfig, LlamaConfig

    arch, meta, tensors = _metadata(path)
    head_dim, scaling = _forward_fields(path, arch, meta, tensors)  # before the slow part
    try:
        hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except READ_ERRORS as e:
        raise ConfigError(f"cannot read GGUF file {path}: {' '.join(str(e).split())[:300]}") from None
    if hf.model_type == "mistral":
        # A llama-architecture file that transformers names "mistral" but cannot load: its forward is
        # Llama's (llama.cpp keeps no window for this architecture), so read it as Llama.
        hf = LlamaConfig(**{k: v for k, v in hf.to_dict().items() if k not in ("model_type", "sliding_window")})
    hf.head_dim = head_dim
    if scaling:
        hf.rope_parameters = {**(getattr(hf, "rope_parameters", None) or {}), **scaling}
    return hf


def weights_config(hf):
    """``hf`` for transformers to load the file's weights into: a ``freq_factors`` rope (ours, which
    transformers does not build) becomes the plain rope; the weights do not depend on it."""
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type") != "freq_factors":
        return hf
    out = copy.deepcopy(hf)
    out.rope_parameters = {k: v for k, v in rope.items() if k not in ("rope_type", "factors")} | {"rope_type": "default"}
    return out
