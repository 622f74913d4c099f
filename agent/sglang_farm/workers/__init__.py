"""workers: see docs/ARCHITECTURE.md."""
