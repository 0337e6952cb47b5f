"""Tiny random-initialised models for tests: real transformers architectures at toy sizes,
with a byte-level tokenizer built in code, so nothing is downloaded."""

from __future__ import annotations

# transformers and torch are imported inside the functions: config validation (which needs
# only the names) stays fast.

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|eos|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_COMMON = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256 + len(SPECIAL_TOKENS),
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
    rms_norm_eps=1e-5,
)

# name -> (transformers config class, its arguments)
TINY_MODELS = {
    # GQA 4:2, untied head, llama3 rope scaling.
    "tiny-llama": (
        "LlamaConfig",
        dict(
            _COMMON,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Sliding-window attention shorter than the test prompts, tied embeddings, MQA.
    "tiny-mistral": (
        "MistralConfig",
        dict(_COMMON, num_key_value_heads=1, sliding_window=24, tie_word_embeddings=True),
    ),
    # Q/K/V bias, linear rope scaling, MHA.
    "tiny-qwen2": (
        "Qwen2Config",
        dict(
            _COMMON,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    # Per-head q/k RMSNorm, head_dim 32 apart from hidden/heads (16), GQA 4:2, tied embeddings
    # as in the small Qwen3s, Qwen3's eps and rope theta.
    "tiny-qwen3": (
        "Qwen3Config",
        dict(
            _COMMON,
            head_dim=32,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # Not tiny: the TinyLlama-1.1B geometry with random weights, for GPU benchmarks.
    "llama-1b-random": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
            bos_token_id=256,
            eos_token_id=257,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
# Standard deviation of the random weights: large for toy widths, so that argmax checks are not
# decided by near ties; small at 2048 wide, so fp16 activations stay finite.
INIT_STD = {"llama-1b-random": 0.02}


def tiny_config(name: str):
    import transformers

    class_name, kwargs = TINY_MODELS[name]
    config = getattr(transformers, class_name)(**kwargs)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    return config


def tiny_model(name: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)
    # Random init gives near-uniform logits; larger weights make argmax checks meaningful.
    std = INIT_STD.get(name, 0.08)
    with torch.no_grad():
        for param, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
            elif param.endswith(".bias"):
                p.normal_(0.0, 0.05)
            elif param.endswith(("q_norm.weight", "k_norm.weight")):
                # Not all ones, so a test sees the per-head norms' weights (q and k apart).
                p.normal_(1.0, 0.2)
    return model.eval()


def byte_tokenizer():
    """One token per byte (ids 0-255) plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _byte_chars()
    vocab = {byte_chars[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (the ByteLevel pre-tokenizer's alphabet, in byte order)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]
