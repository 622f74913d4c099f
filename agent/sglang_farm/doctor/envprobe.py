"""I/O: a standalone probe of one SGLang Python environment; prints one JSON object.

A script, NEVER IMPORTED (not even by the doctor): it is run BY THE WORKERS'
INTERPRETER (`farm.python`), not the agent's. It imports nothing from `sglang_farm`
and nothing outside the standard library, so it runs in any environment the farm may
point at. The doctor (`doctor/gather.py`) reads this file's text and runs it as
`<python> -c <text> MODE` from `/`: run as a file, its directory (the `doctor`
package, with modules named `rules`, `report`, ...) would come first on `sys.path` and
could shadow the environment's own modules.

Modes:

- `env` (default): facts about the environment. Each fact is gathered in its own
  try/except so one broken package never hides the others. `sglang` itself is never
  imported here (it needs torch and, further down, a GPU): its version comes from
  the package metadata. `sgl_kernel` and `deep_gemm` are imported in child processes,
  so a native crash (a segfault while loading a .so) is reported, not suffered.
- `flags`: reads `{"argvs": [[...], ...]}` on stdin and checks each argv against the
  installed SGLang's own argument parser (`sglang.srt.server_args`, built exactly as
  `prepare_server_args` builds it). Reports per argv: the argparse `error:` line (exit
  2), and per `--flag` token whether it is an exact option, an abbreviation argparse
  expands (allow_abbrev=True), ambiguous, or unknown.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from typing import Any

# How long one child import (torch + a native extension) may take. torch alone takes
# 2-10 s to import on a cold page cache.
IMPORT_TIMEOUT_S = 120.0
# The last place deep_gemm and SGLang's JIT look for a CUDA toolkit. Tests point this
# variable at a directory that does not exist, so that the host's own toolkit (if any)
# does not leak into a simulated host without one.
CUDA_FALLBACK_ENV = "ENVPROBE_CUDA_FALLBACK"

_IMPORT_CHILD = r"""
import json, sys, traceback
name = sys.argv[1]
try:
    mod = __import__(name)
except BaseException as e:
    tb = traceback.extract_tb(e.__traceback__)
    where = tb[-1] if tb else None
    print(json.dumps({
        "ok": False,
        "type": type(e).__name__,
        "message": str(e).strip(),
        "line": where.line if where else None,
        "file": where.filename if where else None,
    }))
else:
    print(json.dumps({"ok": True, "version": str(getattr(mod, "__version__", "") or "")}))
"""


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken dist-info must not stop the probe
            continue
    return None


def _package_dir(name: str) -> str | None:
    """The directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return str(locations[0])
    if spec.origin:
        return os.path.dirname(spec.origin)
    return None


def _start_import(name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _IMPORT_CHILD, name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish_import(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {
            "ok": False,
            "type": "Timeout",
            "message": f"import took over {IMPORT_TIMEOUT_S:g} s",
        }
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                result: dict[str, Any] = json.loads(line)
            except ValueError:
                break
            return result
    tail = "\n".join(err.strip().splitlines()[-5:])
    return {
        "ok": False,
        "type": "Crash",
        "message": f"the import process exited with status {proc.returncode}: {tail}",
    }


def _torch() -> dict[str, Any]:
    info: dict[str, Any] = {"installed": False}
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]  # the workers' env has it
    except Exception as exc:  # any failure is a fact to report
        info["error"] = _err(exc)
        return info
    info["installed"] = True
    for key, get in (
        ("version", lambda: str(torch.__version__)),
        ("cuda", lambda: torch.version.cuda),
        ("arch_list", lambda: list(torch.cuda.get_arch_list())),
        ("cuda_available", lambda: bool(torch.cuda.is_available())),
        ("device_count", lambda: int(torch.cuda.device_count())),
    ):
        try:
            info[key] = get()
        except Exception as exc:  # reported, never raised
            info[key] = None
            info[f"{key}_error"] = _err(exc)
    if info.get("cuda_available"):
        try:
            cap = torch.cuda.get_device_capability(0)
            info["device_capability"] = [int(cap[0]), int(cap[1])]
        except Exception as exc:  # reported, never raised
            info["device_capability_error"] = _err(exc)
    return info


def _sgl_kernel() -> dict[str, Any]:
    directory = _package_dir("sgl_kernel")
    info: dict[str, Any] = {
        "installed": directory is not None,
        "version": _dist_version("sglang-kernel", "sgl-kernel"),
        "path": directory,
        "variants": [],
        "top_level_common_ops": False,
    }
    if directory is None:
        return info
    try:
        entries = sorted(os.listdir(directory))
    except OSError as exc:
        info["error"] = _err(exc)
        return info
    for entry in entries:
        full = os.path.join(directory, entry)
        if entry.startswith("common_ops"):
            info["top_level_common_ops"] = True
        if entry.startswith("sm") and os.path.isdir(full):
            with contextlib.suppress(OSError):
                if any(f.startswith("common_ops") for f in os.listdir(full)):
                    info["variants"].append(entry)
    return info


def _cuda_home() -> dict[str, Any]:
    """The toolkit deep_gemm and SGLang's JIT find: CUDA_HOME, CUDA_PATH, nvcc, /usr/local/cuda."""
    home: str | None = None
    source: str | None = None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            home, source = os.environ[var], var
            break
    nvcc_on_path = shutil.which("nvcc")
    if home is None and nvcc_on_path:
        home, source = os.path.dirname(os.path.dirname(nvcc_on_path)), "nvcc on PATH"
    fallback = os.environ.get(CUDA_FALLBACK_ENV, "/usr/local/cuda")
    if home is None and os.path.isdir(fallback):
        home, source = fallback, fallback
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    info: dict[str, Any] = {
        "path": home,
        "source": source,
        "exists": bool(home and os.path.isdir(home)),
        "nvcc": nvcc if nvcc and os.access(nvcc, os.X_OK) else None,
        "nvcc_version": None,
    }
    if info["nvcc"]:
        try:
            out = subprocess.run(
                [info["nvcc"], "--version"], capture_output=True, text=True, timeout=20
            ).stdout
            info["nvcc_version"] = out.strip().splitlines()[-1] if out.strip() else None
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvcc_error"] = _err(exc)
    return info


def probe_env() -> dict[str, Any]:
    """Every fact of the `env` mode, as one JSON-ready dict."""
    kernel_proc = gemm_proc = None
    kernel = _sgl_kernel()
    gemm_dir = _package_dir("deep_gemm")
    # The two child imports run while this process imports torch.
    if kernel["installed"]:
        kernel_proc = _start_import("sgl_kernel")
    if gemm_dir is not None:
        gemm_proc = _start_import("deep_gemm")
    result: dict[str, Any] = {
        "probe": "env",
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
        "torch": _torch(),
        "sglang": {
            "installed": _package_dir("sglang") is not None,
            "version": _dist_version("sglang"),
            "path": _package_dir("sglang"),
        },
        "sgl_kernel": kernel,
        "deep_gemm": {
            "installed": gemm_dir is not None,
            "version": _dist_version("sgl-deep-gemm", "deep-gemm", "deep_gemm"),
            "path": gemm_dir,
        },
        "flashinfer": {
            "installed": _package_dir("flashinfer") is not None,
            "version": _dist_version("flashinfer-python", "flashinfer_python", "flashinfer"),
        },
        "cuda_home": _cuda_home(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "SGLANG_ENABLE_JIT_DEEPGEMM",
                "SGL_ENABLE_JIT_DEEPGEMM",
                "CUDA_VISIBLE_DEVICES",
                "CUDA_HOME",
                "CUDA_PATH",
            )
        },
    }
    if kernel_proc is not None:
        result["sgl_kernel"]["import"] = _finish_import(kernel_proc)
    if gemm_proc is not None:
        result["deep_gemm"]["import"] = _finish_import(gemm_proc)
    return result


# --- flags mode -------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    """SGLang's parser, built like `prepare_server_args` (prog "sglang serve", allow_abbrev)."""
    from sglang.srt import server_args  # type: ignore[import-not-found,unused-ignore]  # ditto

    parser = argparse.ArgumentParser(prog="sglang serve")
    server_args.ServerArgs.add_cli_args(parser)
    return parser


def _classify_token(flag: str, options: list[str]) -> dict[str, Any]:
    if flag in options:
        return {"flag": flag, "match": "exact"}
    # argparse matches long-option prefixes only (allow_abbrev) and only before "=".
    candidates = sorted(o for o in options if o.startswith("--") and o.startswith(flag))
    if len(candidates) == 1:
        return {"flag": flag, "match": "prefix", "expands_to": candidates[0]}
    if candidates:
        return {"flag": flag, "match": "ambiguous", "candidates": candidates}
    return {"flag": flag, "match": "unknown"}


def check_argv(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    """One argv against the parser: argparse's verdict and each flag's match."""
    options = sorted(parser._option_string_actions)  # no public list exists
    tokens = []
    for item in argv:
        if item == "--":
            break
        if item.startswith("--"):
            tokens.append(_classify_token(item.split("=", 1)[0], options))
    err = io.StringIO()
    status = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            status = int(exc.code) if isinstance(exc.code, int) else 1
    error_lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
    return {
        "exit_status": status,
        "error": error_lines[-1] if error_lines else (err.getvalue().strip() or None),
        "tokens": tokens,
    }


def probe_flags(payload: dict[str, Any]) -> dict[str, Any]:
    """The `flags` mode: each argv of `payload["argvs"]` checked against SGLang's parser."""
    try:
        parser = _build_parser()
    except BaseException as exc:  # SystemExit, ImportError, anything
        return {"probe": "flags", "parser": False, "error": _err(exc)}
    return {
        "probe": "flags",
        "parser": True,
        "results": [check_argv(parser, list(argv)) for argv in payload.get("argvs", [])],
    }


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else "env"
    if mode == "env":
        result = probe_env()
    elif mode == "flags":
        result = probe_flags(json.loads(sys.stdin.read() or "{}"))
    else:
        print(f"envprobe: unknown mode {mode!r}; use env or flags", file=sys.stderr)
        return 2
    # One line, last on stdout: whatever a package printed on import comes before it.
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
