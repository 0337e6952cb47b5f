"""The Int4Gemm and Fp8Gemm references against the formulas that define them."""

from __future__ import annotations

import pytest
import torch

from trtc.plugins.fp8_gemm import SPEC as FP8_SPEC
from trtc.plugins.fp8_gemm import Fp8Linear, fp8_gemm, to_fp8
from trtc.plugins.int4_gemm import SPEC as INT4_SPEC
from trtc.plugins.int4_gemm import Int4Linear, int4_gemm, pack_int4, unpack_int4


def random_int4(n, k, group, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)  # a shorter last group when group does not divide k
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    return q, scales, zeros


def test_pack_unpack_round_trip_and_nibble_order():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # Low nibble = even k (the ONNX UINT4 layout).
    assert pack_int4(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))


def test_packing_matches_onnx_uint4_bytes():
    from onnx import TensorProto, helper, numpy_helper

    q = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_int4(q).flatten()
    # ONNX packs a UINT4 tensor the same way (its int32_data holds one packed byte each) ...
    tensor = helper.make_tensor("w", TensorProto.UINT4, [3, 8], q.flatten().tolist())
    assert list(tensor.int32_data) == packed.tolist()
    # ... and reads our bytes, given as raw data, back as the same [N, K] values.
    raw = helper.make_tensor("w", TensorProto.UINT4, [3, 8], packed.numpy().tobytes(), raw=True)
    assert torch.equal(torch.from_numpy(numpy_helper.to_array(raw).astype("uint8")), q)


@pytest.mark.parametrize("group,k", [(32, 256), (64, 256), (128, 256), (128, 320), (64, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_reference_is_the_dense_dequantized_matmul(group, k, bias):
    n, t = 48, 7
    q, scales, zeros = random_int4(n, k, group)
    x = torch.randn(t, k)
    b = torch.randn(n) if bias else None
    w = torch.empty(n, k)
    for r in range(n):  # the spec's formula, element by element per group
        for c in range(k):
            w[r, c] = (float(q[r, c]) - float(zeros[r, c // group])) * float(scales[r, c // group])
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    y = int4_gemm(
        x, pack_int4(q), scales, zeros, b, group_size=group, in_features=k, out_features=n
    )
    assert y.shape == (t, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int4_computes_in_fp32_and_returns_x_dtype(dtype):
    n, k, group = 32, 128, 64
    q, scales, zeros = random_int4(n, k, group, dtype)
    x = torch.randn(5, k).to(dtype)
    y = int4_gemm(
        x, pack_int4(q), scales, zeros, None, group_size=group, in_features=k, out_features=n
    )
    w = (q.float() - zeros.float().repeat_interleave(group, 1)) * scales.float().repeat_interleave(
        group, 1
    )
    assert y.dtype == dtype
    torch.testing.assert_close(y, (x.float() @ w.T).to(dtype))


def test_int4_shape_errors():
    q, scales, zeros = random_int4(8, 64, 32)
    with pytest.raises(ValueError, match="scales"):
        int4_gemm(
            torch.randn(2, 64),
            pack_int4(q),
            scales[:, :1],
            zeros,
            group_size=32,
            in_features=64,
            out_features=8,
        )
    with pytest.raises(ValueError, match=r"scales has shape \(8, 2\), expected \[8, 3\]"):
        int4_gemm(
            torch.randn(2, 64),
            pack_int4(q),
            scales,
            zeros,
            group_size=24,
            in_features=64,
            out_features=8,
        )
    with pytest.raises(ValueError, match="must be even"):
        int4_gemm(
            torch.randn(2, 63),
            q[:, :32],
            scales,
            zeros,
            group_size=32,
            in_features=63,
            out_features=8,
        )


def test_int4_linear_module_keeps_packed_dtypes():
    q, scales, zeros = random_int4(16, 64, 32)
    m = Int4Linear(pack_int4(q), scales, zeros, torch.zeros(16), 32).to(torch.float16)
    assert m.qweight.dtype == torch.uint8 and m.zeros.dtype == torch.uint8
    assert m.scales.dtype == torch.float16
    assert m(torch.randn(3, 64, dtype=torch.float16)).shape == (3, 16)


def test_specs_describe_the_nodes():
    assert INT4_SPEC.qualified_name == "trtc::Int4Gemm"
    assert FP8_SPEC.qualified_name == "trtc::Fp8Gemm"
    assert set(INT4_SPEC.attributes) == {"group_size", "in_features", "out_features"}
    assert INT4_SPEC.to_manifest()["inputs"][-1] == "bias"


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_reference_is_the_formula(bias):
    n, k = 24, 96
    x = torch.randn(6, k)
    w = torch.randn(n, k) * 0.05
    weight_scale = w.abs().amax(1) / 448
    weight = (w / weight_scale[:, None]).to(torch.float8_e4m3fn)
    input_scale = torch.tensor(x.abs().max().item() / 448)
    b = torch.randn(n) if bias else None
    y = fp8_gemm(x, weight, weight_scale, input_scale, b, in_features=k, out_features=n)
    x_q = (x / input_scale).to(torch.float8_e4m3fn).float() * input_scale
    expected = x_q @ (weight.float() * weight_scale[:, None]).T + (b if bias else 0)
    torch.testing.assert_close(y, expected)
    # And it is close to the unquantized product (E4M3 has a 3-bit mantissa).
    rel = (y - (x @ w.T + (b if bias else 0))).norm() / y.norm()
    assert rel < 0.05


def test_fp8_saturates_instead_of_overflowing():
    assert to_fp8(torch.tensor([1e6, -1e6, 448.0, 500.0])).float().tolist() == [448, -448, 448, 448]
    weight = torch.ones(1, 4).to(torch.float8_e4m3fn)
    x = torch.tensor([[1000.0, 1.0, -1000.0, 0.0]])
    y = fp8_gemm(x, weight, torch.ones(1), torch.tensor(1.0), in_features=4, out_features=1)
    assert y.item() == 448.0 + 1.0 - 448.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_returns_x_dtype_and_module_keeps_fp8_buffers(dtype):
    weight = torch.randn(8, 32).to(torch.float8_e4m3fn)
    m = Fp8Linear(weight, torch.rand(8) + 0.1, torch.tensor(0.01), torch.zeros(8)).to(dtype)
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
    assert m.input_scale.dtype == torch.float32 and m.bias.dtype == dtype
    assert m(torch.randn(3, 32, dtype=dtype)).dtype == dtype


def test_plugins_emit_one_node_under_onnx_export():
    q, scales, zeros = random_int4(16, 64, 32)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Int4Linear(pack_int4(q), scales, zeros, None, 32)
            self.b = Fp8Linear(
                torch.randn(8, 16).to(torch.float8_e4m3fn),
                torch.ones(8),
                torch.tensor(0.1),
                torch.zeros(8),
            )

        def forward(self, x):
            return self.b(self.a(x))

    x = torch.randn(3, 64)
    program = torch.onnx.export(
        Two().eval(),
        (x,),
        dynamo=True,
        optimize=False,
        verbose=False,
        dynamic_shapes=({0: torch.export.Dim("T")},),
    )
    nodes = {(n.domain, n.op_type): n for n in program.model_proto.graph.node}
    int4, fp8 = nodes[("trtc", "Int4Gemm")], nodes[("trtc", "Fp8Gemm")]
    assert len(int4.input) == 4 and len(fp8.input) == 5  # no bias / with bias
    assert {a.name: a.i for a in int4.attribute} == {
        "group_size": 32,
        "in_features": 64,
        "out_features": 16,
    }
