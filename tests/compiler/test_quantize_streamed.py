"""Quantization streamed from a WeightSource, one decoder layer at a time: what the layers are
called with equals a full forward, the KV-cache and FP8 amax equal a full forward's, a
safetensors checkpoint gives the in-memory result bit for bit, AWQ's overrides, spill files, and
that nothing reads more than it must."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from harness.quantize_models import CALIB, outlier_model
from trtc.compiler.checkpoint import SafetensorsCheckpoint, StateDictSource
from trtc.compiler.config import CalibrationSection
from trtc.compiler.quantize import fp8 as fp8_mod
from trtc.compiler.quantize import quantize_model, quantize_source
from trtc.compiler.quantize.calibration import calibration_data
from trtc.compiler.quantize.kv_cache import scale_for
from trtc.compiler.quantize.layers import LINEARS, hooks
from trtc.compiler.quantize.quantized_linears import CACHED_LINEARS, Fp8Weights, Int4Weights
from trtc.compiler.quantize.stack import DecoderStack
from trtc.compiler.tiny import byte_tokenizer, tiny_model

SOURCE_ARGS = dict(CALIB, act_order=True, partial_groups=False)
MODELS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def state_source(model) -> StateDictSource:
    """The model's tensors, copied: a source the model's later changes do not reach."""
    return StateDictSource({k: v.clone() for k, v in model.state_dict().items()})


def write_checkpoint(model, directory, dtype=None):
    """The model's state dict as one model.safetensors (tied tensors stored twice)."""
    tensors = {
        k: (v if dtype is None else v.to(dtype)).clone().contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(tensors, directory / "model.safetensors")
    return SafetensorsCheckpoint(directory)


class CountingSource(StateDictSource):
    """A StateDictSource that records the names it reads, in order."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.reads: list[str] = []

    def read(self, name):
        self.reads.append(name)
        return super().read(name)


def same(a, b) -> bool:
    """Deep equality; tensors equal in dtype, shape, device and every element."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def same_weights(a, b) -> bool:
    return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in vars(a))


def full_forward_calls(model, ids):
    """What one transformers forward calls the decoder layers with: ``(layer 0's hidden
    states, [keyword arguments of each layer])``."""
    calls = []

    def hook(module, args, kwargs):
        calls.append((args[0] if args else kwargs["hidden_states"], dict(kwargs)))

    layers = model.model.layers
    with (
        torch.no_grad(),
        hooks([m.register_forward_pre_hook(hook, with_kwargs=True) for m in layers]),
    ):
        model(input_ids=ids, use_cache=False)
    return calls[0][0], [kwargs for _, kwargs in calls]


def full_forward_amax(model, batches, batch_size):
    """Per layer ``(max rotary pair norm of the keys entering the rotary, max |v_proj
    outputs|)`` and per Linear ``max |input|``, from full forwards of ``model``. The keys are
    the k_proj outputs, or the k_norm outputs where the layer has one (Qwen3): the cache holds
    the normed keys."""
    head_dim = model.model.layers[0].self_attn.head_dim
    kv = [[0.0, 0.0] for _ in model.model.layers]
    linear_amax = {}
    handles = []
    for i, layer in enumerate(model.model.layers):

        def on_k(m, a, out, i=i):
            x = out.reshape(-1, head_dim)
            norms = torch.sqrt(x[:, : head_dim // 2] ** 2 + x[:, head_dim // 2 :] ** 2)
            kv[i][0] = max(kv[i][0], float(norms.max()))

        def on_v(m, a, out, i=i):
            kv[i][1] = max(kv[i][1], float(out.abs().max()))

        keys = getattr(layer.self_attn, "k_norm", layer.self_attn.k_proj)
        handles += [
            keys.register_forward_hook(on_k),
            layer.self_attn.v_proj.register_forward_hook(on_v),
        ]
        for p in LINEARS:
            name = f"model.layers.{i}.{p}"

            def on_input(m, a, name=name):
                linear_amax[name] = max(linear_amax.get(name, 0.0), a[0].abs().max().item())

            handles.append(layer.get_submodule(p).register_forward_pre_hook(on_input))
    with torch.no_grad(), hooks(handles):
        for chunk in torch.tensor(batches).split(batch_size):
            model(input_ids=chunk, use_cache=False)
    return [(scale_for(k), scale_for(v)) for k, v in kv], linear_amax


# --- the decoder stack ---------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_layer_inputs_equal_a_full_forward(tok, name):
    # 5 windows in batches of 2: two batch shapes, so two sets of keyword arguments.
    model = tiny_model(name, 0)
    batches = calibration_data(tok, None, 5, 40).batches
    inputs = DecoderStack(model.config, state_source(model)).calibration_inputs(batches, 2)
    assert inputs.shapes == [(2, 40), (2, 40), (1, 40)]
    for j, chunk in enumerate(torch.tensor(batches).split(2)):
        hidden, kwargs = full_forward_calls(model, chunk)
        assert same(inputs.first[j], hidden) and len(kwargs) == 2
        layer_inputs = [inputs.for_layer(i, inputs.first) for i in range(2)]
        assert all(same(layer_inputs[i].kwargs[j], kwargs[i]) for i in range(2))
    if name == "tiny-mistral":  # the sliding window is in the masks
        mask = inputs.layer_kwargs[(2, 40)][0]["attention_mask"]
        assert mask.dtype == torch.bool  # True: attended
        assert not mask[0, 0, 39, :16].any() and mask[0, 0, 39, 16:].all()


def test_stack_builds_one_layer_from_its_own_tensors(tok):
    model = tiny_model("tiny-qwen2", 0)
    source = CountingSource(model.state_dict())
    stack = DecoderStack(model.config, source)
    assert source.reads == []  # the meta model costs no read
    layer = stack.layer(1)
    assert sorted(source.reads) == sorted(f"model.layers.1.{k}" for k in layer.state_dict())
    assert all(p.dtype == torch.float32 and not p.is_meta for p in layer.parameters())
    assert not layer.training
    x = torch.randn(2, 8, 64)
    kwargs = stack.calibration_inputs([[1] * 8, [2] * 8], 2).layer_kwargs[(2, 8)][1]
    with torch.no_grad():
        assert torch.equal(layer(x, **kwargs), model.model.layers[1](x, **kwargs))


def test_bf16_checkpoint_is_upcast_exactly(tok, tmp_path):
    model = tiny_model("tiny-llama", 0)
    source = write_checkpoint(model, tmp_path, torch.bfloat16)
    rounded = copy.deepcopy(model).to(torch.bfloat16).float()
    got = quantize_source(source, model.config, tok, "gptq", 32, **SOURCE_ARGS)
    want = quantize_model(rounded, tok, "gptq", 32, **CALIB)
    assert all(same_weights(got.linears[n], w) for n, w in want.linears.items())


def test_missing_tensor_and_quantized_checkpoint_are_clear_errors(tok):
    model = tiny_model("tiny-llama", 0)
    tensors = dict(model.state_dict())
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        quantize_source(StateDictSource(tensors), model.config, tok, "rtn", 32, **SOURCE_ARGS)
    tensors = dict(model.state_dict())
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(
        torch.float8_e4m3fn
    )
    with pytest.raises(ValueError, match="float8_e4m3fn.*unquantized checkpoint"):
        quantize_source(StateDictSource(tensors), model.config, tok, "rtn", 32, **SOURCE_ARGS)


# --- the streamed methods ------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,name,group",
    [
        ("rtn", "tiny-llama", 32),
        ("awq", "tiny-qwen2", 32),
        ("gptq", "tiny-mistral", 32),
        ("fp8", "tiny-qwen2", 128),
    ],
)
def test_safetensors_checkpoint_equals_the_model_in_memory(tok, tmp_path, method, name, group):
    model = outlier_model(name)
    source = write_checkpoint(model, tmp_path)
    got = quantize_source(
        source, model.config, tok, method, group, spill_dir=tmp_path / "spill", **SOURCE_ARGS
    )
    want = quantize_model(model, tok, method, group, **CALIB)
    assert list(got.linears) == list(want.linears) and len(got.linears) == 14
    assert all(same_weights(got.linears[n], w) for n, w in want.linears.items())
    assert got.record() == want.record()
    assert got.kv_scales is None and got.kv_record() is None


@pytest.mark.parametrize("name", MODELS)
def test_kv_scales_equal_a_full_forward(tok, name):
    model = outlier_model(name)
    source = state_source(model)
    batches = calibration_data(tok, None, 4, 64).batches
    want, _ = full_forward_amax(model, batches, 8)
    none = quantize_source(source, model.config, tok, "none", kv_cache_scales=True, **SOURCE_ARGS)
    assert none.kv_scales == want and none.linears == {} and none.record() == {"method": "none"}
    gptq = quantize_source(
        source, model.config, tok, "gptq", 32, kv_cache_scales=True, **SOURCE_ARGS
    )
    assert gptq.kv_scales == want  # the fp model's, not the quantized one's
    record = gptq.kv_record()
    assert record["k"] == [k for k, _ in want] and record["v"] == [v for _, v in want]
    assert record["calibration"] == calibration_data(tok, None, 4, 64).record()

    # AWQ: the folded model's, which the artifact holds (quantize_model folds in place).
    awq = quantize_source(source, model.config, tok, "awq", 32, kv_cache_scales=True, **SOURCE_ARGS)
    quantize_model(model, tok, "awq", 32, **CALIB)
    assert awq.kv_scales == full_forward_amax(model, batches, 8)[0]


def test_fp8_input_scales_are_a_full_forwards_amax(tok):
    model = tiny_model("tiny-mistral", 0)
    batches = calibration_data(tok, None, 4, 64).batches
    _, amax = full_forward_amax(model, batches, 8)
    result = quantize_source(state_source(model), model.config, tok, "fp8", **SOURCE_ARGS)
    assert all(
        torch.equal(result.linears[n].input_scale, fp8_mod.input_scale(a)) for n, a in amax.items()
    )


def test_awq_overrides_are_the_folded_norms(tok):
    model = outlier_model("tiny-qwen2")
    source = state_source(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = quantize_source(source, model.config, tok, "awq", 32, **SOURCE_ARGS)
    quantize_model(model, tok, "awq", 32, **CALIB)  # folds model in place
    folded = model.state_dict()
    assert sorted(result.overrides) == sorted(
        f"model.layers.{i}.{norm}.weight"
        for i in range(2)
        for norm in ("input_layernorm", "post_attention_layernorm")
    )
    for name, tensor in result.overrides.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, folded[name])
        assert not torch.equal(tensor, before[name])
    # Every other fp tensor the artifact takes from the source is unchanged by folding, but
    # for the Linears, whose (scaled) weights and biases the INT4 results carry.
    linear_tensors = {f"{n}.{t}" for n in result.linears for t in ("weight", "bias")}
    for name, tensor in folded.items():
        if name not in result.overrides and name not in linear_tensors:
            assert torch.equal(tensor, before[name]), name
    v_bias = result.linears["model.layers.0.self_attn.v_proj"].bias  # qwen2: Q/K/V bias
    assert torch.equal(v_bias, folded["model.layers.0.self_attn.v_proj.bias"])
    assert not torch.equal(v_bias, before["model.layers.0.self_attn.v_proj.bias"])
    assert all(torch.equal(source.read(k), v) for k, v in before.items())  # source untouched


@pytest.mark.parametrize("method", ["gptq", "fp8"])
def test_spill_files_hold_each_layer(tok, tmp_path, method):
    model = tiny_model("tiny-qwen2", 0)
    source = state_source(model)
    spill = tmp_path / "spill"
    spilled = quantize_source(source, model.config, tok, method, 32, spill_dir=spill, **SOURCE_ARGS)
    assert sorted(p.name for p in spill.iterdir()) == ["layer0.safetensors", "layer1.safetensors"]
    in_memory = quantize_source(source, model.config, tok, method, 32, **SOURCE_ARGS)
    kind = Fp8Weights if method == "fp8" else Int4Weights
    for name in in_memory.linears:
        assert isinstance(spilled.linears[name], kind)
        assert same_weights(spilled.linears[name], in_memory.linears[name])
    # What is read back is the file's: a layer whose file is gone cannot be produced.
    (spill / "layer1.safetensors").unlink()
    spilled.linears._cache.clear()
    spilled.linears["model.layers.0.mlp.down_proj"]
    with pytest.raises(FileNotFoundError):
        spilled.linears["model.layers.1.mlp.down_proj"]


def test_record_comes_from_shapes_and_linears_are_produced_when_read(tok, tmp_path):
    model = tiny_model("tiny-llama", 0)
    source = CountingSource(model.state_dict())
    result = quantize_source(source, model.config, tok, "rtn", 32, **SOURCE_ARGS)
    assert source.reads == []  # RTN: nothing read or calibrated until a Linear is asked for
    record = result.record()
    assert source.reads == []
    name = "model.layers.1.mlp.down_proj"
    w = result.linears[name]
    assert source.reads == [f"{name}.weight"]  # one Linear's tensors (llama: no bias)
    assert result.linears[name] is w and source.reads == [f"{name}.weight"]  # cached
    weights = [result.linears[n] for n in result.linears]
    assert record["linear_weight_bytes_quantized"] == sum(x.nbytes() for x in weights)
    assert record["linear_weight_bytes_fp16"] == sum(
        2 * n * k for n, k in (x.shape for x in weights)
    )
    assert record == quantize_model(model, tok, "rtn", 32, **CALIB).record()
    assert len(result.linears._cache) == CACHED_LINEARS

    gptq = quantize_source(source, model.config, tok, "gptq", 32, spill_dir=tmp_path, **SOURCE_ARGS)
    for path in tmp_path.iterdir():
        path.unlink()  # the record must not need them
    assert gptq.record()["num_linears_quantized"] == 14


def test_calibration_reads_each_layer_once_and_never_the_head(tok):
    model = tiny_model("tiny-llama", 0)
    source = CountingSource(model.state_dict())
    lines = []
    quantize_source(
        source,
        model.config,
        tok,
        "gptq",
        32,
        kv_cache_scales=True,
        log=lines.append,
        **SOURCE_ARGS,
    )
    assert source.reads[0] == "model.embed_tokens.weight"
    layer_reads = source.reads[1:]
    assert len(layer_reads) == len(set(layer_reads))
    assert [int(n.split(".")[2]) for n in layer_reads] == sorted(
        int(n.split(".")[2]) for n in layer_reads
    )
    assert not any(n.startswith(("lm_head", "model.norm")) for n in source.reads)
    assert [x.split(" in ")[0] for x in lines[:2]] == ["gptq: layer 1/2", "gptq: layer 2/2"]


def test_calibration_device(tok):
    assert CalibrationSection().device == "cpu"
    assert CalibrationSection(device="cuda").device == "cuda"
    with pytest.raises(ValueError):
        CalibrationSection(device="tpu")
    model = tiny_model("tiny-llama", 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' but torch sees no CUDA device"):
            quantize_source(
                state_source(model), model.config, tok, "gptq", 32, device="cuda", **SOURCE_ARGS
            )
    with pytest.raises(ValueError, match="not one of rtn, awq, gptq, fp8, none"):
        quantize_source(state_source(model), model.config, tok, "int3", **SOURCE_ARGS)
