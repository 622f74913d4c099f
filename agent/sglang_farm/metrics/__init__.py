"""metrics: see docs/ARCHITECTURE.md."""
