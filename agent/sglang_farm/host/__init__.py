"""host: see docs/ARCHITECTURE.md."""
