"""ONNX graph passes (onnx-graphsurgeon), each reporting what it matched."""
