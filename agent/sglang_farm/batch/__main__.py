"""I/O: `python -m sglang_farm.batch` runs the batch service (`main.main`)."""

from sglang_farm.batch.main import main

raise SystemExit(main())
