"""Model preparation: the ONNX export, its quantized variants with their parity reports, the TensorRT engine."""
