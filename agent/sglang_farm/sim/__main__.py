"""I/O: `python -m sglang_farm.sim [SGLang flags...]`."""

from sglang_farm.sim import main

raise SystemExit(main())
