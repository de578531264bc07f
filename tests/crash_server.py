"""Crash-harness children forked from one warm interpreter (a cheaper ``helpers.Worker``).

A fresh ``python tests/crash_worker.py ...`` costs about 2.5 s of CPU before its first step:
the interpreter, numpy, dsa_core and numba (1.2 s), then the kernels loaded from numba's
cache (1.2 s). :class:`CrashServer` pays that once: it starts one interpreter that imports
dsa_core and crash_worker and loads the float32 kernels (``dsa_core.warmup``; no kernel
runs in parallel there, so no thread exists when it forks), then forks a child per run that
executes ``crash_worker.py`` as ``__main__`` with the run's arguments, exactly as the
subprocess would, its stdout and stderr going to files.

Only for runs that end by SIGKILL (the worker's own ``--kill-at``, or :meth:`Job.kill`) or
after an explicit ``dsa_core.close``: a forked child leaves with ``os._exit`` after the exit
handlers (``atexit``), not through a full interpreter shutdown, so the tests of what a
normal interpreter exit does (a forgotten close) run ``helpers.Worker`` subprocesses.

The server reaps a child only when asked (:meth:`Job.wait`): until then its pid stays
taken (a zombie at worst), so :meth:`Job.kill` can never reach another process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "crash_worker.py"

SERVER = r"""
import atexit, json, os, runpy, signal, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]      # tests/ (crash_worker), the checkout (adapters)
import numpy, dsa_core, crash_worker
dsa_core.warmup(("float32",), readonly=False)  # the kernels every crash_worker mode steps with
worker = sys.argv[3]
exec(sys.argv[4])  # what the runs import beside (e.g. torch: imported once, not per run)
reply = sys.stdout
print("ready", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "wait":  # reap the child; past the timeout, kill it first
        end = time.monotonic() + cmd["timeout"]
        while True:
            pid, status = os.waitpid(cmd["pid"], os.WNOHANG)
            if pid:
                break
            if time.monotonic() > end:
                os.kill(cmd["pid"], signal.SIGKILL)
                _, status = os.waitpid(cmd["pid"], 0)
                break
            time.sleep(0.002)
        print(json.dumps({"status": status}), flush=True)
        continue
    out = os.open(cmd["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(cmd["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            if cmd["code"] is None:  # python tests/crash_worker.py ARGV
                sys.argv = [worker, *cmd["argv"]]
                runpy.run_path(worker, run_name="__main__")
            else:  # python -c CODE ARGV
                sys.argv = ["-c", *cmd["argv"]]
                exec(compile(cmd["code"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:  # as the interpreter reports it
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            try:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(out)
    os.close(err)
    print(json.dumps({"pid": pid}), flush=True)
"""


class CrashServer:
    """One warm interpreter that forks ``crash_worker.py`` runs (see the module docstring)."""

    def __init__(self, scratch: Path, preload: str = ""):
        self.scratch = Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.runs = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(TESTS), str(REPO), str(WORKER), preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self._reply() == "ready"

    def _reply(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the crash server died (rc {self.proc.wait(60)})")
        return line.strip()

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._reply())

    def start(self, *args, code: str | None = None) -> Job:
        """Fork a child running ``crash_worker.py ARGS`` (or ``python -c CODE ARGS``)."""
        self.runs += 1
        out, err = self.scratch / f"run{self.runs}.out", self.scratch / f"run{self.runs}.err"
        pid = self._ask(op="run", argv=[str(a) for a in args], code=code, out=str(out),
                        err=str(err))["pid"]
        return Job(self, pid, out, err)

    def run(self, *args, code: str | None = None,
            timeout: float = 300.0) -> tuple[int, list[list[str]], str]:
        """Like ``helpers.run_worker``: run to the end; (returncode, its lines, stderr)."""
        job = self.start(*args, code=code)
        rc, err = job.wait(timeout)
        return rc, job.lines(), err

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc.wait(60)


class Job:
    """A forked ``crash_worker.py`` run; the interface of ``helpers.Worker``."""

    def __init__(self, server: CrashServer, pid: int, out: Path, err: Path):
        self.server, self.pid, self.out, self.err = server, pid, out, err
        self.seen = 0  # complete lines already taken by expect
        self.rc: int | None = None

    def lines(self) -> list[list[str]]:
        """The complete lines printed so far (a line cut by a kill is no event)."""
        text = self.out.read_text()
        return [ln.split() for ln in text.split("\n")[:-1]]

    def expect(self, word: str, timeout: float = 120.0) -> int:
        """Wait for the next line ``word <count>``; returns the count."""
        end = time.monotonic() + timeout
        while True:
            ended = self._ended()  # before reading: a line printed just before the end counts
            got = self.lines()
            if len(got) > self.seen:
                line = got[self.seen]
                self.seen += 1
                if line[0] != word:
                    _, err = self.wait(60)
                    raise AssertionError(f"worker: expected {word!r}, got {line!r}; "
                                         f"stderr:\n{err}")
                return int(line[1])
            if ended:  # and printed no such line
                rc, err = self.wait(60)
                raise AssertionError(f"worker: expected {word!r}, it ended (rc {rc}); "
                                     f"stderr:\n{err}")
            if time.monotonic() > end:
                os.kill(self.pid, signal.SIGKILL)
                self.wait(60)
                raise AssertionError(f"worker printed nothing for {timeout} s")
            time.sleep(0.002)

    def _ended(self) -> bool:
        """Has the child exited (a zombie until the server reaps it)?"""
        if self.rc is not None:
            return True
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")

    def kill(self, sig: int = signal.SIGKILL) -> list[list[str]]:
        """SIGKILL it (or send ``sig``, whose default action ends it: SIGTERM); it must still be
        running. Returns the lines printed meanwhile."""
        os.kill(self.pid, sig)  # not reaped yet: the pid is still this child's
        rc, err = self.wait(60)
        assert rc == -sig, f"worker ended by itself (rc {rc}) before the signal:\n{err}"
        return self.lines()[self.seen:]

    def wait(self, timeout: float = 300.0) -> tuple[int, str]:
        if self.rc is None:  # the server reaps it (SIGKILL past the timeout)
            status = self.server._ask(op="wait", pid=self.pid, timeout=timeout)["status"]
            self.rc = os.waitstatus_to_exitcode(status)
        return self.rc, self.err.read_text()
