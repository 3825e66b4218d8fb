"""After training: predictions and evaluation from any method's checkpoint, ONNX export and its parity check."""
