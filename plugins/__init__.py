"""trtc plugins: one semantic definition (a torch reference) per custom ONNX op, plus the
implementations that must agree with it."""
from trtc.plugins.paged_attention import SPEC as PAGED_ATTENTION
from trtc.plugins.spec import DOMAIN, PluginSpec

PLUGINS: dict[str, PluginSpec] = {PAGED_ATTENTION.op_type: PAGED_ATTENTION}

__all__ = ["DOMAIN", "PLUGINS", "PAGED_ATTENTION", "PluginSpec"]
