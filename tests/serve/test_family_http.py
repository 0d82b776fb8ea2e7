"""A new family over HTTP: a tiny random Qwen2 checkpoint (GQA 7, q/k/v biases, tied embeddings;
sharded safetensors and a tokenizer, as ``save_pretrained`` writes them) served by a real
``lserve serve --model DIR`` process and driven with the ``openai`` client. Greedy text equals
transformers' ``generate`` and ``/v1/models`` says that no shipped calibration applies."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import openai
import pytest
import torch
from hf_dirs import make_hf_dir
from ports import free_port
from test_shutdown import _wait_for, served

START_TIMEOUT_S = 240.0
PROMPTS = ("Once upon a time, in a land far away, there lived", "The grass is green and the sky is")


@pytest.fixture(scope="module")
def qwen2_server(tmp_path_factory, smol):
    path = tmp_path_factory.mktemp("qwen2")
    hf = make_hf_dir(path, smol.tokenizer, "Qwen2Config", num_attention_heads=7, num_key_value_heads=1, head_dim=16,
                     tie_word_embeddings=True)
    port, log = free_port(), path.parent / "server.log"
    ray_tmp = tempfile.mkdtemp(prefix="lsq-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("LSERVE_API_KEY", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, LSERVE_LOG="WARNING")
    cmd = [sys.executable, "-m", "lserve.cli", "serve", "--model", str(path), "--served-model-name", "tiny-qwen2",
           "--port", str(port), "--device", "cpu", "--replicas", "1", "--max-num-seqs", "4",
           "--max-cache-tokens", "2048", "--max-model-len", "512", "--shutdown-grace-s", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with served(proc, url, log, ray_tmp, START_TIMEOUT_S):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), hf, log


def test_qwen2_dir_served_over_http_equals_transformers_generate(qwen2_server, smol):
    client, hf, log = qwen2_server
    model = client.models.list().data[0]
    assert model.id == "tiny-qwen2"
    sparsity = model.model_extra["sparsity"]
    missing = "(auto: none ships for this model)"
    assert sparsity["shipped"] is None and sparsity["streaming_fraction"] == 0.0
    assert sparsity["pattern"] == f"none {missing}", sparsity  # `serve` asks for `auto` by default
    assert sparsity["select_layers"] == f"all {missing}", sparsity
    # The start-up line prints the summary /v1/models shows (one function feeds both).
    assert sparsity["summary"] == (f"pattern none {missing} (0 of KV heads streaming); decode budget uniform "
                                   f"{sparsity['token_budget']} tokens, selecting layers all {missing}; "
                                   "prefill sparsity off"), sparsity
    # /health answers before `lserve serve` prints its start-up lines (it asks a replica first)
    _wait_for(lambda: "lserve: serving " in log.read_text(), 90, "lserve serve printed no start-up lines in 90 s")
    started = [line for line in log.read_text().splitlines() if line.startswith("lserve: sparsity: ")]
    assert started == [f"lserve: sparsity: {sparsity['summary']}"], log.read_text()
    for prompt in PROMPTS:
        ids = smol.tokenizer.encode(prompt)  # BOS included, as the server encodes it
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=2)[0, len(ids):].tolist()
        out = client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=12, temperature=0)
        ch = out.choices[0]
        if 2 in ref:  # EOS ends our generation: compare up to it
            ref = ref[: ref.index(2)]
            assert ch.finish_reason == "stop"
        else:
            assert ch.finish_reason == "length"
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref)
        assert ch.text == smol.tokenizer.decode(ref)
