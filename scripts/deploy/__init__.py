"""Generators of deployment files (the Grafana dashboard) that tests keep in step with the server."""
