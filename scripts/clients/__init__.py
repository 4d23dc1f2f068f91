"""Clients of the served model: a tritonclient wrapper for HTTP and gRPC, a prompt-file client, the demo."""
