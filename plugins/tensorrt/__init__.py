"""The full-TensorRT side of trtc's plugins: ``IPluginV3`` wrappers (`plugin.py`) around the
plugins' torch entry points, and the rules they follow (`rules.py`, plain functions of the
plugin specs). Nothing here imports TensorRT: the module is passed in."""

from trtc.plugins.tensorrt.plugin import (
    create_plugin,
    deregister_plugins,
    plugin_classes,
    register_plugins,
    run_plugin,
)

__all__ = [
    "create_plugin",
    "deregister_plugins",
    "plugin_classes",
    "register_plugins",
    "run_plugin",
]
