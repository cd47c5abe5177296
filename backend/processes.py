"""Process plumbing: the interpreter a child runs, a child's end with its parent, a stub's watchdog and its end, and
what /proc says of a pid."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL for this process when the thread that started it ends (Linux PR_SET_PDEATHSIG): for a child of a
    process's main thread (launch_server's children, between fork and exec). Not for tritonserver's stubs: the thread
    that starts one ends once the model is loaded."""
    import ctypes
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def watchdog() -> subprocess.Popen:
    """A process of its own that SIGKILLs this one once its parent is gone: tritonserver's Python backend stub is
    reparented and runs on, holding its engine's memory, when tritonserver is killed, and a thread of the stub
    cannot see to that (its calls into the dead tritonserver may wait forever holding the GIL). It ends with us. In a
    session of its own: a signal to tritonserver's process group (a stop) must not end it before the stub is gone."""
    script = 'while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 1; done; kill -9 "$2" 2>/dev/null'
    return subprocess.Popen(["sh", "-c", script, "lora-llm-watchdog", str(os.getppid()), str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def exit_with_parent(period_s: float = 1.0) -> threading.Thread:
    """End this process once the process that started it is gone, from a thread that polls the parent pid: for a
    process that makes no calls that could hold the GIL forever, whose starter may be a short-lived thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def end_stub() -> None:
    """The end of a Python backend stub, as its model's finalize returns: the stub has answered the backend's finalize
    before calling it, so what is left is the interpreter's teardown (0.5-0.9 s with torch's modules loaded), while
    tritonserver counts the live models of a stop once a second: that teardown made an idle server's stop miss a
    count (3 s, not 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def python_executable() -> str:
    """This interpreter; inside tritonserver's stub (an embedded Python), the python3 on PATH (the venv's)."""
    name = os.path.basename(sys.executable or "")
    return sys.executable if name.startswith("python") else (shutil.which("python3") or "python3")


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after "pid (comm)": state, parent pid, ...; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def parent_of(pid: int) -> int:
    """Its parent's pid (0 once it is gone)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else 0
