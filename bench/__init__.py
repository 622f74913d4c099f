"""I/O: sglang-farm's benchmarks (`python -m bench` from the repo root; see docs/benchmarks.md).

Each benchmark prints figures and never asserts on time: these machines are shared
and noisy, so every comparison is a ratio measured in the same run.
"""
