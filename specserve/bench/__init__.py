"""Benchmark implementations behind `specserve bench` (offline, serve, spec)."""
