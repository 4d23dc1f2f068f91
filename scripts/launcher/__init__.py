"""The server's launcher: starts tritonserver (and the OpenAI-compatible API), supervises and reloads it."""
