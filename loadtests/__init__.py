"""Load tests: Locust users over HTTP, gRPC and the OpenAI API, the batch-size x concurrency sweep, perf_analyzer inputs."""
