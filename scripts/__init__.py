"""Command-line tools around the served model, one package per job: prepare, launcher, bench, clients, deploy."""
