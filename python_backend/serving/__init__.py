"""What the Triton models do around the engine: request parsing, tokenization, detokenization, the front's logic,
Triton glue, heartbeats and metrics."""
