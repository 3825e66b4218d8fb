"""DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload): built for the nvme tests in the background while the rest
of the suite runs, or ahead of a user's first nvme run by ``python scripts/async_io_build.py`` (in the foreground,
as DeepSpeed's ``DS_BUILD_AIO=1`` pre-builds it for a pip install; without it, that run builds it first, as
DeepSpeed does).

Cold, the build is 15 C++ files that each parse torch's headers: 610 s on this shared 2-core VM, then cached in
stratbench's extensions folder (``op_builds.extensions_cache_dir``: one per venv and versions) for every later session. conftest starts it (a load, where
it is built) when the session's tests are collected, if an nvme test is among them; the nvme tests are collected last
(tests/strategies/test_deepspeed_nvme.py, conftest.LAST), so it has the rest of the suite to use what the suite leaves
idle (processes starting, ranks waiting on each other). It used to run in ``make install`` (134 s of the install's
201 s, before any test); on a fresh clone the suite leaves too little CPU idle to hide it all, and the nvme tests
waited 60-70 s for it at the end (2026-11-28).

Two things keep it out of the other tests' way and shorten it, without changing what the tests run:

- it runs at the lowest priority: nice 19 in a session of its own, whose scheduler group (Linux autogroup) is set
  to nice 19 too; otherwise that group would get an equal share of the CPU against the suite's processes;
- it compiles without debug information: a ``c++`` first on the build's PATH drops DeepSpeed's ``-g`` (at its
  ``-O0`` the code is the same; measured on one of the files, 72 s of CPU with ``-g`` and 43 s without). The
  build file still reads ``c++ ... -g``, so a run that loads the op later finds it up to date and builds
  nothing;
- that ``c++`` parses torch's headers once for the op's 12 files, not once per file: its first compile
  precompiles ``torch/extension.h`` (GCC's precompiled header, with that compile's own flags, which every file of
  the op shares; 42 s) and each compile then reads it through ``-include`` (measured on one file: 31 s, 12 s
  with it). The files include the header themselves too; its include guard makes that a no-op. Where GCC finds
  the precompiled header unusable (another compiler, other flags), it reads the header as text: slower, the
  same object. The header stays in the extensions folder (the build's dependency files name it); the
  precompiled one (~800 MB) is removed after the build. The pin_memory op DeepSpeed builds with it has other
  flags and 3 files, where precompiling would cost what it saves: it compiles as before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stratbench.strategies.op_builds import extensions_cache_dir
from stratbench.strategies.parallel.deepspeed_engine import nvme_unavailable

LOAD = (  # through stratbench's op cache: a killed build's lock is taken over, a wait on another build is bounded
    "from stratbench.strategies.op_builds import prepare_op_builds; prepare_op_builds(); "
    "from deepspeed.ops.op_builder import AsyncIOBuilder; AsyncIOBuilder().load(verbose=False)"
)
BUILD = f"""import ctypes, os, signal
try:  # interrupted when the test session dies, however it dies (PR_SET_PDEATHSIG): no build outlives it
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where a shell started us with SIGINT ignored
    ctypes.CDLL(None).prctl(1, int(signal.SIGINT), 0, 0, 0)
except (OSError, AttributeError):
    pass
try:  # the lowest weight for this session's scheduler group (Linux autogroup), where there is one
    with open("/proc/self/autogroup", "w") as f:
        f.write("19")
except OSError:
    pass
os.nice(19)
{LOAD}
"""
FAST_CXX = """#!{python} -S
# c++ without -g, torch's extension header precompiled once (scripts/async_io_build.py)
import fcntl, os, subprocess, sys
cxx, header = {cxx!r}, {header!r}
args = [a for a in sys.argv[1:] if a != "-g"]
if "-c" in args and "-DTORCH_EXTENSION_NAME=async_io" in args:
    gch = header + ".gch"
    lock = open(header + ".lock", "w")
    try:  # one compile precompiles; the others meanwhile read the header as text, as without it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
    if not lock.closed:
        if not os.path.exists(gch):
            flags, skip = [], 0
            for a in args:
                if skip or a == "-MMD":
                    skip = 0
                elif a in ("-c", "-o", "-MF"):
                    skip = 1
                else:
                    flags.append(a)
            if subprocess.run([cxx, *flags, "-x", "c++-header", header, "-o", gch + ".tmp"]).returncode == 0:
                os.replace(gch + ".tmp", gch)
        lock.close()
    if os.path.exists(gch):
        args = ["-include", header, *args]
os.execv(cxx, [cxx, *args])
"""
PCH_HEADER = "#include <torch/extension.h>\n"

_BUILD: subprocess.Popen | None = None
_STARTED = 0.0


def unavailable() -> str | None:
    """Why the op cannot be built here (no libaio, compiler or ninja), or None."""
    with tempfile.TemporaryDirectory() as probe:
        return nvme_unavailable({"offload_optimizer": {"device": "nvme", "nvme_path": probe}})


def _build_env() -> dict[str, str]:
    env = dict(
        os.environ, TORCH_EXTENSIONS_DIR=str(extensions_cache_dir()), OMP_NUM_THREADS="1", MAX_JOBS="2"
    )
    cxx = shutil.which("c++")
    if cxx and "CXX" not in os.environ:  # with CXX set, the build file names that compiler instead
        header = extensions_cache_dir() / "pch" / "torch_extension.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        if not header.is_file():
            header.write_text(PCH_HEADER)
        folder = Path(tempfile.mkdtemp(prefix="stratbench-cxx-"))
        wrapper = folder / "c++"
        wrapper.write_text(FAST_CXX.format(python=sys.executable, cxx=cxx, header=str(header)))
        wrapper.chmod(0o755)
        env["PATH"] = os.pathsep.join([str(folder), env.get("PATH", "")])
    return env


def drop_precompiled_header() -> None:
    """The precompiled header (hundreds of MB) once the op is built; its text header stays."""
    for name in ("torch_extension.h.gch", "torch_extension.h.gch.tmp"):
        (extensions_cache_dir() / "pch" / name).unlink(missing_ok=True)


def start() -> subprocess.Popen | None:
    """Start the build in the background, once per session; None where it cannot be built here."""
    global _BUILD, _STARTED
    if _BUILD is None and unavailable() is None:
        _STARTED = time.monotonic()
        _BUILD = subprocess.Popen(
            [sys.executable, "-c", BUILD], env=_build_env(), start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    return _BUILD


def wait(timeout: float = 1500) -> float:
    """Start the build if it has not been, wait for it; returns the seconds since it started."""
    build = start()
    if build is None:
        raise RuntimeError(f"the async_io op cannot be built here: {unavailable()}")
    _full_priority(build.pid)
    out, _ = build.communicate(timeout=timeout)
    drop_precompiled_header()
    assert build.returncode == 0, f"building DeepSpeed's async_io op failed:\n{out[-4000:]}"
    return time.monotonic() - _STARTED


def _full_priority(pid: int) -> None:
    """A test waits for the build now: back to nice 0 where allowed (root, or CAP_SYS_NICE), since other work on
    the machine (not this suite's) would otherwise starve it; elsewhere the suite is idle while it waits anyway."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("0")
    except OSError:
        pass
    for member in _session(pid):  # the build, ninja and the compilers running now (later ones inherit it)
        try:
            os.setpriority(os.PRIO_PROCESS, member, 0)
        except OSError:
            pass


def finish(interrupted: bool) -> None:
    """At the end of a test session (an xdist worker's): a build still running is waited for, at full priority,
    unless the session was interrupted. Under 2 workers both start the load at collection and one of them builds
    (the other waits on torch's lock): the builder's worker may run out of files while the other still needs the
    op, and interrupting the build then would make the other start it again from the beginning."""
    if _BUILD is not None and _BUILD.poll() is None and not interrupted:
        _full_priority(_BUILD.pid)
        try:
            _BUILD.wait(timeout=1500)
        except subprocess.TimeoutExpired:
            pass
        drop_precompiled_header()
    stop()


def stop() -> None:
    """At the end of the session: a build still running is interrupted (SIGINT, so that torch removes its
    build lock: a lock left behind makes every later build wait forever), then its compilers are killed."""
    if _BUILD is None or _BUILD.poll() is not None:
        return
    _BUILD.send_signal(signal.SIGINT)
    try:
        _BUILD.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for pid in _session(_BUILD.pid):  # the compilers (ninja starts each in a process group of its own)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _BUILD.wait()


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (the build was started in a session of its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def main() -> int:
    """Build the op now (``make install``), or say in one line why not; never fails the install: without the op,
    only --offload-optimizer/--offload-params nvme is refused, in one line, and the nvme tests build it."""
    reason = unavailable()
    if reason is not None:
        print(f"install: DeepSpeed's async_io op (nvme offload) not built: {reason}")
        return 0
    started = time.monotonic()
    print("install: building DeepSpeed's async_io op for nvme offload (once; minutes on 2 cores) ...", flush=True)
    proc = subprocess.run([sys.executable, "-c", LOAD], env=_build_env(), capture_output=True, text=True)
    drop_precompiled_header()
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["?"]
        print(f"install: building DeepSpeed's async_io op failed ({tail[0][:200]}); nvme offload will build it")
        return 0
    print(f"install: DeepSpeed's async_io op built in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
