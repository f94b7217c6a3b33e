"""The C++ kernels' build (replica/cpu_kernels.py): a build stopped midway (its process killed during a replica's first
start) must not make every later start wait forever on the lock file torch's JIT build left behind."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

from replica import cpu_kernels


def test_a_lock_file_left_by_a_stopped_build_is_cleared_and_builds_take_turns(tmp_path):
    build_dir = tmp_path / "prefixserve_cpu_0123"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # what torch's FileBaton leaves when its process dies mid-build
    with cpu_kernels.build_lock(build_dir):
        assert not (build_dir / "lock").exists()
        (build_dir / "lock").write_text("")  # a build in progress, under the lock: not touched by a waiter
        order = []

        def second_build():
            with cpu_kernels.build_lock(build_dir):
                order.append("b")

        waiter = threading.Thread(target=second_build)
        waiter.start()
        time.sleep(0.3)
        assert order == [] and (build_dir / "lock").exists()  # the second build waits for the first
        (build_dir / "lock").unlink()  # the first build finishes (torch removes its lock file)
        order.append("a")
    waiter.join(timeout=10)
    assert order == ["a", "b"]


def test_the_lock_is_taken_in_the_directory_torch_builds_in_on_copies_of_the_sources(monkeypatch, tmp_path):
    """``_build`` holds ``build_lock`` on torch's own build directory for the library's name (where its ``lock``
    file lies), not on a directory of its own, and compiles copies of the sources kept there, so that a build from
    another checkout runs the same commands (ninja rebuilds when a command, which names the source's path, changes);
    a second build leaves the copies untouched (a newer source file would rebuild too)."""
    seen = {}

    def fake_build(name, sources, **kwargs):
        from torch.utils.cpp_extension import _get_build_directory

        seen["name"], seen["dir"], seen["sources"] = name, _get_build_directory(name, verbose=False), sources
        with open(tmp_path / name / cpu_kernels.BUILD_LOCK) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["held"] = False
            except BlockingIOError:
                seen["held"] = True

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_build)
    assert cpu_kernels._build(cpu_kernels.SOURCES, "prefixserve_test") is None
    assert seen["dir"] == str(tmp_path / seen["name"]) and seen["held"]
    copies = [Path(source) for source in seen["sources"]]
    assert copies == [tmp_path / seen["name"] / "src" / source.name for source in cpu_kernels.SOURCES]
    for original in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):  # the headers the sources include, beside them
        assert (tmp_path / seen["name"] / "src" / original.name).read_bytes() == original.read_bytes()
    written = [copy.stat().st_mtime_ns for copy in copies]
    time.sleep(0.01)
    assert cpu_kernels._build(cpu_kernels.SOURCES, "prefixserve_test") is None
    assert [copy.stat().st_mtime_ns for copy in copies] == written


def test_each_environment_builds_its_own_library(monkeypatch):
    """``_build_name`` covers where torch is installed: a venv beside another with the same torch (a fresh clone's)
    would otherwise share the build directory and rebuild at every switch (each compile command names torch's
    headers). The same environment keeps its name."""
    import torch

    here = cpu_kernels._build_name(cpu_kernels.SOURCES, "prefixserve_cpu")
    assert cpu_kernels._build_name(cpu_kernels.SOURCES, "prefixserve_cpu") == here
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3/site-packages/torch/__init__.py")
    assert cpu_kernels._build_name(cpu_kernels.SOURCES, "prefixserve_cpu") != here
