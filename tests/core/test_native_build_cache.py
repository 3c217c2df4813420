"""Where the native module is built, with which compiler, under which key, and what its failures say.

``build_native`` compiles ``grammar_batch.cc`` once per environment into a cache outside the package
(``$XDG_CACHE_HOME/sglang-eagle-overlap/native``, ``~/.cache/...`` when unset): an operator clears or inspects it
there. It takes ``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` on the ``PATH``, and a new tvm-ffi version
must give a new build (the module is compiled against tvm-ffi's headers). When it cannot build or load, the
``NativeUnavailable`` it raises is what the operator reads: it must say what is missing and how to fix it.

The compilers here are stand-ins (shell scripts that write an empty output file and log their name): no test in this
file runs a real compile.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from sglang_eagle_overlap.core import native as native_module
from sglang_eagle_overlap.core.native import NativeUnavailable, build_native, default_cache_dir, load_native

COMPILERS = ("c++", "g++", "clang++")


def _fake_compiler(bindir: Path, name: str, log: Path, outputs: Optional[Path] = None,
                   argv: Optional[Path] = None) -> Path:
    """A ``name`` in ``bindir`` that logs its name to ``log`` and writes an empty file where ``-o`` points (whose
    path it appends to ``outputs``, if given); with ``argv``, it writes its arguments there, one a line."""
    bindir.mkdir(parents=True, exist_ok=True)
    path = bindir / name
    record = f'echo "$1" >> \'{outputs}\'; ' if outputs is not None else ""
    path.write_text(
        "#!/bin/sh\n"
        f"echo {name} >> '{log}'\n"
        + (f"printf '%s\\n' \"$@\" > '{argv}'\n" if argv is not None else "")
        + 'while [ $# -gt 0 ]; do\n'
        f'  if [ "$1" = "-o" ]; then shift; {record}: > "$1"; fi\n'
        "  shift\n"
        "done\n"
    )
    path.chmod(0o755)
    return path


def _calls(log: Path):
    return log.read_text().split() if log.exists() else []


def test_the_cache_is_under_xdg_cache_home_when_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "xdg" / "sglang-eagle-overlap" / "native"


@pytest.mark.parametrize("xdg", [None, ""])
def test_the_cache_is_under_the_home_directory_without_xdg_cache_home(tmp_path, monkeypatch, xdg):
    """Unset or empty, ``XDG_CACHE_HOME`` means ``~/.cache`` (the XDG base directory rule)."""
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "sglang-eagle-overlap" / "native"


def test_a_build_without_a_cache_dir_goes_to_the_default_cache(tmp_path, monkeypatch):
    log = tmp_path / "log"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", log)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    built = build_native()
    assert built.parent == tmp_path / "xdg" / "sglang-eagle-overlap" / "native" and built.exists()


@pytest.mark.parametrize("present", [("c++",), ("g++",), ("clang++",), ("g++", "clang++"), COMPILERS])
def test_without_cxx_the_first_compiler_on_the_path_builds(tmp_path, monkeypatch, present):
    """No ``CXX``: ``c++`` (the system's default), then ``g++``, then ``clang++``, whichever the ``PATH`` has first in
    that order of preference."""
    log = tmp_path / "log"
    for name in present:
        _fake_compiler(tmp_path / "bin", name, log)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    built = build_native(tmp_path / "cache")
    assert built.exists() and built.parent == tmp_path / "cache"
    assert _calls(log) == [present[0]]


def test_without_any_compiler_the_error_says_how_to_get_one(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(NativeUnavailable) as err:
        build_native(tmp_path / "cache")
    text = str(err.value)
    assert "compiler" in text and "CXX" in text and "g++" in text  # the variable to set, the package to install
    assert not (tmp_path / "cache").exists()  # refused before anything is written


def test_a_new_tvm_ffi_version_is_a_new_build_and_the_same_one_is_reused(tmp_path, monkeypatch):
    """The module is compiled against tvm-ffi's headers and linked to its library: a library built for another
    tvm-ffi version must not be loaded, so the version is part of the cache key."""
    import tvm_ffi

    log = tmp_path / "log"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", log)))
    cache = tmp_path / "cache"
    monkeypatch.setattr(tvm_ffi, "__version__", "0.1.test-a", raising=False)
    a = build_native(cache)
    monkeypatch.setattr(tvm_ffi, "__version__", "0.1.test-b", raising=False)
    b = build_native(cache)
    assert a != b and a.exists() and b.exists()
    assert _calls(log) == ["cxx", "cxx"]
    monkeypatch.setattr(tvm_ffi, "__version__", "0.1.test-a", raising=False)
    assert build_native(cache) == a
    assert _calls(log) == ["cxx", "cxx"]  # the same key again: reused, not compiled


def test_a_tvm_ffi_without_a_version_still_builds_once(tmp_path, monkeypatch):
    """A tvm-ffi that reports no ``__version__`` (a development build) still gets a cached build: its key is made
    without the version, and a second call reuses it."""
    import tvm_ffi

    log = tmp_path / "log"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", log)))
    monkeypatch.delattr(tvm_ffi, "__version__", raising=False)
    built = build_native(tmp_path / "cache")
    assert built.exists() and build_native(tmp_path / "cache") == built and _calls(log) == ["cxx"]


def test_another_compiler_of_the_same_name_is_another_build(tmp_path, monkeypatch):
    """The key holds the compiler's resolved path, not its name: ``g++`` from another ``PATH`` (another toolchain,
    another C++ runtime) must not reuse a library the first one built."""
    log = tmp_path / "log"
    _fake_compiler(tmp_path / "bin1", "g++", log)
    _fake_compiler(tmp_path / "bin2", "g++", log)
    monkeypatch.delenv("CXX", raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PATH", str(tmp_path / "bin1"))
    first = build_native(cache)
    monkeypatch.setenv("PATH", str(tmp_path / "bin2"))
    second = build_native(cache)
    assert first != second and first.exists() and second.exists() and _calls(log) == ["g++", "g++"]
    monkeypatch.setenv("PATH", str(tmp_path / "bin1"))
    assert build_native(cache) == first and _calls(log) == ["g++", "g++"]


def test_the_compiler_writes_a_temporary_file_in_the_cache_that_is_renamed_into_place(tmp_path, monkeypatch):
    """Builds may race (several workers of one host start together): each compiles into its own file in the cache
    directory itself -- a rename into place is atomic only within one file system -- and a reader never sees a
    partly written library under the final name."""
    log, outputs = tmp_path / "log", tmp_path / "outputs"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", log, outputs)))
    cache = tmp_path / "cache"
    built = build_native(cache)
    (written,) = outputs.read_text().split()
    assert Path(written).parent == cache and Path(written) != built
    assert not Path(written).exists() and sorted(p.name for p in cache.iterdir()) == [built.name]


def test_a_failed_compile_shows_the_command_and_the_compilers_last_lines_as_written(tmp_path, monkeypatch):
    """The error is what an operator debugs a broken toolchain from: the command line, and the compiler's own
    messages line by line (text, not a bytes repr); from a very long output only its end, where a compiler's summary
    is."""
    bad = tmp_path / "cxx"
    bad.write_text("#!/bin/sh\n"
                   "echo 'FIRST LINE OF A LONG OUTPUT' >&2\n"
                   "i=0; while [ $i -lt 400 ]; do echo 'warning: something quite long was noted here' >&2; "
                   "i=$((i+1)); done\n"
                   "printf 'error: first problem\\nerror: second problem\\n' >&2\n"
                   "exit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    with pytest.raises(NativeUnavailable) as err:
        build_native(tmp_path / "cache")
    text = str(err.value)
    assert str(bad) in text and "grammar_batch.cc" in text and "-shared" in text
    assert "error: first problem\nerror: second problem" in text
    assert "FIRST LINE OF A LONG OUTPUT" not in text and len(text) < 6000


def test_a_failed_compile_shows_its_command_line_as_run_ready_to_rerun_by_hand(tmp_path, monkeypatch):
    """The command in the error is the compiler's own argument list as one shell line: pasted into a shell, it runs
    the very compile that failed, word for word."""
    argv = tmp_path / "argv"
    bad = tmp_path / "cxx"
    bad.write_text("#!/bin/sh\n"
                   f"printf '%s\\n' \"$@\" > '{argv}'\n"
                   "echo 'error: no such header' >&2\n"
                   "exit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    with pytest.raises(NativeUnavailable) as err:
        build_native(tmp_path / "cache")
    shown = re.search(r"failed \((.*)\):\n", str(err.value))
    assert shown is not None
    assert shlex.split(shown.group(1)) == [str(bad), *argv.read_text().splitlines()]


def test_the_module_is_linked_to_the_installed_tvm_ffi_library_and_finds_it_at_load(tmp_path, monkeypatch):
    """The module calls into ``libtvm_ffi``: the compiler is told to link the very library tvm-ffi reports (a
    library named with ``-l`` and found in a ``-L`` directory), and the module records that directory as its run
    path, so that loading it needs no ``LD_LIBRARY_PATH``."""
    from tvm_ffi import libinfo

    argv = tmp_path / "argv"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", tmp_path / "log", argv=argv)))
    build_native(tmp_path / "cache")
    args = argv.read_text().splitlines()
    lib = Path(libinfo.find_libtvm_ffi()).resolve()
    search = [Path(a[2:]) for a in args if a.startswith("-L")]
    linked = [(d / f"lib{a[2:]}.so").resolve() for a in args if a.startswith("-l") for d in search]
    run_paths = [Path(p).resolve() for a in args if a.startswith("-Wl,-rpath,") for p in a[11:].split(":")]
    assert lib in linked
    assert lib.parent in run_paths


def test_a_build_is_logged_with_its_file_and_compile_time_and_a_reuse_is_not(tmp_path, monkeypatch, caplog):
    """One info line per compile, in the package's log style (``sglang-eagle-overlap: `` first): the library's path
    and the seconds the compiler took, read from a stand-in clock (2.5 s between the compiler's start and its end).
    A build found in the cache compiles nothing and logs nothing."""
    ticks = [50.0, 52.5]
    monkeypatch.setattr(native_module, "time", SimpleNamespace(perf_counter=lambda: ticks.pop(0)))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", tmp_path / "log")))
    caplog.set_level(logging.INFO, logger=native_module.__name__)
    built = build_native(tmp_path / "cache")
    (line,) = [r.getMessage() for r in caplog.records if r.name == native_module.__name__]
    assert line.startswith("sglang-eagle-overlap: ") and str(built) in line
    took = re.search(r" in ([0-9.]+) s$", line)
    assert took is not None and float(took.group(1)) == 2.5
    caplog.clear()
    assert build_native(tmp_path / "cache") == built
    assert [r for r in caplog.records if r.name == native_module.__name__] == []


def test_without_tvm_ffi_the_error_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # ``import tvm_ffi`` raises ImportError
    with pytest.raises(NativeUnavailable, match="tvm-ffi is not importable"):
        build_native(tmp_path)


def test_a_library_that_does_not_load_is_named_with_the_loaders_error(tmp_path, monkeypatch):
    """The stand-in compiler's empty file is no shared library: the loader's error, with its type, and the file's
    path are what an operator needs to tell a broken cache from a broken toolchain."""
    log = tmp_path / "log"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path / "bin", "cxx", log)))
    with pytest.raises(NativeUnavailable) as err:
        load_native(tmp_path / "cache")
    cause = err.value.__cause__
    assert cause is not None and not isinstance(cause, NativeUnavailable)
    text = str(err.value)
    (built,) = (tmp_path / "cache").glob("*.so")
    assert str(built) in text and type(cause).__name__ in text and str(cause) in text

