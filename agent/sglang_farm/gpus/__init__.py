"""gpus: see docs/ARCHITECTURE.md."""
