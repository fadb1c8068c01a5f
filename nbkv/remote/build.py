"""Build llama-server from the llama.cpp inside llama-cpp-python: ``python -m nbkv.remote.build``.

The installed llama-cpp-python's source distribution carries the very llama.cpp it was built
from. Its ``llama-server`` is built from there (static, no web UI, no OpenSSL), so the server
computes what the in-kernel engine does, and installed as
``<sys.prefix>/llama-server-<version>/llama-server``, where :func:`nbkv.remote.server.binary`
looks: no environment variable needed (Binder's ``postBuild`` and ``make llama-server`` run
this). A second run finds the binary there and does nothing.

Needs a C++ compiler, ``cmake`` (installed from PyPI into this environment when missing) and
PyPI (the sdist). It takes minutes; progress is shown as it goes (the compile's own
percentage).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from nbkv.core.errors import ServerError
from nbkv.core.progress import PlainLines, Reporter, Task, default_reporter

WHAT = "building llama-server from llama.cpp's sources"
WHY = "once per llama-cpp-python version, a few minutes"
CMAKE_FLAGS = ("-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF")
_PERCENT = re.compile(rb"^\[\s*(\d+)%\]")  # make: "[ 45%] Building CXX object ..."
_COUNT = re.compile(rb"^\[(\d+)/(\d+)\]")  # ninja: "[12/130] Building CXX object ..."


def version() -> str:
    """The installed llama-cpp-python's version (the llama.cpp to build)."""
    return importlib.metadata.version("llama-cpp-python")


def target(prefix: str | os.PathLike | None = None) -> Path:
    """Where the binary goes: ``<prefix or sys.prefix>/llama-server-<version>/llama-server``."""
    return Path(prefix or sys.prefix) / f"llama-server-{version()}" / "llama-server"


def build(prefix: str | os.PathLike | None = None, *, jobs: int | None = None,
          progress: Reporter | None = None) -> Path:
    """Build llama-server into :func:`target` unless it is there; returns its path.

    ``jobs``: parallel compiles (default ``$NBKV_BUILD_JOBS``, else the CPUs this process
    may use). Raises :class:`~nbkv.core.errors.ServerError` with the log's end on failure.
    """
    out = target(prefix)
    if out.is_file() and os.access(out, os.X_OK):
        return out
    from nbkv.llama.cpus import cpu_budget

    jobs = jobs or int(os.environ.get("NBKV_BUILD_JOBS") or cpu_budget().threads)
    ver = version()
    with tempfile.TemporaryDirectory(prefix="nbkv-llama-server-") as tmp, \
            Task(progress or default_reporter(), WHAT, WHY, total=100, unit="%",
                 tick=1.0) as task:
        work = Path(tmp)
        log = work / "build.log"
        task.update(0, what=f"{WHAT}, downloading llama-cpp-python {ver}")
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
              "--no-deps", "-d", str(work), f"llama-cpp-python=={ver}"], log)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
        if sdist is None:
            raise ServerError(f"pip downloaded no llama-cpp-python {ver} sdist into {work}")
        with tarfile.open(sdist) as tar:
            try:
                tar.extractall(work, filter="data")
            except TypeError:  # Python < 3.10.12: no extraction filters
                tar.extractall(work)
        src = work / f"llama_cpp_python-{ver}" / "vendor" / "llama.cpp"
        task.update(2, what=f"{WHAT}, configuring")
        cmake = _cmake(log)
        _run([cmake, "-S", str(src), "-B", str(work / "build"), *CMAKE_FLAGS], log)
        task.update(5, what=f"{WHAT}, compiling with {jobs} jobs")
        _run([cmake, "--build", str(work / "build"), "-t", "llama-server", f"-j{jobs}"], log,
             lambda pct: task.update(5 + 0.95 * pct))
        built = work / "build" / "bin" / "llama-server"
        staged = out.parent.with_name(out.parent.name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
        shutil.copy2(built, staged / "llama-server")
        shutil.rmtree(out.parent, ignore_errors=True)
        staged.rename(out.parent)
        task.update(100)
    return out


def _cmake(log: Path) -> str:
    """``cmake`` on PATH, else the one PyPI's ``cmake`` package installs here."""
    found = shutil.which("cmake")
    if found:
        return found
    _run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], log)
    here = Path(sys.executable).with_name("cmake")
    return str(here) if here.is_file() else shutil.which("cmake") or "cmake"


def _run(argv: list[str], log: Path, on_percent: Callable[[float], object] | None = None
         ) -> None:
    """Run ``argv``, its output appended to ``log``; percentages of a build go to a callback."""
    with log.open("ab") as f:
        f.write(b"$ " + " ".join(argv).encode() + b"\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if on_percent is not None:
                m = _PERCENT.match(line)
                if m:
                    on_percent(int(m.group(1)))
                elif (m := _COUNT.match(line)) is not None and int(m.group(2)):
                    on_percent(100 * int(m.group(1)) / int(m.group(2)))
        rc = proc.wait()
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise ServerError(f"{Path(argv[0]).name} failed (exit {rc}) while {WHAT}:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    """``python -m nbkv.remote.build [--prefix DIR] [--jobs N]``: build, print the path."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m nbkv.remote.build",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--prefix", default=None, help="install under DIR (default: sys.prefix)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles")
    args = ap.parse_args(argv)
    out = target(args.prefix)
    if out.is_file():
        print(f"{out} (already built)")
        return 0
    try:
        reporter = default_reporter() if sys.stderr.isatty() else PlainLines(sys.stderr)
        print(build(args.prefix, jobs=args.jobs, progress=reporter))
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. sys.prefix is not writable
        print(f"error: {e} (choose another place with --prefix DIR, then set "
              f"$NBKV_LLAMA_SERVER to DIR/llama-server-{version()}/llama-server)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
