"""The compiled graph reproduces transformers: run in onnxruntime with the plugin reference ops,
prefill, decode through the paged cache, and mixed batches of prefill chunks and decode tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from conftest import TINY_NAMES
from harness.golden import run_scenario
from trtc.artifact import read_manifest
from trtc.compiler.tiny import tiny_model


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_models_match_transformers(tiny_artifacts, name):
    artifact = tiny_artifacts[name]
    hf = tiny_model(name, seed=0)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 23, 30)]
    run = run_scenario(artifact, hf, *prompts)
    assert run.rows == 28
    m = read_manifest(artifact)
    if name == "tiny-mistral":
        # The prompts outgrow the 24-token window, so the sliding window was exercised.
        assert m.model.sliding_windows == (24, 24)
    if name == "tiny-qwen2":
        assert m.model.qkv_bias and "model.layers.0.self_attn.qkv_proj.bias" in open(
            artifact / "model.onnx", "rb"
        ).read().decode("latin1")
    if name == "tiny-qwen3":
        # Per-head q/k norms (weights not all ones, q's and k's apart), a head_dim that is not
        # hidden / heads, GQA, tied embeddings, no Q/K/V bias.
        assert m.model.qk_norm and not m.model.qkv_bias
        assert m.model.head_dim == 32 != m.model.hidden_size // m.model.num_heads
        assert m.model.num_kv_heads < m.model.num_heads and m.model.tie_word_embeddings
        attn = hf.model.layers[0].self_attn
        assert not torch.equal(attn.q_norm.weight, attn.k_norm.weight)
        assert not torch.equal(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))


@pytest.mark.slow
def test_smollm2_fp32_matches_transformers(smollm2_fp32, smollm2_hf):
    hf, _ = smollm2_hf
    tok = AutoTokenizer.from_pretrained(smollm2_fp32 / "tokenizer")
    chat = tok.apply_chat_template(
        [
            {
                "role": "user",
                "content": "What is the capital of France? "
                "Answer in one short sentence, please, and then stop.",
            }
        ],
        add_generation_prompt=True,
        tokenize=True,
    )
    chat = list(chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat)
    text = tok(
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
        "France. It is named after the engineer Gustave Eiffel, whose company designed and "
        "built the tower from 1887 to 1889."
    )["input_ids"]
    prompt_a = (chat + text)[:40] if len(chat) < 40 else chat[-40:]
    run = run_scenario(smollm2_fp32, hf, prompt_a, text[:25], chat[:33])
    assert run.rows == 28
    print(
        f"SmolLM2 fp32 graph vs transformers: max |logit diff| {run.max_diff:.2e} "
        f"over {run.rows} rows"
    )
