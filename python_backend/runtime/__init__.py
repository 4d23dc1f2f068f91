"""Decoder runtimes: one forward pass of the exported decoder on onnxruntime (CPU, CUDA, TensorRT providers) or on
a TensorRT engine, and what they share."""
