"""What a plugin is, as ONNX sees it: one description per plugin, shared by export, the
onnxruntime custom ops, the manifest and (later) the TensorRT creators."""

from __future__ import annotations

from dataclasses import dataclass, field

DOMAIN = "trtc"


@dataclass(frozen=True)
class PluginSpec:
    op_type: str
    version: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, type]
    aliases: dict[str, str] = field(default_factory=dict)  # output -> input it updates in place
    doc: str = ""

    @property
    def qualified_name(self) -> str:
        return f"{DOMAIN}::{self.op_type}"

    def to_manifest(self) -> dict:
        return {
            "domain": DOMAIN,
            "op_type": self.op_type,
            "version": self.version,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "attributes": {k: t.__name__ for k, t in self.attributes.items()},
            "aliases": dict(self.aliases),
            "semantics": self.doc,
        }
