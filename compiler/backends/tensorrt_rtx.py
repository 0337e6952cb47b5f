"""Build TensorRT-RTX engines from a lowered (slot-contract) graph, one per target architecture.

TensorRT-RTX builds ahead of time on the CPU (no GPU needed): the network is parsed once,
strongly typed (the graph's dtypes are the engine's: there are no precision flags), and built
once per target with that target's compute capability. Deserialising an engine needs a GPU, so
everything recorded about an engine (its I/O names, dtypes and shapes) is read back from the
built network, not from the engine."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from trtc import slot_contract as slot
from trtc.artifact import Limits, sha256_file
from trtc.compiler.targets import check_known, describe_targets
from trtc.errors import BuildError, ConfigError
from trtc.gpu_profiles import architecture_profiles
from trtc.plugins.tensorrt.logger import make_logger

BACKEND = "tensorrt-rtx"
ENGINE_DIR = "engines"
INSTALL_HINT = "pip install tensorrt-rtx-cu13"


def import_trt():
    try:
        import tensorrt_rtx as trt
    except ImportError as e:
        raise BuildError(
            f"backend {BACKEND}: the tensorrt_rtx package is not importable ({e}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    return trt


def _capability_member(target: str) -> str:
    """``sm86`` -> ``SM86``: the ``trt.ComputeCapability`` member named after the profile's
    compute capability (``8.6``)."""
    return "SM" + architecture_profiles()[target]["compute_capability"].replace(".", "")


def supported_targets(trt=None) -> list[str]:
    """Targets of ``configs/architectures.yaml`` that the installed TensorRT-RTX can build for."""
    trt = trt or import_trt()
    members = trt.ComputeCapability.__members__
    return [t for t in architecture_profiles() if _capability_member(t) in members]


def check_targets(targets: list[str], trt=None) -> None:
    """Refuse, before any work, targets this TensorRT-RTX cannot build for."""
    trt = trt or import_trt()
    check_known(targets)
    supported = supported_targets(trt)
    refused = [t for t in targets if t not in supported]
    if refused:
        raise ConfigError(
            f"backend.targets: TensorRT-RTX {trt.__version__} cannot build for "
            f"{describe_targets(refused)}; it supports {', '.join(supported)} (use backend "
            f"tensorrt for the others)"
        )
    if not targets:
        raise ConfigError(
            f"backend.targets: backend {BACKEND} needs at least one target "
            f"(supported: {', '.join(supported)})"
        )


def _dtype_name(trt, dtype) -> str:
    names = {
        trt.float32: "fp32",
        trt.float16: "fp16",
        trt.bfloat16: "bf16",
        trt.int64: "int64",
        trt.int32: "int32",
        trt.int8: "int8",
        trt.bool: "bool",
    }
    return names.get(dtype, str(dtype).removeprefix("DataType."))


def parse_network(trt, builder, model: onnx.ModelProto, workdir: Path, backend: str = BACKEND):
    """Parse the graph into a strongly typed network; parser errors become a BuildError naming
    each refused node. Returns ``(network, parser)`` (the parser owns the weights: keep it until
    the build ends). Shared by both TensorRT backends (the same Python API)."""
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, builder.logger)
    path = workdir / "model.onnx"  # weights beside it: the 2 GB protobuf limit does not apply
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    if not parser.parse_from_file(str(path)):
        errors = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            where = (
                f"node {e.node()} ({e.node_name() or '?'}, {e.node_operator() or '?'})"
                if e.node() >= 0
                else "graph"
            )
            errors.append(f"{where}: {e.desc()}")
        raise BuildError(
            f"backend {backend}: the ONNX parser refused the graph: "
            + "; ".join(errors or ["no message"])
        )
    return network, parser


def build_plan(
    builder,
    network,
    shapes: dict[str, tuple[tuple, tuple, tuple]],
    messages: list[str],
    backend: str,
    target: str,
    configure: Callable | None = None,
):
    """One engine: a builder config with one optimization profile (``shapes``: min/opt/max per
    input), ``configure(config)`` for the backend's own settings, then the build; a failed build
    is a BuildError with the builder's last errors. Returns ``(plan, seconds, config)``."""
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    if configure is not None:
        configure(config)
    messages.clear()
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    if plan is None:
        raise BuildError(
            f"backend {backend}: building the {target} engine failed: "
            + ("; ".join(messages[-4:]) or f"no message from {backend}")
        )
    return plan, seconds, config


def engine_record(
    trt,
    target: str,
    backend: str,
    precision: str,
    kv_layout: str,
    rel: str,
    path: Path,
    seconds: float,
    shapes: dict,
    io: dict,
    aliases: dict,
    **extra,
) -> dict:
    """The manifest record of one built engine (both backends)."""
    return {
        "target": target,
        "compute_capability": architecture_profiles()[target]["compute_capability"],
        "backend": backend,
        "trt_version": trt.__version__,
        "precision": precision,
        "kv_layout": kv_layout,
        **extra,
        "file": rel,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "build_time_s": round(seconds, 2),
        "profile": {
            n: {"min": list(lo), "opt": list(opt), "max": list(hi)}
            for n, (lo, opt, hi) in shapes.items()
        },
        "io": io,
        "aliases": aliases,
    }


def optimization_profile(network, limits: Limits) -> dict[str, tuple[tuple, tuple, tuple]]:
    """min/opt/max shapes of every input: B in 1..max_num_seqs, S in 1..max_num_tokens (and at
    most the caches' max_seq_len: the KV update cannot write more rows than a cache has).
    opt is the in-flight decode step (every slot busy, one new token each), the shape a serving
    engine runs most; prefill chunks still run, on kernels picked for their own shapes."""
    cache_len = max(
        (
            network.get_input(i).shape[2]
            for i in range(network.num_inputs)
            if network.get_input(i).name.startswith("k_cache.")
        ),
        default=0,
    )
    max_b = int(limits.max_num_seqs)
    max_s = min(int(limits.max_num_tokens), cache_len or int(limits.max_num_tokens))
    dims = {slot.BATCH: (1, max_b, max_b), slot.NEW_TOKENS: (1, 1, max_s)}
    batch_only = {"cache_positions", "logits_indices"}
    profile = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        shape = list(t.shape)
        symbolic = (
            [slot.BATCH, slot.NEW_TOKENS]
            if t.name == "input_ids"
            else [slot.BATCH]
            if t.name in batch_only
            else [slot.BATCH] + [None] * (len(shape) - 1)
        )
        mins, opts, maxs = [], [], []
        for k, d in enumerate(shape):
            if d >= 0:
                mins.append(d), opts.append(d), maxs.append(d)
                continue
            name = symbolic[k] if k < len(symbolic) else None
            if name not in dims:
                raise BuildError(
                    f"backend {BACKEND}: input {t.name} has dynamic dimension {k} "
                    f"that the slot contract does not name"
                )
            lo, opt, hi = dims[name]
            mins.append(lo), opts.append(opt), maxs.append(hi)
        profile[t.name] = (tuple(mins), tuple(opts), tuple(maxs))
    return profile


def network_io(trt, network, contract_shapes: dict[str, tuple]) -> dict:
    """Names, dtypes and shapes as the built network has them (-1 dims named by the contract)."""

    def describe(t):
        want = contract_shapes.get(t.name, ())
        shape = [
            want[k] if d < 0 and k < len(want) and isinstance(want[k], str) else d
            for k, d in enumerate(t.shape)
        ]
        return {"name": t.name, "dtype": _dtype_name(trt, t.dtype), "shape": shape}

    return {
        "inputs": [describe(network.get_input(i)) for i in range(network.num_inputs)],
        "outputs": [describe(network.get_output(i)) for i in range(network.num_outputs)],
    }


def build_rtx_engines(
    lowered: onnx.ModelProto,
    out_dir: Path,
    targets: list[str],
    limits: Limits,
    precision: str,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Build ``out_dir/engines/<target>.engine`` for each target; one manifest record each."""
    trt = import_trt()
    check_targets(targets, trt)
    profiles = architecture_profiles()
    out_dir = Path(out_dir)
    (out_dir / ENGINE_DIR).mkdir(parents=True, exist_ok=True)
    messages: list[str] = []
    logger = make_logger(trt, BACKEND, log, messages, ignore=("Make sure input",))
    builder = trt.Builder(logger)
    records = []
    with tempfile.TemporaryDirectory(prefix="trtc-rtx-") as tmp:
        started = time.perf_counter()
        network, parser = parse_network(trt, builder, lowered, Path(tmp))
        parse_s = time.perf_counter() - started
        log(f"tensorrt-rtx {trt.__version__}: parsed {network.num_layers} layers in {parse_s:.1f}s")
        names_out = {network.get_output(i).name for i in range(network.num_outputs)}
        num_layers = sum(1 for i in lowered.graph.input if i.name.startswith("k_cache."))
        aliases = {}
        for i in range(num_layers):
            aliases[slot.k_cache_out_name(i)] = slot.k_cache_name(i)
            aliases[slot.v_cache_out_name(i)] = slot.v_cache_name(i)
        missing = sorted(o for o in aliases if o not in names_out)
        if missing:
            raise BuildError(f"backend {BACKEND}: updated caches {missing} are not network outputs")
        shapes = optimization_profile(network, limits)
        contract_shapes = {
            i.name: tuple(d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim)
            for i in [*lowered.graph.input, *lowered.graph.output]
        }
        io = network_io(trt, network, contract_shapes)
        for target in targets:
            cc = profiles[target]["compute_capability"]

            def configure(config, target=target):
                config.num_compute_capabilities = 1
                config.set_compute_capability(
                    getattr(trt.ComputeCapability, _capability_member(target)), 0
                )

            log(f"tensorrt-rtx: building {target} (compute capability {cc}) ...")
            plan, seconds, _ = build_plan(
                builder, network, shapes, messages, BACKEND, target, configure
            )
            rel = f"{ENGINE_DIR}/{target}.engine"
            path = out_dir / rel
            path.write_bytes(plan)
            del plan
            record = engine_record(
                trt,
                target,
                BACKEND,
                precision,
                slot.KV_LAYOUT,
                rel,
                path,
                seconds,
                shapes,
                io,
                aliases,
            )
            records.append(record)
            log(f"tensorrt-rtx: built {rel} in {seconds:.1f}s ({record['bytes'] / 1e6:.1f} MB)")
        del parser, network
    return records
