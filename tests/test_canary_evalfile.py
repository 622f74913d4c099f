"""The `[rollout] eval` file is read as root reads what it trusts (review B8, issue 23):
another user's file, a file others can write, another user's link, a FIFO or an
oversized file is refused with the file, its owner or mode and what to do; a FIFO
never blocks the agent. The other user's steps run as nobody for real."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from agent_harness import farm, farm_toml
from asuser import as_nobody, nobody_python
from sglang_farm.canary import evalfile
from sglang_farm.config import load_spec
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual

SET = '{"id": "a", "prompt": "What is 2 + 2?", "answer": 4}\n'


def _nobody_writes(path: Path, mode: int = 0o644) -> None:
    """nobody creates `path` holding SET (so its owner is nobody's doing)."""
    nobody_python(
        "import os,sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, "
        "int(sys.argv[2], 8)); os.write(fd, sys.argv[3].encode()); os.fchmod(fd, "
        "int(sys.argv[2], 8))",
        str(path),
        oct(mode)[2:],
        SET,
    )


def _read_in_thread(path: Path) -> BaseException | str:
    """`evalfile.read` in a daemon thread, so that a read that blocks fails the test
    instead of hanging it."""
    out: list[BaseException | str] = []

    def go() -> None:
        try:
            out.append(evalfile.read(str(path)))
        except BaseException as exc:  # handed to the test
            out.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)
    assert out, f"evalfile.read({path}) blocked"
    return out[0]


def test_a_root_file_is_read(shared_dir: Path) -> None:
    path = shared_dir / "eval.jsonl"
    path.write_text(SET)
    os.chmod(path, 0o644)
    assert evalfile.read(str(path)) == SET


def test_a_file_nobody_made_is_refused_naming_its_owner(shared_dir: Path) -> None:
    path = shared_dir / "eval.jsonl"
    _nobody_writes(path, 0o644)
    with pytest.raises(evalfile.EvalFileRefused) as exc:
        evalfile.read(str(path))
    msg = str(exc.value)
    assert f"refusing the eval set {path}:" in msg
    assert "owned by nobody (uid 65534)" in msg
    assert f"chown root:root {path} && chmod 0644 {path}" in msg


def test_a_root_file_others_can_write_is_refused_with_its_mode(shared_dir: Path) -> None:
    path = shared_dir / "eval.jsonl"
    path.write_text(SET)
    os.chmod(path, 0o666)
    with pytest.raises(evalfile.EvalFileRefused, match=r"mode 0666\) can be written by other"):
        evalfile.read(str(path))


def test_a_link_nobody_made_is_not_followed(shared_dir: Path) -> None:
    good = shared_dir / "good.jsonl"
    good.write_text(SET)
    os.chmod(good, 0o644)
    link = shared_dir / "eval.jsonl"
    as_nobody(["ln", "-s", str(good), str(link)])
    with pytest.raises(evalfile.EvalFileRefused, match="symbolic link made by nobody"):
        evalfile.read(str(link))


def test_a_fifo_nobody_made_is_refused_without_blocking(shared_dir: Path) -> None:
    fifo = shared_dir / "eval.jsonl"
    as_nobody(["mkfifo", "-m", "0644", str(fifo)])
    got = _read_in_thread(fifo)
    assert isinstance(got, evalfile.EvalFileRefused)
    assert "is not a regular file" in str(got)


def test_a_root_fifo_is_refused_without_blocking(shared_dir: Path) -> None:
    fifo = shared_dir / "eval.jsonl"
    os.mkfifo(fifo, 0o644)
    got = _read_in_thread(fifo)
    assert isinstance(got, evalfile.EvalFileRefused)
    assert f"{fifo} is not a regular file" in str(got)


def test_a_file_past_the_size_cap_is_refused(shared_dir: Path) -> None:
    path = shared_dir / "eval.jsonl"
    path.write_text(SET * (evalfile.MAX_BYTES // len(SET) + 1))
    os.chmod(path, 0o644)
    with pytest.raises(evalfile.EvalFileRefused, match="larger than 4 MiB"):
        evalfile.read(str(path))


def test_a_reload_naming_nobodys_eval_file_is_refused_naming_the_owner(
    tmp: Path,
    shared_dir: Path,
) -> None:
    path = shared_dir / "eval.jsonl"
    _nobody_writes(path, 0o666)
    rollout = {"analysis_window": "60s"}
    old = farm_toml(tmp, workers=2, rollout=rollout)
    new = farm_toml(tmp, workers=2, rollout={**rollout, "eval": str(path)})

    async def scenario() -> None:
        async with farm(tmp, text=old, loader=lambda: load_spec(new, source="test.toml")) as f:
            await f.until(lambda: all(f.phase(w) is Phase.READY for w in (0, 1)))
            result = await f.ops.reload()
            assert not result.applied
            # A config problem (farmctl exit 1), not a change held (exit 6; issue 30 #12).
            assert result.held is None
            (problem,) = result.problems
            assert problem.startswith(f"test.toml: rollout.eval: refusing the eval set {path}:")
            assert "owned by nobody (uid 65534)" in problem
            assert [f.runtime.starts_of(w) for w in (0, 1)] == [1, 1]

    run_virtual(scenario())


def test_a_reload_naming_a_fifo_is_refused_without_blocking_the_agent(
    tmp: Path,
    shared_dir: Path,
) -> None:
    """A FIFO where the eval set should be (root's own, so that only its kind is wrong):
    opened without waiting for a writer and refused. Run in a thread so that a reload
    that blocks fails the test instead of hanging it."""
    folder = shared_dir / "etc"
    folder.mkdir(mode=0o755)
    fifo = folder / "eval.jsonl"
    os.mkfifo(fifo, 0o644)
    rollout = {"analysis_window": "60s"}
    old = farm_toml(tmp, workers=2, rollout=rollout)
    new = farm_toml(tmp, workers=2, rollout={**rollout, "eval": str(fifo)})
    problems: list[str] = []

    async def scenario() -> None:
        async with farm(tmp, text=old, loader=lambda: load_spec(new, source="test.toml")) as f:
            await f.until(lambda: all(f.phase(w) is Phase.READY for w in (0, 1)))
            result = await f.ops.reload()
            assert not result.applied
            problems.extend(result.problems)

    errors: list[BaseException] = []

    def go() -> None:
        try:
            run_virtual(scenario())
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the reload blocked on the FIFO"
    if errors:
        raise errors[0]
    assert problems == [
        f"test.toml: rollout.eval: refusing the eval set {fifo}: {fifo} is not a regular file; "
        "the eval set decides whether a change rolls out: make it a regular file of root's "
        f"that no other user can write (chown root:root {fifo} && chmod 0644 {fifo}), in a "
        "folder only root can write, or remove [rollout] eval"
    ]


def test_a_reload_naming_an_unusable_eval_set_is_refused_as_a_config_problem_not_held(
    tmp: Path,
    shared_dir: Path,
) -> None:
    """Issue 30 #12: an eval set that cannot be used is a problem of the config (farmctl
    reload exits 1, as for any config problem), not a change held by its canary (exit 6:
    too little traffic, or rejected before). Each problem is one line naming the file."""
    folder = shared_dir / "etc"
    folder.mkdir(mode=0o755)
    path = folder / "eval.jsonl"
    path.write_text(SET + '{"prompt": "What is 1 + 1?", "answr": 2}\n')
    os.chmod(path, 0o644)
    rollout = {"analysis_window": "60s"}
    old = farm_toml(tmp, workers=2, rollout=rollout)
    new = farm_toml(tmp, workers=2, rollout={**rollout, "eval": str(path)})

    async def scenario() -> None:
        async with farm(tmp, text=old, loader=lambda: load_spec(new, source="test.toml")) as f:
            await f.until(lambda: all(f.phase(w) is Phase.READY for w in (0, 1)))
            result = await f.ops.reload()
            assert not result.applied
            assert result.held is None
            assert result.problems == (
                f"{path}: line 2: unknown key(s) 'answr'; accepted: prompt, answer, id",
                f"{path}: line 2: missing key(s) answer; add them",
            )
            assert [f.runtime.starts_of(w) for w in (0, 1)] == [1, 1]

    run_virtual(scenario())
