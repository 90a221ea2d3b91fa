"""Serving: reads ONNX bundles with onnxruntime + numpy only. Nothing here imports torch."""
