"""The generation engine: loop, scheduler, sequences, sampling, the KV-cache batch and the outbox."""
