"""Benchmarks and capacity planning: the server under load, the weight variants, the runtimes, one decoder step."""
