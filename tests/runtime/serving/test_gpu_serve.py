"""SmolLM2 fp16 on the GPU: `trtc serve` (CUDA executor) on loopback, driven by the official
`openai` client with 16 concurrent requests, against transformers fp16 on the same GPU."""

from __future__ import annotations

import concurrent.futures as cf
import copy

import openai
import pytest
import torch

from harness.serving import CHAT, PLAIN_PROMPTS, GreedyReference, ServerProcess, run_request

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# fp16 logits of two implementations differ by a few 1e-2 at SmolLM2's logit scale (|logit| ~ 20,
# fp16 keeps ~3 decimal digits, and the GEMMs accumulate in different orders), so a divergence
# counts as a near tie only where transformers' own top-2 fp16 logits are closer than this.
NEAR_TIE_FP16 = 0.1


@pytest.fixture(scope="module")
def server(smollm2_fp16, tmp_path_factory):
    srv = ServerProcess(
        smollm2_fp16,
        tmp_path_factory.mktemp("smollm2-gpu") / "server.log",
        "--executor",
        "cuda",
        "--max-num-seqs",
        "16",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_cuda(smollm2_hf):
    model, tok = smollm2_hf  # a session fixture others use in fp32 on the CPU: moved as a copy
    return copy.deepcopy(model).to("cuda", torch.float16), tok


def test_16_concurrent_requests_match_transformers_on_the_gpu(server, hf_cuda):
    hf, tok = hf_cuda
    reference = GreedyReference(hf, tok, NEAR_TIE_FP16, device="cuda")
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    model = client.models.list().data[0].id
    jobs = [("chat", t, i % 2 == 0) for i, t in enumerate(CHAT)] + [
        ("plain", t, i % 2 == 1) for i, t in enumerate(PLAIN_PROMPTS)
    ]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: run_request(client, model, *j), jobs))
    notes = []
    for (kind, text, _), (out, reason) in zip(jobs, results):
        assert reason in ("stop", "length")
        ids = reference.chat_ids(text) if kind == "chat" else reference.plain_ids(text)
        notes.append(reference(out, ids))
    print("SmolLM2 fp16 on the GPU, 16 concurrent requests vs transformers:", notes)
    assert notes.count("identical") >= 12
    assert server.metrics()['trtc_steps_total{kind="decode"}'] > 0
