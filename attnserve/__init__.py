"""attnserve: a Transformer trained from first principles, exported to ONNX, served over gRPC."""

__version__ = "0.1.0"
