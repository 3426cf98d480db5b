"""The kvbench CLI: storage, trace replay, policies, daemon load and engine benchmarks."""
