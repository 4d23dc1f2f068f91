"""Evaluation: lm-eval pointed at the server (make eval), its local tasks and their data (scripts/eval/tasks/)."""
