"""The benchmark measures from outside the measured process: opens from real system
calls, memory over the whole process tree while its workers live."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from packio.bench.probe import MARKER, Probe, count_opens, strace_prefix, wait_and_probe

# Opens 'data.bin' twice before the marker (not counted), three times after it in the
# parent and twice in a forked child that also holds 160 MB for a second.
CHILD = textwrap.dedent("""
    import os, sys, time
    root = sys.argv[1]
    for _ in range(2):
        open(os.path.join(root, "data.bin"), "rb").close()
    try:
        open({marker!r}, "rb")
    except OSError:
        pass
    for _ in range(3):
        open(os.path.join(root, "data.bin"), "rb").close()
    pid = os.fork()
    if pid == 0:
        block = bytearray(160 << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, private
        f = open(os.path.join(root, "data.bin"), "rb")
        g = open(os.path.join(root, "data.bin"), "rb")
        time.sleep(1.0)
        os._exit(0)
    os.waitpid(pid, 0)
    print("done")
""").format(marker=MARKER)


def _run(tmp_path: Path, prefix: list[str]) -> tuple[Probe, str]:
    (tmp_path / "data.bin").write_bytes(b"x" * 10)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([*prefix, sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    probe = Probe(proc.pid, str(tmp_path), sample_fds=not prefix, interval=0.02)
    out, err = wait_and_probe(proc, probe, timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "done"
    return probe, out


def test_strace_counts_opens_after_marker_and_tree_memory(tmp_path):
    log = tmp_path.parent / f"{tmp_path.name}-strace.log"
    prefix = strace_prefix(log)
    if prefix is None:
        pytest.skip("strace is missing or cannot trace here")
    probe, _ = _run(tmp_path, prefix)
    assert count_opens(log, str(tmp_path)) == 5  # 3 in the parent + 2 in the forked child
    assert count_opens(log, str(tmp_path / "elsewhere")) == 0
    assert probe.peak_mb >= 160  # the forked child's memory, seen while it lived


def test_fd_sampling_fallback_sees_the_child_files(tmp_path):
    probe, _ = _run(tmp_path, [])
    assert probe.opens_method.startswith("/proc/PID/fd")
    assert probe.fds_seen >= 2  # the two files the forked child holds open for a second
    assert probe.peak_mb >= 160


def test_count_opens_parses_split_failed_and_escaped_calls(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("\n".join([
        '10 openat(AT_FDCWD, "/d/a", O_RDONLY) = 3',  # before the marker: not counted
        f'10 openat(AT_FDCWD, "{MARKER}", O_RDONLY) = -1 ENOENT (No such file or directory)',
        '10 openat(AT_FDCWD, "/d/a", O_RDONLY|O_CLOEXEC) = 4',
        '11 openat(AT_FDCWD, "/d/b", O_RDONLY <unfinished ...>',
        '10 openat(AT_FDCWD, "/d/c", O_RDONLY) = -1 ENOENT (No such file or directory)',  # failed
        '11 <... openat resumed>) = 5',
        '12 open("/d/caf\\303\\251", O_RDONLY) = 6',  # strace's octal escapes, UTF-8 name
        '12 openat(AT_FDCWD, "/dx/a", O_RDONLY) = 7',  # a sibling folder sharing the prefix
        '13 openat(AT_FDCWD, "/d/e", O_RDONLY <unfinished ...>',
        '13 <... openat resumed>) = -1 EACCES (Permission denied)',
    ]) + "\n")
    assert count_opens(log, "/d") == 3
    assert count_opens(log, "/d/café") == 1
