"""Tiny random GGUF files written as llama.cpp's converter writes them: its architecture names,
metadata keys and tensor names, q/k rows permuted for the ``llama`` architecture, F16 matrices and
F32 norms, and the tokenizer metadata of the bundled SmolLM2 GGUF."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

#: Module of a transformers decoder layer -> llama.cpp's tensor name in block N.
BLOCK_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k of the "llama" architecture with each head's two rotary halves interleaved
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def _tokenizer_fields(source: Path) -> list[tuple]:
    """(key, value, type, array element type) of the ``tokenizer.*`` metadata of ``source``
    (read once: the reader takes seconds to index the vocabulary)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    return [(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
            for key, f in reader.fields.items() if key.startswith("tokenizer.")]


def _copy_tokenizer(writer, source: Path) -> None:
    for key, value, vtype, sub in _tokenizer_fields(source):
        writer.add_key_value(key, value, vtype, sub_type=sub)


def write_gguf(path, model, arch: str, general_name: str, rope_theta: float, extra: dict | None = None,
               extra_tensors: dict | None = None) -> Path:
    """Write transformers ``model`` (a Llama, Mistral, Qwen2 or Qwen3) to ``path`` as a GGUF of
    llama.cpp architecture ``arch`` (``llama`` for Llama and Mistral) named ``general_name``.

    ``extra`` holds more metadata (key without the architecture prefix -> (value, GGUFValueType)),
    e.g. rope scaling or fields a loader must refuse (they replace the standard ones);
    ``extra_tensors`` more tensors (name -> array). The model's matrices are rounded to float16 in
    place, so ``model`` stays an exact reference for the file's weights.
    """
    import torch
    from gguf import GGUFValueType, GGUFWriter, LlamaFileType

    from lserve.models.loader import default_model_path

    cfg = model.config
    path = Path(path)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    w = GGUFWriter(str(path), arch)
    w.add_name(general_name)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    meta = {"block_count": (cfg.num_hidden_layers, u32), "context_length": (cfg.max_position_embeddings, u32),
            "embedding_length": (cfg.hidden_size, u32), "feed_forward_length": (cfg.intermediate_size, u32),
            "attention.head_count": (cfg.num_attention_heads, u32),
            "attention.head_count_kv": (cfg.num_key_value_heads, u32), "rope.freq_base": (rope_theta, f32),
            "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, f32), "vocab_size": (cfg.vocab_size, u32),
            "rope.dimension_count": (head_dim, u32), "attention.key_length": (head_dim, u32),
            "attention.value_length": (head_dim, u32)}
    for key, (value, vtype) in {**meta, **(extra or {})}.items():
        w.add_key_value(f"{arch}.{key}", value, vtype)
    _copy_tokenizer(w, default_model_path())
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        module, kind = name.rsplit(".", 1)
        if module in TOP_TENSORS:
            gguf_name = TOP_TENSORS[module]
        else:
            _, _, layer, sub = module.split(".", 3)  # model.layers.N.<sub>
            gguf_name = f"blk.{layer}.{BLOCK_TENSORS[sub]}"
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gguf_name.endswith("attn_q") else cfg.num_key_value_heads
            t = _llama_cpp_permute(t, heads)
        w.add_tensor(f"{gguf_name}.{kind}", t.astype(np.float16 if t.ndim == 2 else np.float32))
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
