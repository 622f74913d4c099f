"""sglang: see docs/ARCHITECTURE.md."""
