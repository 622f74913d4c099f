"""Model staging on real files (issue 16): local source -> the workers' model path.

Everything runs on real files under tmp_path. A small tmpfs cannot be mounted without
root, so "not enough space" injects the mount's figures through `measure` (the one seam
the space check reads through); `test_mount_facts_reads_the_real_mount_of_a_real_path`
reads the real mountinfo and statvfs.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sglang_farm.config import load_spec
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.lock import lock_path, stage_lock
from sglang_farm.staging.manifest import MANIFEST_NAME, FileEntry, Manifest, parse_sha256sums
from sglang_farm.staging.plan import MountFacts, plan_stage, space_problem
from sglang_farm.staging.progress import StageProgress, describe
from sglang_farm.staging.runner import stage_model
from sglang_farm.staging.source import local_manifest
from sglang_farm.staging.space import mount_facts, parse_mountinfo
from staging_tree import AGENT_DIR, MODEL, make_source, roomy, spec_text, tree


def spec_for(
    tmp: Path, source: Path, target: Path, model_extra: str = "", headroom: str = "0"
) -> FarmSpec:
    return load_spec(spec_text(tmp, source, target, model_extra, headroom), source="test.toml")


def siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name != target.name)


# --- local source to the workers' path ----------------------------------------------------


def test_first_stage_copies_every_file_verified_and_records_the_manifest(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    seen: list[StageProgress] = []
    r = stage_model(
        spec_for(tmp_path, src, target),
        cancel=threading.Event(),
        report=seen.append,
        measure=roomy,
    )
    assert tree(target) == MODEL
    assert not r.current and r.copied_files == 4 and r.copied_bytes == sum(map(len, MODEL.values()))
    recorded = (target / MANIFEST_NAME).read_text()
    assert "model-00001-of-00002.safetensors" in recorded
    # Readable by the workers whatever the agent's umask (the unit runs it with 0077).
    # The workers' (group) and the agent's, no one else's (issue 30, item 8).
    assert oct((target / "config.json").stat().st_mode & 0o777) == "0o640"
    assert oct(target.stat().st_mode & 0o777) == "0o750"
    # Nothing is left beside the copy: no temporary, no old copy (the lock lives in
    # [farm] state_dir, a folder only root can write).
    assert siblings(target) == []
    assert seen[-1].step == "copying" and seen[-1].bytes_done == seen[-1].bytes_total > 0


def test_unchanged_restart_copies_nothing_and_leaves_the_copy_alone(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    stage_model(spec, cancel=threading.Event(), measure=roomy)
    inode = (target / "config.json").stat().st_ino
    dir_inode = target.stat().st_ino
    r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert r.current and r.copied_bytes == 0 and r.copied_files == 0
    assert target.stat().st_ino == dir_inode and (target / "config.json").stat().st_ino == inode


def test_changed_file_is_copied_again_and_the_unchanged_ones_are_linked(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    stage_model(spec, cancel=threading.Event(), measure=roomy)
    kept_inode = (target / "model-00001-of-00002.safetensors").stat().st_ino
    new = os.urandom(200_000)  # same size: only the change stamp tells
    (src / "model-00002-of-00002.safetensors").write_bytes(new)
    os.utime(src / "model-00002-of-00002.safetensors", ns=(1, 1))
    (src / "tokenizer" / "tokenizer.json").unlink()
    r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert not r.current and r.copied_files == 1 and r.copied_bytes == len(new)
    assert (target / "model-00002-of-00002.safetensors").read_bytes() == new
    assert not (target / "tokenizer" / "tokenizer.json").exists()  # gone from the source
    assert (target / "model-00001-of-00002.safetensors").stat().st_ino == kept_inode
    assert siblings(target) == []  # the old copy was removed


def test_a_staged_file_damaged_in_place_is_copied_again(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    stage_model(spec, cancel=threading.Event(), measure=roomy)
    with open(target / "config.json", "ab") as f:
        f.write(b"junk")  # e.g. an operator's hand edit
    r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert r.copied_files == 1 and tree(target) == MODEL


def test_not_enough_space_names_the_tmpfs_size_option_and_the_shortfall(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    total = sum(map(len, MODEL.values()))

    def small_tmpfs(path: Path) -> MountFacts:
        return MountFacts("/dev/shm", "tmpfs", "rw,nosuid,nodev,size=256k", 256 << 10, 256 << 10)

    with pytest.raises(StageError) as err:
        stage_model(
            spec_for(tmp_path, src, target, headroom="'1MiB'"),
            cancel=threading.Event(),
            measure=small_tmpfs,
        )
    e = err.value
    assert e.kind is StageFailureKind.NO_SPACE
    short = total + (1 << 20) - (256 << 10)
    assert f"{short / (1 << 20):.1f} MiB short" in e.message
    assert "size=256k" in e.message and "/dev/shm (tmpfs)" in e.message
    assert str(target) in e.message and "[model] headroom" in e.message
    assert "mount -o remount,size=" in e.fix
    assert not target.exists() and siblings(target) == []


def test_checksum_mismatch_fails_clearly_and_keeps_the_previous_copy(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {p}\n" for p, d in MODEL.items())
    (src / "SHA256SUMS").write_text(sums)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert r.copied_files == 5  # verified against SHA256SUMS (and SHA256SUMS itself)
    # The source file rots (same size, same mtime): SHA256SUMS no longer matches it.
    bad = src / "model-00001-of-00002.safetensors"
    st = bad.stat()
    bad.write_bytes(b"\0" * st.st_size)
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(StageError) as err:
        stage_model(spec, cancel=threading.Event(), measure=roomy)
    e = err.value
    assert e.kind is StageFailureKind.CHECKSUM_MISMATCH
    assert "model-00001-of-00002.safetensors" in e.message
    assert hashlib.sha256(MODEL["model-00001-of-00002.safetensors"]).hexdigest() in e.message
    assert hashlib.sha256(bytes(st.st_size)).hexdigest() in e.message
    assert "sha256sum" in e.fix
    # The workers' copy is the previous, verified one; no temporary is left behind.
    assert tree(target) == {**MODEL, "SHA256SUMS": sums.encode()}
    assert siblings(target) == []


def test_source_missing_and_sha256sums_errors_say_what_and_where(tmp_path: Path) -> None:
    target = tmp_path / "shm" / "model"
    with pytest.raises(StageError) as err:
        stage_model(spec_for(tmp_path, tmp_path / "nope", target), cancel=threading.Event())
    assert err.value.kind is StageFailureKind.SOURCE_MISSING
    assert str(tmp_path / "nope") in err.value.message and "does not exist" in err.value.message
    src = make_source(tmp_path / "src", {"a.bin": b"x", "SHA256SUMS": b"zz  a.bin\n"})
    with pytest.raises(StageError) as err:
        local_manifest(src)
    assert err.value.kind is StageFailureKind.BAD_SOURCE and "line 1" in err.value.message


CHILD = """
import sys, threading, time
sys.path.insert(0, {agent!r})
from pathlib import Path
from sglang_farm.config import load_spec
from sglang_farm.staging.plan import MountFacts
from sglang_farm.staging.runner import stage_model
spec = load_spec(Path({toml!r}).read_text(), source="t.toml")
said = threading.Lock()  # files are copied several at a time: one line per report
def slow(p):
    if p.step == "copying" and p.bytes_done:
        with said:
            print("COPYING", flush=True)
        time.sleep(0.2)
stage_model(spec, cancel=threading.Event(), report=slow,
            measure=lambda _p: MountFacts("/", "ext4", "rw", 1 << 40, 1 << 40))
print("DONE", flush=True)
"""


@pytest.mark.parametrize("replacement", [False, True], ids=["first", "replacement"])
def test_agent_killed_mid_copy_leaves_no_half_model_and_the_next_stage_completes(
    tmp_path: Path, replacement: bool
) -> None:
    big = {f"shard-{i}.safetensors": os.urandom(3 << 20) for i in range(4)}
    target = tmp_path / "shm" / "model"
    old_copy = {"config.json": b'{"v": "old"}', "shard-0.safetensors": os.urandom(1 << 20)}
    if replacement:  # model_path holds the previous (staged) copy
        stage_model(
            spec_for(tmp_path, make_source(tmp_path / "old", old_copy), target),
            cancel=threading.Event(),
            measure=roomy,
        )
    src = make_source(tmp_path / "src", big)
    toml = tmp_path / "farm.toml"
    spec = spec_for(tmp_path, src, target)
    toml.write_text(spec_text(tmp_path, src, target))
    # 1 MiB chunks: the child reports (and sleeps) many times per file.
    env = {**os.environ, "PYTHONPATH": AGENT_DIR}
    code = CHILD.format(agent=AGENT_DIR, toml=str(toml)).replace(
        "from sglang_farm.staging.runner import stage_model",
        "import sglang_farm.staging.copier as c; c.CHUNK = 1 << 20; c.REPORT_EVERY_S = 0\n"
        "from sglang_farm.staging.runner import stage_model",
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    try:
        for _ in range(3):  # a few chunks into the copy
            assert child.stdout.readline().strip() == "COPYING"
        temps = [p for p in target.parent.iterdir() if ".staging-" in p.name]
        assert temps, siblings(target)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
    if replacement:
        # The workers' path still holds the previous copy, whole.
        assert tree(target) == old_copy
    else:
        # The workers' path never held a partial model: it is not there at all.
        assert not target.exists()
    # The next start completes (the dead stage's lock is free, its temporary removed).
    r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert not r.current and tree(target) == big
    assert siblings(target) == []


def test_the_stage_lock_waits_for_its_holder_and_a_killed_holder_frees_it(
    tmp_path: Path,
) -> None:
    target = tmp_path / "model"
    locks = tmp_path / "state" / "staging"
    locks.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock_path(locks, target))!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d' % os.getpid())\n"
            "print('HELD', flush=True); time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "HELD"
        waited: list[str] = []
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        with (
            pytest.raises(StageError) as err,
            stage_lock(target, lock_dir=locks, cancel=cancel, on_wait=waited.append),
        ):
            pass
        assert err.value.kind is StageFailureKind.CANCELLED and waited == [str(holder.pid)]
        holder.send_signal(signal.SIGKILL)  # a crashed agent
        holder.wait(10)
        # Free at once: with `cancel` already set, any wait would raise CANCELLED.
        again: list[str] = []
        gone = threading.Event()
        gone.set()
        with stage_lock(target, lock_dir=locks, cancel=gone, on_wait=again.append):
            assert again == []
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)
        holder.stdout.close()


def test_cancel_stops_the_copy_and_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "model"
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(StageError) as err:
        stage_model(spec_for(tmp_path, src, target), cancel=cancel, measure=roomy)
    assert err.value.kind is StageFailureKind.CANCELLED
    assert not target.exists()
    assert [n for n in siblings(target) if ".staging-" in n] == []


def test_warm_reads_the_copy_on_a_disk_and_is_skipped_on_tmpfs(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "model"
    spec = spec_for(tmp_path, src, target, "warm_page_cache = true")
    seen: list[StageProgress] = []
    stage_model(spec, cancel=threading.Event(), report=seen.append, measure=roomy)
    warmed = [p for p in seen if p.step == "warming"]
    assert warmed and warmed[-1].bytes_done == sum(map(len, MODEL.values()))
    seen.clear()

    def tmpfs(path: Path) -> MountFacts:
        return MountFacts("/dev/shm", "tmpfs", "rw,size=1g", 1 << 30, 1 << 30)

    (src / "config.json").write_bytes(b"{}")
    stage_model(spec, cancel=threading.Event(), report=seen.append, measure=tmpfs)
    assert not [p for p in seen if p.step == "warming"]


def test_keep_old_leaves_the_previous_copy_beside_the_new_one(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    stage_model(spec, cancel=threading.Event(), measure=roomy)
    (src / "config.json").write_bytes(b'{"v": 2}')
    r = stage_model(spec, cancel=threading.Event(), measure=roomy, keep_old=True)
    assert r.old_copy is not None
    assert (r.old_copy / "config.json").read_bytes() == MODEL["config.json"]
    assert (target / "config.json").read_bytes() == b'{"v": 2}'


# --- the real mount table -------------------------------------------------------------------


def test_mount_facts_reads_the_real_mount_of_a_real_path(tmp_path: Path) -> None:
    facts = mount_facts(tmp_path / "not-yet" / "model")  # a target not created yet
    st = os.statvfs(tmp_path)
    assert str(tmp_path.resolve()).startswith(facts.mount_point)
    assert facts.total_bytes == st.f_blocks * st.f_frsize
    assert abs(facts.free_bytes - st.f_bavail * st.f_frsize) < 64 << 20
    assert facts.fstype and facts.fstype != "unknown"
    if os.path.ismount("/dev/shm"):
        shm = mount_facts(Path("/dev/shm"))
        assert shm.mount_point == "/dev/shm" and shm.is_tmpfs
        assert shm.size_option is None or shm.size_option.startswith("size=")


def test_parse_mountinfo_unescapes_and_keeps_superblock_options() -> None:
    line = (
        "36 25 0:32 / /mnt/my\\040models rw,nosuid shared:9 - tmpfs tmpfs rw,size=1048576k,mode=755"
    )
    assert parse_mountinfo(line) == [
        ("/mnt/my models", "tmpfs", "rw,nosuid,rw,size=1048576k,mode=755")
    ]


# --- pure: the plan, the space check, the progress line -------------------------------------


def test_plan_keeps_verified_files_copies_changed_and_drops_removed() -> None:
    a, b = FileEntry("a", 1, 10), FileEntry("b", 2, 20)
    src = Manifest("/src", (a, b))
    assert plan_stage(src, src, {"a": 1, "b": 2}).current
    p = plan_stage(src, Manifest("/src", (a, FileEntry("b", 2, 19))), {"a": 1, "b": 2, "c": 3})
    assert p.copy == (b,) and p.keep == (a,) and p.drop == ("c",) and not p.current
    # A recorded entry is trusted only while the file it describes is still there, whole.
    assert plan_stage(src, src, {"a": 1}).copy == (b,)
    assert plan_stage(src, None, {}).copy_bytes == 3


def test_space_problem_on_a_disk_says_how_much_to_free() -> None:
    disk = MountFacts("/mnt/nvme", "ext4", "rw", 10 << 30, 100 << 30)
    assert space_problem(9 << 30, 1 << 30, disk, "/mnt/nvme/m", "src") is None
    msg, fix = space_problem(10 << 30, 1 << 30, disk, "/mnt/nvme/m", "src") or ("", "")
    assert "1.0 GiB short" in msg and "/mnt/nvme (ext4)" in msg
    assert "free at least 1.0 GiB on /mnt/nvme" in fix


def test_progress_line_has_bytes_rate_and_time_left() -> None:
    p = StageProgress("copying", 1 << 30, 4 << 30, 2.0)
    assert describe(p) == "copying 1.0 GiB of 4.0 GiB (25%) at 512.0 MiB/s, about 6s left"
    assert describe(StageProgress("checking", 0, 0, 0.0)) == "checking 0 bytes of 0 bytes"


def test_sha256sums_format_is_sha256sums_own() -> None:
    d = "a" * 64
    assert parse_sha256sums(f"{d}  x/y.bin\n{d} *z.bin\n\n") == {"x/y.bin": d, "z.bin": d}


def test_the_new_copy_replaces_the_old_in_one_step(tmp_path: Path) -> None:
    """renameat2(RENAME_EXCHANGE): model_path never stops existing while a copy replaces
    it (two renames would leave a moment with no model for a worker that starts then)."""
    from sglang_farm.staging.copier import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "f").write_text("new")
    b.mkdir()
    (b / "f").write_text("old")
    assert exchange(a, b)
    assert (b / "f").read_text() == "new" and (a / "f").read_text() == "old"
    with pytest.raises(FileNotFoundError):
        exchange(tmp_path / "missing", b)


@pytest.mark.parametrize("one_step", [True, False])
def test_a_rolled_back_copy_swaps_back_with_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_step: bool
) -> None:
    """Issue 23: a rollback puts the previous copy back at model_path and the rejected one
    where the previous one waited; where RENAME_EXCHANGE is missing, by three renames,
    and a failed middle one puts the copy back at model_path."""
    from sglang_farm.staging import copier

    if not one_step:
        monkeypatch.setattr(copier, "exchange", lambda _a, _b: False)
    target, old = tmp_path / "model", tmp_path / ".model.old-x"
    target.mkdir()
    (target / "f").write_text("rejected")
    old.mkdir()
    (old / "f").write_text("previous")
    copier.swap_back(target, old)
    assert (target / "f").read_text() == "previous" and (old / "f").read_text() == "rejected"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.old-x", "model"]
    with pytest.raises(FileNotFoundError):
        copier.swap_back(target, tmp_path / "gone")
    assert (target / "f").read_text() == "previous"  # still there, whichever way
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.old-x", "model"]


def test_a_current_copy_staged_open_to_all_is_closed_up_at_the_next_stage(
    tmp_path: Path,
) -> None:
    """A copy staged before issue 30 (item 8) was 0755: unchanged, it is not copied again,
    but its folder gets the copy's mode, so no one but the workers enters it."""
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    stage_model(spec_for(tmp_path, src, target), cancel=threading.Event(), measure=roomy)
    target.chmod(0o755)
    r = stage_model(spec_for(tmp_path, src, target), cancel=threading.Event(), measure=roomy)
    assert r.current and target.stat().st_mode & 0o777 == 0o750


def test_a_stage_creates_missing_parents_0755_under_a_0077_umask(tmp_path: Path) -> None:
    # After a reboot /dev/shm/models is gone; the agent runs under UMask=0077, and the
    # workers ([farm] user) must still enter every folder above model_path.
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "models" / "Qwen"
    old = os.umask(0o077)
    try:
        stage_model(spec_for(tmp_path, src, target), cancel=threading.Event(), measure=roomy)
    finally:
        os.umask(old)
    for d in (tmp_path / "shm", tmp_path / "shm" / "models"):
        assert d.stat().st_mode & 0o777 == 0o755, d
    for d in (target, target / "tokenizer"):  # the copy: the workers' group enters it
        assert d.stat().st_mode & 0o777 == 0o750, d
    # The stage lock's folder is root's alone.
    assert (tmp_path / "state" / "staging").stat().st_mode & 0o777 == 0o700


def test_process_started_reads_a_real_process_start_as_wall_time(tmp_path: Path) -> None:
    from sglang_farm.staging.installed import installed_at, process_started

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_started(child.pid)
        assert started is not None and before - 0.5 <= started <= time.time() + 0.5
    finally:
        child.kill()
        child.wait()
    mine = process_started(os.getpid())
    assert mine is not None and mine <= before
    assert installed_at(tmp_path) is None


# --- /dev/shm is world-writable: what another local user planted is not trusted ----------

STRANGER = 54321  # a uid that is not the agent's
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def chown_tree(root: Path, uid: int) -> None:
    for dirpath, _dirs, files in os.walk(root):
        os.chown(dirpath, uid, uid)
        for name in files:
            os.chown(Path(dirpath) / name, uid, uid)


@needs_root
def test_a_copy_planted_by_another_user_is_not_trusted_as_current(tmp_path: Path) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    stage_model(spec, cancel=threading.Event(), measure=roomy)
    # Another user's folder with a matching manifest (its files could hold anything).
    (target / "config.json").write_bytes(b'{"evil": 1}'.ljust(len(MODEL["config.json"])))
    chown_tree(target, STRANGER)
    r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert not r.current and r.copied_files == 4
    assert tree(target) == MODEL
    assert target.stat().st_uid == os.geteuid()


@needs_root
def test_another_users_folder_at_model_path_that_cannot_be_moved_says_who_owns_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    target.mkdir(parents=True)
    os.chown(target, STRANGER, STRANGER)
    # What renaming it would meet in a folder the agent does not own.
    monkeypatch.setattr(os, "rename", renames_failing(lambda a, b: ".foreign-" in str(b)))
    with pytest.raises(StageError) as err:
        stage_model(spec_for(tmp_path, src, target), cancel=threading.Event(), measure=roomy)
    assert f"{target} is owned by uid {STRANGER}" in err.value.message
    assert f"rm -rf {target}" in err.value.fix
    assert target.stat().st_uid == STRANGER and not any(target.iterdir())


@needs_root
def test_a_lock_file_in_the_lock_folder_of_another_user_is_refused_clearly(
    tmp_path: Path,
) -> None:
    # The lock folder is root's 0700: a file of another user's there was put by root.
    target = tmp_path / "model"
    locks = tmp_path / "state" / "staging"
    locks.mkdir(parents=True, mode=0o700)
    lock = lock_path(locks, target)
    lock.write_text("")
    os.chown(lock, STRANGER, STRANGER)
    with (
        pytest.raises(StageError) as err,
        stage_lock(target, lock_dir=locks, cancel=threading.Event()),
    ):
        pass
    assert err.value.kind is StageFailureKind.IO_ERROR
    assert f"{lock} is owned by uid {STRANGER}" in err.value.message
    assert f"rm {lock}" in err.value.fix


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "model"
    locks = tmp_path / "state" / "staging"
    locks.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    lock_path(locks, target).symlink_to(victim)
    with (
        pytest.raises(StageError) as err,
        stage_lock(target, lock_dir=locks, cancel=threading.Event()),
    ):
        pass
    assert "symbolic link" in err.value.message
    assert victim.read_text() == "keep me\n"


# --- after the swap: the stage is done, whatever fails next ------------------------------


def staged_v1_then_v2(tmp_path: Path) -> tuple[FarmSpec, Path, dict[str, bytes]]:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    spec = spec_for(tmp_path, src, target)
    stage_model(spec, cancel=threading.Event(), measure=roomy)
    v2 = {**MODEL, "config.json": b'{"architectures": ["Qwen3ForCausalLM"], "v": 2}'}
    make_source(tmp_path / "src", v2)
    return spec, target, v2


def renames_failing(
    fails: Callable[[str | Path, str | Path], bool],
) -> Callable[[str | Path, str | Path], None]:
    """`os.rename`, but an I/O error for the renames `fails` picks."""
    real_rename = os.rename

    def rename(a: str | Path, b: str | Path) -> None:
        if fails(a, b):
            raise OSError(5, "Input/output error", str(a))
        real_rename(a, b)

    return rename


def test_a_failure_after_the_exchange_still_counts_the_stage_as_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_farm.staging import copier

    spec, target, v2 = staged_v1_then_v2(tmp_path)

    def fsync_dir(d: Path) -> None:
        if Path(d) == target.parent:
            raise OSError(5, "Input/output error", str(d))

    monkeypatch.setattr(os, "rename", renames_failing(lambda a, b: ".old-" in str(b)))
    monkeypatch.setattr(copier, "fsync_dir", fsync_dir)
    r = stage_model(spec, cancel=threading.Event(), measure=roomy, keep_old=True)
    assert not r.current and tree(target) == v2
    # The previous copy is still whole, under the name it got in the swap, to be removed.
    assert r.old_copy is not None and tree(r.old_copy) == MODEL


def test_two_renames_whose_second_fails_put_the_old_copy_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_farm.staging import copier

    spec, target, _v2 = staged_v1_then_v2(tmp_path)
    monkeypatch.setattr(copier, "exchange", lambda _a, _b: False)  # a filesystem without it
    monkeypatch.setattr(
        os, "rename", renames_failing(lambda a, b: ".staging-" in str(a) and Path(b) == target)
    )
    with pytest.raises(StageError) as err:
        stage_model(spec, cancel=threading.Event(), measure=roomy)
    assert err.value.kind is StageFailureKind.IO_ERROR
    assert tree(target) == MODEL  # the old copy is back at model_path
    assert siblings(target) == []


def test_not_enough_space_beside_an_unmanaged_copy_says_removing_it_frees_the_room(
    tmp_path: Path,
) -> None:
    src = make_source(tmp_path / "src", MODEL)
    target = tmp_path / "shm" / "model"
    # The copy the operator made by hand before [model] (no manifest): 3.0 MiB.
    make_source(target, {"model.safetensors": b"\0" * (3 << 20)})

    def full_tmpfs(path: Path) -> MountFacts:
        return MountFacts("/dev/shm", "tmpfs", "rw,size=4m", 256 << 10, 4 << 20)

    with pytest.raises(StageError) as err:
        stage_model(spec_for(tmp_path, src, target), cancel=threading.Event(), measure=full_tmpfs)
    e = err.value
    assert e.kind is StageFailureKind.NO_SPACE
    assert f"{target} already holds 3.0 MiB not staged by the farm" in e.message
    assert f"rm -rf {target}" in e.fix and "frees 3.0 MiB" in e.fix


def test_a_replacement_keeps_model_path_present_throughout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_farm.staging import copier

    spec, target, v2 = staged_v1_then_v2(tmp_path)
    swaps: list[tuple[Path, Path]] = []
    real_exchange = copier.exchange

    def recording(a: Path, b: Path) -> bool:
        swaps.append((a, b))
        return real_exchange(a, b)

    monkeypatch.setattr(copier, "exchange", recording)
    missing: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if not (target / "config.json").exists():
                missing.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = stage_model(spec, cancel=threading.Event(), measure=roomy)
    finally:
        done.set()
        watcher.join()
    assert not r.current and tree(target) == v2
    assert [b for _a, b in swaps] == [target]  # one atomic exchange, never two renames
    assert missing == []
