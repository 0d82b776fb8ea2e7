"""Gate training (lserve.calibration.classifier): the differentiable forward agrees with the engine,
the trainer lowers its loss and sends a provably local head to streaming, files round-trip."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from logits_capture import capture_logits

from lserve.calibration.classifier import (
    GatedLlama,
    GateTrainConfig,
    gate_loss,
    lambda_mask,
    make_gate_sample,
    train_gates,
)
from lserve.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SparsityConfig
from lserve.engine import LLMEngine, SamplingParams
from lserve.models.loader import load_model
from lserve.models.presets import preset_config
from lserve.sparsity.patterns import HeadLayout, HeadPattern, load_pattern
from lserve.sparsity.shipped import default_pattern_for


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=3)


def test_lambda_mask():
    m = lambda_mask(10, sink=2, local=3)
    assert m[9].tolist() == [True, True, False, False, False, False, False, True, True, True]
    assert m[3].tolist() == [True] * 4 + [False] * 6
    assert not m.triu(1).any()


@pytest.mark.parametrize("kind", ["dense", "streaming", "mixed"])
def test_gated_forward_matches_engine_prefill(tiny, tmp_path, kind):
    """0/1 gates reproduce the engine's dense / streaming heads (and their head order) exactly."""
    mc = tiny.config
    rng = np.random.default_rng(1)
    gates = {"dense": np.ones((mc.num_layers, mc.num_kv_heads)),
             "streaming": np.zeros((mc.num_layers, mc.num_kv_heads)),
             "mixed": (rng.random((mc.num_layers, mc.num_kv_heads)) < 0.5).astype(float)}[kind]
    gates[0, 0], gates[-1, -1] = 0.0, 1.0  # mixed: both kinds present
    if kind != "mixed":
        gates[:] = gates[1, 0]
    HeadPattern(gates, 16, 32).save(tmp_path)
    frac = float((gates == 0).mean())
    sp = SparsityConfig(pattern=str(tmp_path) if frac else None, static_sparsity=frac, sink_tokens=16,
                        local_tokens=32, token_budget=0)
    eng = LLMEngine(EngineConfig(model="tiny", sparsity=sp, cache=CacheConfig(page_size=16, logical_page_size=4,
                                                                           dense_pool_tokens=1024),
                                 max_batched_tokens=96), tiny)
    assert eng.layout.streaming_fraction() == pytest.approx(frac)
    ids = [random.Random(0).randrange(256) for _ in range(300)]
    seen = capture_logits(eng)
    eng.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    ours = seen[-1][0]  # chunked prefill's last logits

    model = GatedLlama(mc, tiny.weights, 16, 32)
    with torch.no_grad():
        h = model.hidden_states(torch.tensor([ids]), torch.tensor(gates, dtype=torch.float32))
        ref = model.logits(h[0, -1])
    assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()


def _local_and_global_model(T: int):
    """One layer, two KV heads (no GQA), head_dim 16: head 0 provably local, head 1 uniform (global).

    Every normalized embedding has coordinate 0 equal to 1. Head 0's q and k read only that
    coordinate into rotary pair 4 (frequency 0.01), so its score is ``c * cos(0.01 * (p - t))`` with
    ``c = 4225``: at distance >= 16 a key scores at least ``c * (1 - cos(0.16)) ~ 54`` below the
    query's own position, a weight below ``e^-54`` -- the full output equals the local-window
    output to ~1e-21. Head 1 has zero q/k weights: uniform attention over the whole prefix.
    """
    H, D, V = 32, 16, 40
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=D, rope_theta=10000.0, max_position_embeddings=4 * T, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(V, H, generator=g)
    emb[:, 0] = 0
    emb[:, 1:] *= (31 / emb[:, 1:].pow(2).sum(1, keepdim=True)).sqrt()  # rest of the row: squared norm 31
    emb[:, 0] = 1.0  # mean square exactly 1, so RMSNorm leaves rows unchanged
    wq = torch.zeros(2 * D, H)
    wk = torch.zeros(2 * D, H)
    wq[4, 0] = wk[4, 0] = 130.0  # head 0, rotary pair (4, 12): frequency 10000 ** (-8 / 16) = 0.01
    w = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(H),
         "model.layers.0.input_layernorm.weight": torch.ones(H),
         "model.layers.0.post_attention_layernorm.weight": torch.ones(H),
         "model.layers.0.self_attn.q_proj.weight": wq, "model.layers.0.self_attn.k_proj.weight": wk,
         "model.layers.0.self_attn.v_proj.weight": torch.randn(2 * D, H, generator=g) / H ** 0.5,
         "model.layers.0.self_attn.o_proj.weight": torch.randn(H, 2 * D, generator=g) / (2 * D) ** 0.5,
         "model.layers.0.mlp.gate_proj.weight": torch.randn(32, H, generator=g) / H ** 0.5,
         "model.layers.0.mlp.up_proj.weight": torch.randn(32, H, generator=g) / H ** 0.5,
         "model.layers.0.mlp.down_proj.weight": torch.randn(H, 32, generator=g) / 32 ** 0.5}
    return cfg, w


@pytest.mark.parametrize("objective", ["mse", "kl"])
def test_trainer_sends_provably_local_head_to_streaming(objective):
    T, sink, local = 128, 4, 16
    cfg, w = _local_and_global_model(T)
    model = GatedLlama(cfg, w, sink, local)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T - 16, T).expand(2, -1)  # [B, P]: the "answer" positions

    # The construction holds: head 0's full output equals its streaming output, head 1's does not.
    with torch.no_grad():
        h_full = model.hidden_states(ids)
        h_s0 = model.hidden_states(ids, torch.tensor([[0.0, 1.0]]))  # only head 0 streaming
        h_s1 = model.hidden_states(ids, torch.tensor([[1.0, 0.0]]))  # only head 1 streaming
    assert (h_s0 - h_full).abs().max().item() < 1e-5
    assert (h_s1 - h_full)[:, -16:].pow(2).mean().item() > 1e-3
    with torch.no_grad():  # the same through the objective: 0 at full attention, > 0 for head 1 streaming
        _, d_full, _ = gate_loss(model, torch.ones(1, 2), ids, pos, 0.0, objective=objective)
        _, c1, _ = gate_loss(model, torch.tensor([[1.0, 0.0]]), ids, pos, 0.0, objective=objective)
    assert d_full < 1e-9 and c1 > 1e-4, (d_full, c1)

    reg = 0.1 * c1
    alpha = torch.full((1, 2), 0.5, requires_grad=True)
    opt = torch.optim.AdamW([alpha], lr=0.05, weight_decay=0.0)
    losses, mses = [], []
    for _ in range(40):
        opt.zero_grad()
        loss, mse, _ = gate_loss(model, alpha, ids, pos, reg, objective=objective)
        loss.backward()
        opt.step()
        with torch.no_grad():
            alpha.clamp_(0, 1)
        losses.append(float(loss))
        mses.append(mse)
    a0, a1 = alpha.detach()[0].tolist()
    assert losses[5] < losses[0] and losses[-1] < 0.5 * losses[0], losses
    assert mses[-1] < 0.2 * mses[0], mses
    assert a0 == 0.0  # clamped all the way down: nothing but the L1 term acts on it
    assert a1 > 0.8, a1  # the global head is held up by the distance term


def test_gate_sample_layout(smol):
    tok = smol.tokenizer
    s = make_gate_sample(tok, 1000, 4, random.Random(5), key_kind="mixed")
    assert len(s.input_ids) == 1000
    for key, (a, b) in zip(s.keys, s.needle_spans):
        assert key in tok.decode(s.input_ids[a:b])
    answer = tok.decode(s.input_ids[s.answer_start:])
    assert all(k in answer for k in s.keys)
    pos = s.loss_positions()
    assert pos[0] == s.answer_start - 1 and pos[-1] == len(s.input_ids) - 2
    # "keys": exactly the positions whose next token belongs to a key, in answer order
    kpos = s.loss_positions("keys")
    assert set(kpos) < set(pos) and len(s.key_spans) == 4
    for key, (a, b) in zip(s.keys, s.key_spans):
        assert a >= s.answer_start and tok.decode(s.input_ids[a:b]).strip() == key
        assert [p for p in kpos if a - 1 <= p < b - 1] == list(range(a - 1, b - 1))
    assert len(kpos) == sum(b - a for a, b in s.key_spans)


def test_train_gates_writes_pattern_and_resumes(tiny, tmp_path):
    cfg = GateTrainConfig(model="tiny", out=str(tmp_path), steps=2, sink_tokens=16, local_tokens=32, min_context=384,
                          max_context=448, num_passkeys=1, checkpoint_every=1, grad_checkpoint=True)
    train_gates(cfg, tiny, progress=False)
    hist = json.loads((tmp_path / "history.json").read_text())
    assert [h["step"] for h in hist] == [1, 2]
    # Resume to 4 steps: the first two are not redone, and the result equals an uninterrupted run.
    cfg.steps = 4
    p = train_gates(cfg, tiny, progress=False)
    hist = json.loads((tmp_path / "history.json").read_text())
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    fresh = GateTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "fresh")})
    q = train_gates(fresh, tiny, progress=False)
    np.testing.assert_allclose(p.alphas, q.alphas, atol=1e-6)
    loaded = load_pattern(tmp_path)
    assert loaded.alphas.shape == (tiny.config.num_layers, tiny.config.num_kv_heads)
    assert (loaded.sink_tokens, loaded.local_tokens) == (16, 32)
    assert loaded.meta["settings"]["reg"] == cfg.reg and loaded.meta["settings"]["steps"] == 4
    assert (tmp_path / "alphas.png").is_file()
    # A checkpoint made with other settings is refused rather than silently mixed.
    with pytest.raises(ConfigError, match="sink_tokens"):
        train_gates(GateTrainConfig(**{**cfg.__dict__, "sink_tokens": 32}), tiny, progress=False)


def test_pattern_round_trip_and_shape_check(tmp_path):
    a = np.random.default_rng(0).random((5, 3))
    HeadPattern(a, 64, 128, {"note": "x"}).save(tmp_path)
    p = load_pattern(tmp_path)
    np.testing.assert_allclose(p.alphas, a, atol=1e-6)
    assert (p.sink_tokens, p.local_tokens, p.meta["note"]) == (64, 128, "x")
    with pytest.raises(ConfigError, match="shape 5x3"):
        HeadLayout.from_pattern(p, 4, 3, 0.5)


def test_shipped_default_pattern(smol):
    path = default_pattern_for(smol.config)
    assert path is not None and path.name == "smollm2-135m"
    assert default_pattern_for(preset_config("llama3-8b")) is None  # no fingerprint, other shapes
    p = load_pattern(path)
    mc = smol.config
    assert p.alphas.shape == (mc.num_layers, mc.num_kv_heads)
    assert ((p.alphas >= 0) & (p.alphas <= 1)).all()
    assert (p.sink_tokens, p.local_tokens) == (128, 256)
    layout = HeadLayout.from_pattern(p, mc.num_layers, mc.num_kv_heads, 0.5)
    assert layout.streaming_fraction() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("kw, message", [({"objective": "ce"}, "objective must be 'mse' or 'kl'"),
                                         ({"loss_on": "all"}, "loss_on must be 'answer' or 'keys'")])
def test_gate_config_refuses_unknown_objective_and_positions(kw, message):
    with pytest.raises(ConfigError, match=message):
        GateTrainConfig(**kw)
