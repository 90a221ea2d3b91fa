"""Turn a model directory into an ONNX bundle that serving runs with onnxruntime and numpy alone."""
