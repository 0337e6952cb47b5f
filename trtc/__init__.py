"""trtc: an ahead-of-time compiler from Hugging Face decoder LLMs to TensorRT engines, and
the runtime that serves what it builds."""

__version__ = "0.1.0"
