"""Guided decoding (structured outputs): a request's JSON schema, regular expression or grammar compiled to a
token-level matcher (llguidance), and the masks it puts on its own row of logits at each step."""
