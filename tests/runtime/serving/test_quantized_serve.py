"""A quantized SmolLM2 artifact served by `trtc serve` (real server on loopback, the official
`openai` client): its greedy tokens are those of transformers' own SmolLM2 carrying the very
same dequantized INT4 weights, for the first 16 tokens of 8 prompts, sent concurrently.

The weights are RTN's: what is checked here is the serving path of an INT4 artifact (Int4Gemm
nodes in the executor, in-flight batching, the API), the same for every INT4 method; AWQ's and
GPTQ's own compiled graphs are checked against transformers in
tests/compiler/test_quantized_build.py, and calibrating SmolLM2 twice (artifact and reference)
would add minutes to the suite."""

from __future__ import annotations

import concurrent.futures as cf
import copy

import openai
import pytest
import torch

from conftest import CONFIGS, build_quiet
from harness.serving import PLAIN_PROMPTS, ServerProcess
from trtc.compiler.config import load_config, parse_config
from trtc.compiler.quantize.apply import quantize_model

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
NEAR_TIE = 1e-3


def int4_config():
    """The shipped AWQ config (group 128, partial last groups) in fp32, quantized by RTN."""
    data = load_config(CONFIGS / "smollm2-int4-awq.yaml").model_dump(mode="json")
    data["precision"] = "fp32"
    data["backend"] = {"name": "none", "targets": []}
    data["quantization"]["method"] = "rtn"
    data["output"] = None
    return parse_config(data)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_quiet(int4_config(), tmp_path_factory.mktemp("smollm2-int4") / "art")


@pytest.fixture(scope="module")
def reference(smollm2_hf):
    """transformers' SmolLM2 with the artifact's weights: the quantized Linears dequantized into
    it."""
    base, tok = smollm2_hf
    hf = copy.deepcopy(base)
    q = int4_config().quantization
    result = quantize_model(
        hf,
        tok,
        q.method,
        q.group_size,
        num_samples=q.calibration.num_samples,
        seq_len=q.calibration.seq_len,
        partial_groups=q.partial_groups,
    )
    with torch.no_grad():
        for name, w in result.linears.items():
            hf.get_submodule(name).weight.copy_(w.dequantize())
    return hf.eval(), tok


def test_quantized_artifact_serves_transformers_tokens(artifact, reference, tmp_path):
    hf, tok = reference
    server = ServerProcess(artifact, tmp_path / "server.log")
    try:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600
        )
        model = client.models.list().data[0].id
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PLAIN_PROMPTS]

        def request(prompt_ids):
            r = client.completions.create(
                model=model,
                prompt=prompt_ids,
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(ids)) as pool:
            served = list(pool.map(request, ids))
    finally:
        server.stop()
    assert len(served) == len(PLAIN_PROMPTS)
    for prompt_ids, text in zip(ids, served):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = out.sequences[0, len(prompt_ids) :].tolist()
        if text == tok.decode(want, skip_special_tokens=True):
            continue
        # Only a near tie in transformers' own scores may explain a different token: find the
        # first token whose text the served text does not continue.
        k = next(
            i
            for i in range(len(want))
            if not text.startswith(tok.decode(want[: i + 1], skip_special_tokens=True))
        )
        top2 = out.scores[k][0].float().topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, (
            f"token {k}: served {text!r}, transformers {tok.decode(want)!r}"
        )
