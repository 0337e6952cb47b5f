"""The quantizers on tiny models: RTN bounds, GPTQ and AWQ against RTN, AWQ's folding, FP8
scales, calibration text, errors."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.quantize_models import CALIB, outlier_model
from trtc.compiler.quantize import fp8 as fp8_mod
from trtc.compiler.quantize import gptq, quantize_model, rtn
from trtc.compiler.quantize.calibration import (
    calibration_data,
    calibration_token_batches,
    text_sha256,
)
from trtc.compiler.quantize.layers import LINEARS
from trtc.compiler.tiny import byte_tokenizer, tiny_model
from trtc.corpus import DEFAULT_SOURCE, default_text
from trtc.plugins.int4_gemm import unpack_int4


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def linear_inputs(model, tok, path: str | None = None, num_samples=4, seq_len=64) -> dict:
    """{name: fp inputs [tokens, K]} of every quantizable Linear on the calibration batches."""
    batches = calibration_token_batches(tok, path, num_samples, seq_len)
    inputs, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        for p in LINEARS:
            name = f"model.layers.{i}.{p}"
            handles.append(
                layer.get_submodule(p).register_forward_pre_hook(
                    lambda m, a, name=name: inputs.setdefault(name, []).append(
                        a[0].reshape(-1, a[0].shape[-1])
                    )
                )
            )
    with torch.no_grad():
        model(input_ids=torch.tensor(batches))
    for h in handles:
        h.remove()
    return {k: torch.cat(v) for k, v in inputs.items()}


def output_mse(model, result, inputs) -> float:
    """Sum over Linears of the mean squared output error of the quantized weights (each on
    the inputs that Linear sees in ``model``)."""
    total = 0.0
    for name, w in result.linears.items():
        fp_weight = model.get_submodule(name).weight
        x = inputs[name]
        total += ((x @ w.dequantize().T - x @ fp_weight.T) ** 2).mean().item()
    return total


# --- RTN -----------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
def test_rtn_error_is_at_most_half_a_step(group):
    w = torch.randn(16, 256) * 0.05
    w[0, :group] = torch.linspace(0.01, 0.02, group)  # an all-positive group
    w[1, :group] = 0.0  # an all-zero group
    q, scales, zeros = rtn.quantize_rtn(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and int(zeros.max()) <= 15
    assert scales.shape == zeros.shape == (16, 256 // group)
    err = (rtn.dequantize(q, scales, zeros, group) - w).abs()
    bound = scales.repeat_interleave(group, 1) / 2
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-7)
    assert torch.all(rtn.dequantize(q, scales, zeros, group)[1, :group] == 0)  # zeros stay exact


@pytest.mark.parametrize("group,k", [(128, 576), (64, 96), (128, 64)])
def test_rtn_partial_last_group(group, k):
    # SmolLM2's width: 576 = 4 x 128 + 64. The last group holds the remaining columns and its
    # range is its own (a group padded with zeros would have the same range: it holds 0).
    w = torch.randn(8, k) * 0.05
    w[:, (k // group) * group :] *= 10  # the short group has a larger range
    q, scales, zeros = rtn.quantize_rtn(w, group, partial_groups=True)
    assert q.shape == (8, k) and scales.shape == zeros.shape == (8, -(-k // group))
    last = w[:, (k // group) * group :]
    span = last.amax(1).clamp(min=0) - last.amin(1).clamp(max=0)
    torch.testing.assert_close(scales[:, -1], span / 15)
    err = (rtn.dequantize(q, scales, zeros, group) - w).abs()
    bound = scales.repeat_interleave(group, 1)[:, :k] / 2
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-7)
    with pytest.raises(ValueError, match="not a multiple of group_size.*partial_groups"):
        rtn.quantize_rtn(w, group) if k % group else rtn.quantize_rtn(w[:, :-2], group)


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
def test_partial_groups_quantize_every_linear(tok, method):
    # hidden 64 and intermediate 160 with group 128: every Linear has one shorter group.
    model = outlier_model("tiny-qwen2")
    ids = torch.tensor(calibration_token_batches(tok, None, 4, 64))
    with torch.no_grad():
        ref = model(input_ids=ids).logits

    def logits_mse(method):
        m = copy.deepcopy(model)
        result = quantize_model(m, tok, method, 128, partial_groups=True, **CALIB)
        w = result.linears["model.layers.0.mlp.down_proj"]
        assert w.scales.shape == w.zeros.shape == (64, 2)  # ceil(160 / 128)
        assert result.record()["partial_groups"] is True
        result.install(m)
        with torch.no_grad():
            return ((m(input_ids=ids).logits - ref) ** 2).mean().item()

    err = logits_mse(method)
    if method != "rtn":
        assert err < logits_mse("rtn")


def test_rtn_model_leaves_weights_and_packs_all_linears(tok):
    model = tiny_model("tiny-llama", 0)
    before = copy.deepcopy(model.state_dict())
    result = quantize_model(model, tok, "rtn", 32, **CALIB)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(result.linears) == 7 * 2
    assert not any("lm_head" in n or "embed" in n for n in result.linears)
    w = result.linears["model.layers.1.mlp.down_proj"]
    assert w.qweight.shape == (64, 80) and w.scales.shape == w.zeros.shape == (64, 160 // 32)
    q, s, z = rtn.quantize_rtn(model.model.layers[1].mlp.down_proj.weight, 32)
    assert torch.equal(unpack_int4(w.qweight), q)
    rec = result.record()
    assert rec["calibration"] is None and rec["bits"] == 4 and rec["num_linears_quantized"] == 14
    n_k = sum(n * k for n, k in (x.shape for x in result.linears.values()))
    assert rec["linear_weight_bytes_fp16"] == 2 * n_k
    assert rec["linear_weight_bytes_quantized"] == n_k // 2 + 3 * n_k // 32


def test_group_size_must_divide_in_features(tok):
    model = tiny_model("tiny-llama", 0)  # hidden 64: group 128 does not divide it
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*64.*128"):
        quantize_model(model, tok, "gptq", 128, **CALIB)
    with pytest.raises(ValueError, match="not one of"):
        quantize_model(model, tok, "int3", 32, **CALIB)


# --- GPTQ ----------------------------------------------------------------------------------


def correlated_inputs(m=2048, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.2 + torch.eye(k)
    return (torch.randn(m, k, generator=g) @ mix) * torch.linspace(0.2, 3.0, k)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(act_order):
    x = correlated_inputs()
    w = torch.randn(64, 256) * 0.05
    h = gptq.Hessian(256)
    h.add(x)
    for group in (32, 128):
        q, s, z = gptq.gptq_quantize(w, h.value, group, act_order=act_order)
        err_gptq = ((x @ (rtn.dequantize(q, s, z, group) - w).T) ** 2).mean()
        err_rtn = ((x @ (rtn.fake_quantize(w, group) - w).T) ** 2).mean()
        assert err_gptq < 0.8 * err_rtn


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_uncorrelated_inputs_is_rtn(act_order):
    # Diagonal H: no error to compensate, so GPTQ (plain or act-order with static groups,
    # returned in the original column order) must reproduce RTN exactly.
    w = torch.randn(32, 128) * 0.05
    h = torch.diag(torch.rand(128) + 0.5)
    q, s, z = gptq.gptq_quantize(w, h, 32, act_order=act_order, shrink_steps=0)
    rq, rs, rz = rtn.quantize_rtn(w, 32)
    assert torch.equal(q, rq) and torch.equal(z, rz)
    torch.testing.assert_close(s, rs)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_range_search_weighs_columns_by_their_hessian(act_order):
    # Diagonal H (nothing to compensate): GPTQ is rounding with its range search's parameters.
    # Every group holds two outlier weights (+-0.6) on columns whose inputs are tiny: the
    # unweighted search spends the group's range on them; GPTQ's objective,
    # sum_j H_jj (w_j - w'_j)^2, does not.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g) * 0.05
    w[:, ::32], w[:, 16::32] = 0.6, -0.6
    d = torch.ones(128)
    d[::16] = 1e-4
    h = torch.diag(d)
    q, s, z = gptq.gptq_quantize(w, h, 32, act_order=act_order)

    def weighted_err(w_q):
        return (((w_q - w) ** 2) * d).sum()

    s_plain, z_plain = rtn.group_params(
        w.reshape(32, 4, 32), gptq.SHRINK_STEPS
    )  # least sum |w - w'|^2.4
    q_plain = rtn.quantize_with(w.reshape(32, 4, 32), s_plain[..., None], z_plain[..., None])
    w_plain = rtn.dequantize(q_plain.reshape(32, 128), s_plain, z_plain, 32)
    assert weighted_err(rtn.dequantize(q, s, z, 32)) < 0.5 * weighted_err(w_plain)


def test_gptq_model_beats_rtn_and_restores_weights(tok):
    model = tiny_model("tiny-qwen2", 0)
    before = copy.deepcopy(model.state_dict())
    inputs = linear_inputs(model, tok)
    r_rtn = quantize_model(model, tok, "rtn", 32, **CALIB)
    r_gptq = quantize_model(model, tok, "gptq", 32, act_order=False, **CALIB)
    r_act = quantize_model(model, tok, "gptq", 32, **CALIB)  # act-order: default
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert output_mse(model, r_gptq, inputs) < 0.9 * output_mse(model, r_rtn, inputs)
    assert output_mse(model, r_act, inputs) < 0.9 * output_mse(model, r_rtn, inputs)
    assert r_act.record()["act_order"] is True and r_gptq.record()["act_order"] is False
    assert r_gptq.record()["calibration"]["source"] == DEFAULT_SOURCE


# --- AWQ -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_awq_folding_keeps_the_fp_model_and_beats_rtn(tok, name):
    model = outlier_model(name)
    ids = torch.tensor(calibration_token_batches(tok, None, 2, 48))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    inputs = linear_inputs(model, tok)
    r_rtn = quantize_model(model, tok, "rtn", 32, **CALIB)
    rtn_mse = output_mse(model, r_rtn, inputs)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()

    r_awq = quantize_model(model, tok, "awq", 32, **CALIB)  # folds scales in place
    assert not torch.equal(norm_before, model.model.layers[0].input_layernorm.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=0, atol=1e-4)
    # Compare each quantized Linear with the folded fp Linear on the inputs it now sees.
    assert output_mse(model, r_awq, linear_inputs(model, tok)) < 0.9 * rtn_mse


def test_awq_model_logits_closer_than_rtn(tok):
    model = outlier_model("tiny-llama", 1)
    ids = torch.tensor(calibration_token_batches(tok, None, 4, 64))
    with torch.no_grad():
        ref = model(input_ids=ids).logits

    def logits_mse(method):
        m = copy.deepcopy(model)
        quantize_model(m, tok, method, 32, **CALIB).install(m)
        with torch.no_grad():
            return ((m(input_ids=ids).logits - ref) ** 2).mean().item()

    assert logits_mse("awq") < logits_mse("rtn")


def test_awq_search_sample_takes_every_position_in_proportion():
    """64 windows of 64 tokens streamed in batches of 8 windows, 512 rows sampled: a stride (8)
    would take every window's first token (the attention sink) as 1 row in 8; the sample must
    take it about as often as the data holds it (1 in 64), be reproducible and hold the rows
    it says it holds."""
    from trtc.compiler.quantize.awq import ActivationSample

    windows, length, keep = 64, 64, 512
    x = torch.arange(windows * length, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i
    samples = []
    for _ in range(2):
        sample = ActivationSample(windows * length, keep)
        for batch in x.split(8 * length):
            sample.add(batch)
        samples.append(sample)
    rows = samples[0].tokens[:, 0].long()
    assert len(rows) == keep and len(set(rows.tolist())) == keep
    assert torch.equal(rows, samples[0].keep) and torch.equal(samples[0].tokens, samples[1].tokens)
    firsts = int((rows % length == 0).sum())
    assert firsts < 3 * keep / length  # 8 expected; a stride of 8 takes 64
    torch.testing.assert_close(samples[0].mean_abs, x.abs().mean(0))


# --- FP8 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("error_feedback", [False, True])
def test_fp8_scales(tok, error_feedback):
    model = tiny_model("tiny-mistral", 0)
    inputs = linear_inputs(model, tok)
    result = quantize_model(model, tok, "fp8", 128, fp8_error_feedback=error_feedback, **CALIB)
    assert result.group_size is None and result.record()["bits"] == 8
    for name, w in result.linears.items():
        fp = model.get_submodule(name).weight.detach()
        assert w.weight.dtype == torch.float8_e4m3fn and w.weight_scale.shape == (fp.shape[0],)
        torch.testing.assert_close(w.weight_scale, fp.abs().amax(1) / 448)
        torch.testing.assert_close(w.input_scale, inputs[name].abs().max() / 448)
        if error_feedback:  # same grid, each weight one of its neighbouring E4M3 values or so
            assert ((w.dequantize() - fp).norm() / fp.norm()).item() < 0.1
        else:  # nearest rounding: each row uses the whole range
            assert torch.equal(
                w.weight.float(), (fp / w.weight_scale[:, None]).to(torch.float8_e4m3fn).float()
            )
            assert torch.all(w.weight.float().abs().amax(1) == 448)
    assert fp8_mod.input_scale(0.0).item() == 1.0


def test_fp8_error_feedback_beats_nearest_rounding():
    x = correlated_inputs(k=128)
    w = torch.randn(32, 128) * 0.05
    h = gptq.Hessian(128)
    h.add(x)
    w8, scale = gptq.gptq_fp8(w, h.value)
    nearest, scale_n = fp8_mod.quantize_weight_fp8(w)
    assert torch.equal(scale, scale_n)

    def err(q):
        return ((x @ (q.float() * scale[:, None] - w).T) ** 2).mean()

    assert err(w8) < 0.7 * err(nearest)


def test_fp8_model_runs_through_the_plugin_close_to_fp(tok):
    model = tiny_model("tiny-llama", 0)
    ids = torch.tensor(calibration_token_batches(tok, None, 2, 64))
    int4 = copy.deepcopy(model)
    quantize_model(int4, tok, "rtn", 32, **CALIB).install(int4)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        quantize_model(model, tok, "fp8", 128, **CALIB).install(model)
        out = model(input_ids=ids).logits
        out_int4 = int4(input_ids=ids).logits
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Fp8Linear"
    assert ((out - ref).norm() / ref.norm()).item() < 0.1
    assert (out - ref).norm() < 0.5 * (out_int4 - ref).norm()


# --- calibration ---------------------------------------------------------------------------


def test_default_calibration_text_is_deterministic_and_hashed(tok):
    a = calibration_data(tok, None, 8, 128)
    b = calibration_data(tok, None, 8, 128)
    assert a.batches == b.batches and len(a.batches) == 8
    assert all(len(x) == 128 for x in a.batches)
    assert a.text_sha256 == text_sha256(default_text()) and len(a.text_sha256) == 64
    assert a.record() == {
        "source": DEFAULT_SOURCE,
        "path": None,
        "text_sha256": a.text_sha256,
        "num_samples": 8,
        "seq_len": 128,
    }
    # Windows are spread over the whole text, disjoint when it is long enough.
    assert len({tuple(x) for x in a.batches}) == 8


def test_calibration_file(tok, tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("abcdefghij" * 10)  # 100 byte tokens
    data = calibration_data(tok, str(path), 3, 40)
    assert data.source == "file" and data.path == str(path)
    assert data.batches[0] == list(b"abcdefghij" * 4)
    assert data.batches[-1] == list((b"abcdefghij" * 10)[60:])
    with pytest.raises(ValueError, match="fewer than one sample"):
        calibration_data(tok, str(path), 1, 200)


def test_missing_calibration_file_is_a_clear_error(tok, tmp_path):
    with pytest.raises(ValueError, match=r"calibration file .*nope\.txt.* does not exist"):
        calibration_token_batches(tok, str(tmp_path / "nope.txt"), 4, 64)
    with pytest.raises(ValueError, match="does not exist"):
        quantize_model(
            tiny_model("tiny-llama", 0),
            tok,
            "awq",
            32,
            calibration_path=str(tmp_path / "nope.txt"),
            num_samples=4,
            seq_len=64,
        )
