"""The ``engine-core bench`` commands: offline throughput and latency, and an HTTP load client."""
