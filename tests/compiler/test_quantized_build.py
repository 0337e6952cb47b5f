"""Quantized artifacts end to end on a tiny model: the build puts a `trtc::Int4Gemm` /
`trtc::Fp8Gemm` node on every quantized projection (merged q/k/v and gate/up included), and the
compiled graph, run by the runtime, computes what transformers computes with the same quantized
weights (dequantized into its Linear layers for INT4; the FP8 reference layers for FP8)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter

import onnx
import pytest
import torch

from conftest import build_quiet
from harness.golden import greedy_continuation
from trtc.artifact import Artifact
from trtc.compiler.config import parse_config
from trtc.compiler.quantize.apply import quantize_model
from trtc.compiler.tiny import byte_tokenizer, tiny_model
from trtc.contract import SequenceWork, make_step
from trtc.runtime.core.sequence import SamplingParams
from trtc.runtime.engine import LLM
from trtc.runtime.executors.torch_executor import TorchExecutor

CALIB = {"num_samples": 4, "seq_len": 64}
NAME = "tiny-qwen2"  # Q/K/V bias: the merged quantized GEMM carries a bias too


def config(method: str, **extra):
    return parse_config(
        {
            "model": {"source": "tiny", "name": NAME},
            "precision": "fp32",
            "limits": {"max_num_tokens": 256, "max_num_seqs": 8},
            "quantization": {"method": method, "group_size": 32, "calibration": CALIB, **extra},
        }
    )


@pytest.fixture(scope="module")
def quantized_artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {m: build_quiet(config(m), root / m) for m in ("rtn", "awq", "gptq", "fp8")}


def reference_model(method: str, **extra):
    """transformers' model carrying exactly the artifact's quantized weights."""
    hf = tiny_model(NAME, seed=0)
    q = config(method, **extra).quantization  # the build's own settings, defaults included
    result = quantize_model(
        hf,
        byte_tokenizer(),
        method,
        q.group_size,
        num_samples=CALIB["num_samples"],
        seq_len=CALIB["seq_len"],
        act_order=q.act_order,
        partial_groups=q.partial_groups,
    )
    with torch.no_grad():
        for name, w in result.linears.items():
            if method == "fp8":
                continue
            hf.get_submodule(name).weight.copy_(w.dequantize())
    if method == "fp8":
        result.install(hf)  # activations are quantized too: the FP8 reference layers
    return hf.eval()


@pytest.mark.parametrize(
    "method,op",
    [("rtn", "Int4Gemm"), ("awq", "Int4Gemm"), ("gptq", "Int4Gemm"), ("fp8", "Fp8Gemm")],
)
def test_every_projection_is_a_plugin_node(quantized_artifacts, method, op):
    art = quantized_artifacts[method]
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    # Per layer: merged q/k/v, o, merged gate/up, down; the LM head stays a Gemm.
    assert ops[op] == 4 * 2 and ops["Gemm"] == 1
    m = json.loads((art / "manifest.json").read_text())
    q = m["quantization"]
    assert q["method"] == method and q["num_linears_quantized"] == 7 * 2
    assert q["bits"] == (8 if method == "fp8" else 4)
    if method != "rtn":
        assert q["calibration"]["num_samples"] == 4 and len(q["calibration"]["text_sha256"]) == 64
    assert (
        m["fusions"]["per_layer"]["0"]["qkv_gemm"] == 1
        and m["fusions"]["per_layer"]["0"]["swiglu"] == 1
    )
    assert any(p["op_type"] == op for p in m["plugins"])
    # Calibrated methods report each decoder layer while the long quantize stage runs.
    log = (art / "build.log").read_text()
    for i in (1, 2):
        assert (f"quantize: {method}: layer {i}/2 in " in log) == (method != "rtn")


def check_matches_transformers(hf, art):
    ex = TorchExecutor(Artifact.open(art), num_blocks=16)
    prompt = list(range(7, 47))
    logits = ex.execute(make_step([SequenceWork(prompt, 0, [3, 5, 8])], 16))
    seq = prompt
    for _ in range(6):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1]
        assert float((logits[0] - ref).abs().max()) < 1e-3
        token = int(ref.argmax())
        assert int(logits[0].argmax()) == token
        seq = seq + [token]
        logits = ex.execute(make_step([SequenceWork([token], len(seq) - 1, [3, 5, 8])], 16))


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq", "fp8"])
def test_compiled_graph_matches_transformers_with_same_weights(quantized_artifacts, method):
    check_matches_transformers(reference_model(method), quantized_artifacts[method])


def test_partial_groups_build(tmp_path):
    # Group 128 on widths 64 and 160: every row's last group is shorter, as in SmolLM2 (576).
    extra = {"group_size": 128, "partial_groups": True}
    art = build_quiet(config("gptq", **extra), tmp_path / "gptq-g128")
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "Int4Gemm"]
    assert len(nodes) == 4 * 2 and all(
        a.i == 128 for n in nodes for a in n.attribute if a.name == "group_size"
    )
    q = json.loads((art / "manifest.json").read_text())["quantization"]
    assert q["group_size"] == 128 and q["partial_groups"] is True
    check_matches_transformers(reference_model("gptq", **extra), art)


def test_quantized_artifact_generates_like_transformers(quantized_artifacts):
    hf = reference_model("awq")
    llm = LLM(quantized_artifacts["awq"], num_blocks=64)
    prompts = [[i, i + 1, i + 2, 40 + i] * 3 for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_continuation(hf, prompt, 16)


def test_eval_command_reports_perplexity(quantized_artifacts, tmp_path):
    text = tmp_path / "held-out.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtc",
            "eval",
            str(quantized_artifacts["gptq"]),
            "--text",
            str(text),
            "--window",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    ppl = float(r.stdout.split()[1])
    assert 1.0 < ppl < 1e6


@pytest.mark.parametrize("bos", [True, False])
def test_perplexity_is_transformers_perplexity_of_the_same_windows(quantized_artifacts, bos):
    from trtc.runtime.evaluate import perplexity

    text = "Rounding errors of a weight cost the most where its input is large. " * 6
    r = perplexity(quantized_artifacts["gptq"], text, window=48, bos=bos, executor="torch")
    hf, tok = reference_model("gptq"), byte_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prefix = [tok.bos_token_id] if bos else []
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, 48):
        chunk = ids[start : start + 49]
        with torch.no_grad():
            logits = hf(torch.tensor([prefix + chunk[:-1]])).logits[0, len(prefix) :]
        nll += float(
            torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum")
        )
        count += len(chunk) - 1
    assert r["tokens"] == count and r["bos"] is bos
    assert abs(r["perplexity"] - math.exp(nll / count)) < 1e-4 * r["perplexity"]


@pytest.mark.parametrize(
    "extra,expect",
    [
        (
            {"group_size": 128},
            "quantization.group_size: 128 does not divide the model's hidden_size (64), "
            "intermediate_size (160), num_attention_heads * head_dim (64); choose 32, or "
            "set quantization.partial_groups: true",
        ),
        (
            {"calibration": {"path": "/nonexistent/calib.txt"}},
            "calibration file '/nonexistent/calib.txt' does not exist",
        ),
    ],
)
def test_bad_quantization_settings_fail_before_work(tmp_path, extra, expect):
    from trtc.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expect)):
        cfg = parse_config(
            {
                "model": {"source": "tiny", "name": NAME},
                "precision": "fp32",
                "quantization": {"method": "awq", **extra},
            }
        )
        build_quiet(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
