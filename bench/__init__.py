"""I/O: sglang-farm's benchmarks (`python -m bench` from the repo root; see docs/benchmarks.md).

Each benchmark prints figures and never asserts on time: these machines are shared
and noisy, so every comparison is a ratio measured in the same run.
"""

import sys
from pathlib import Path

# The benchmarks share the tests' harnesses (tests/farmproc.py, tests/batchfarm.py, ...),
# imported by their own names, as the tests import them: one module each, never two.
_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
