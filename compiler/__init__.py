"""trtc compiler: Hugging Face checkpoint -> optimized ONNX graph with plugins -> artifact."""
