"""Benchmarks: transport and pipeline, and the GPU ring harness they share."""
