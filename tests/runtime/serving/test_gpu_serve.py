"""SmolLM2 fp16 on the GPU: `trtc serve` (CUDA executor) on loopback, driven by the official
`openai` client with 16 concurrent requests, against transformers fp16 on the same GPU."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
import torch

from harness.serving import CHAT, MAX_TOKENS, PLAIN_PROMPTS, ServerProcess, run_request

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
    model, tok = smollm2_hf
    return model.to("cuda", torch.float16), tok


def reference_tokens(hf, prompt_ids: list[int], eos: list[int]):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids], device="cuda"),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return tokens, [s[0] for s in out.scores]


def test_16_concurrent_requests_match_transformers_on_the_gpu(server, hf_cuda):
    hf, tok = hf_cuda
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    model = client.models.list().data[0].id
    jobs = [("chat", t, i % 2 == 0) for i, t in enumerate(CHAT)] + [
        ("plain", t, i % 2 == 1) for i, t in enumerate(PLAIN_PROMPTS)
    ]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: run_request(client, model, *j), jobs))
    eos = sorted(
        {tok.eos_token_id, *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))}
    )
    notes = []
    for (kind, text, _), (out, reason) in zip(jobs, results):
        assert reason in ("stop", "length")
        if kind == "chat":
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(text, add_special_tokens=False)["input_ids"]
        tokens, scores = reference_tokens(hf, ids, eos)
        want = tok.decode(tokens, skip_special_tokens=True)
        if out == want:
            notes.append("identical")
            continue
        k = next(
            k
            for k in range(len(tokens) + 1)
            if k == len(tokens)
            or not out.startswith(tok.decode(tokens[: k + 1], skip_special_tokens=True))
        )
        assert k < len(tokens), f"ours {out!r} vs transformers {want!r}"
        top2 = torch.topk(scores[k].float(), 2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE_FP16, (
            f"{text!r}: diverged at token {k} where transformers' top-2 fp16 logits differ by "
            f"{gap:.3g}:\n ours: {out!r}\n hf:   {want!r}"
        )
        notes.append(f"near tie at token {k} (gap {gap:.2g})")
    print("SmolLM2 fp16 on the GPU, 16 concurrent requests vs transformers:", notes)
    assert notes.count("identical") >= 12
    assert server.metrics()['trtc_steps_total{kind="decode"}'] > 0
