"""Regenerate README.md's example blocks from the commands they show (`make docs`).

An example block is a command between markers; everything between them is rewritten
with what the command prints today::

    <!-- mkgen-example: mkgen list -->
    ```
    $ mkgen list
    ...its output...
    ```
    <!-- /mkgen-example -->

Each command runs as a user types it, in bash (`-o pipefail`), with `mkgen` this
checkout's mkgen and `python` the Python running this script (shims first on PATH), in
an empty temporary directory that stands for the checkout's root: it holds only a link
to the checkout's examples/. So an example that writes files (`mkgen build ... -o DIR`)
leaves nothing behind and finds nothing there before it.

A session's examples (`<!-- mkgen-example NAME: COMMAND -->`, NAME the session) run in
order in one such directory, so each sees the files the earlier ones wrote (the CPU
walkthrough: build, convert, run, serve). In a session:

- `mkgen serve ... &` starts the server in the background, as a shell's job: the
  generator takes a lock while it runs (concurrent runs of this script wait for each
  other), refuses a port something else listens on, and waits until GET /health
  answers; the block shows what the server printed by then.
- `kill %N` stops the session's N-th job with SIGTERM and shows what it printed since.
  A session that ends with a job still running is an error (the README must stop it).

The output is the command's stdout (a background server's: its stdout and stderr), with
what differs from run to run masked (MASKS): seconds, a response's id and timestamp.

`python scripts/make_docs.py` rewrites README.md; `--check` only says whether it is
current (exit 1 if not). tests/test_docs.py holds the README to the code the same way.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(
    r"(?P<open><!-- mkgen-example(?: (?P<session>[\w-]+))?: (?P<command>.+?) -->\n)"
    r"(?P<body>.*?)(?P<close><!-- /mkgen-example -->)",
    re.DOTALL,
)
# What differs from run to run, and how the README shows it.
MASKS = [
    # Wall-clock seconds: a build's or a conversion's ("in 1.3 s:"), a run's ("set-up
    # and prefill 0.7 s; 1 kernel call(s) in 9.4 s").
    (re.compile(r"\b(in|prefill) \d+(\.\d+)? s\b"), r"\1 ... s"),
    # An API response's id ("cmpl-3f2a...", "chatcmpl-...") and creation time.
    (re.compile(r'("id": ?"[a-z]+-)[0-9a-f]+"'), r'\1..."'),
    (re.compile(r'("created": ?)\d+'), r"\1..."),
]
COMMAND_S = 600  # one example command
READY_S = 300  # a background server: load the weights until /health answers
STOP_S = 60  # a background server's SIGTERM: in-flight requests finish (30 s), then exit
SERVE_PORT = 8000  # `mkgen serve`'s default --port


def mask(text: str) -> str:
    """`text` with what differs from run to run shown as `...` (MASKS)."""
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def _failed(command: str, output: str) -> RuntimeError:
    return RuntimeError(f"example {command!r} failed: {output.strip()[-2000:]}")


@dataclass
class Job:
    """A background `mkgen serve` of a session (`... &`), holding the server lock."""

    command: str
    process: subprocess.Popen
    log: Path
    lock: IO[str]
    shown: int = 0  # characters of the log already shown

    def new_output(self) -> str:
        text = self.log.read_text(errors="replace")
        new, self.shown = text[self.shown :], len(text)
        return new

    def stop(self) -> None:
        """SIGTERM (as `kill %N`), then wait for it to exit; killed if it does not."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.lock.close()


def _serve_address(command: str) -> tuple[str, int]:
    """The host and port a background `mkgen serve` command listens on."""
    words = shlex.split(command)
    if words[:2] != ["mkgen", "serve"]:
        raise ValueError(f"example {command!r}: only `mkgen serve ... &` runs in the background")
    options = {"--host": "127.0.0.1", "--port": str(SERVE_PORT)}
    for word, following in zip(words, [*words[1:], ""], strict=True):
        name, equals, value = word.partition("=")
        if name in options:
            options[name] = value if equals else following
    return options["--host"], int(options["--port"])


def _server_lock() -> IO[str]:
    """An exclusive lock among this script's runs on this machine while one of them has a
    server running (a test run and `make docs` in another checkout would take one port)."""
    lock = open(Path(tempfile.gettempdir()) / "mkgen-docs-server.lock", "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def _check_free(host: str, port: int) -> None:
    """An error if something listens on host:port. The probe binds as the server does, with
    SO_REUSEADDR, so the closed connections of a run a minute before (TIME_WAIT) do not
    read as taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise RuntimeError(
                f"{host}:{port} is taken ({error.strerror}): the README's server example "
                "listens there; stop what listens on it and run again"
            ) from None


def _wait_ready(job: Job, host: str, port: int) -> None:
    """Until the server answers GET /health with 200; an error if it exits first."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if job.process.poll() is not None:
            raise _failed(job.command, job.log.read_text(errors="replace"))
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise _failed(job.command, f"no answer on /health in {READY_S} s")


@dataclass
class Session:
    """Examples run in order in one directory standing for the checkout's root."""

    cwd: Path
    private: Path  # the jobs' logs
    env: dict[str, str]
    jobs: list[Job] = field(default_factory=list)

    def run(self, command: str) -> str:
        """What `command` prints, run here as a user runs it (masked)."""
        if re.search(r"(?<!&)&\s*$", command):
            return mask(self._start(command.rstrip().removesuffix("&").rstrip()))
        killed = re.fullmatch(r"kill %(\d+)", command)
        if killed:
            return mask(self._kill(int(killed.group(1))))
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            capture_output=True, text=True, cwd=self.cwd, env=self.env, timeout=COMMAND_S,
        )  # fmt: skip
        if result.returncode != 0:
            raise _failed(command, result.stderr or result.stdout)
        return mask(result.stdout)

    def _start(self, command: str) -> str:
        host, port = _serve_address(command)
        lock = _server_lock()
        try:
            _check_free(host, port)
        except RuntimeError:
            lock.close()
            raise
        log = self.private / f"job-{len(self.jobs) + 1}.log"
        with log.open("w") as sink:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],
                stdout=sink, stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env,
            )  # fmt: skip
        job = Job(command, process, log, lock)
        self.jobs.append(job)
        _wait_ready(job, host, port)
        return job.new_output()

    def _kill(self, number: int) -> str:
        if not 1 <= number <= len(self.jobs) or self.jobs[number - 1].process.poll() is not None:
            raise RuntimeError(f"example 'kill %{number}': no such job running")
        job = self.jobs[number - 1]
        job.stop()
        return job.new_output()

    def stop_all(self) -> None:
        for job in self.jobs:
            job.stop()


class Examples:
    """Runs a README's examples: each in a fresh directory, a session's in its own."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._sessions: dict[str, Session] = {}
        shims = self._directory("mkgen-docs-bin-")
        python = shlex.quote(sys.executable)
        for name, target in (("mkgen", f"{python} -m mkgen.cli"), ("python", python)):
            (shims / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
            (shims / name).chmod(0o755)
        # The examples' processes share compiled programs (the runs' kernel, the server's),
        # as a test run's processes do in the cache tests/conftest.py sets up.
        cache = {}
        if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
            cache["JAX_COMPILATION_CACHE_DIR"] = str(self._directory("mkgen-docs-jax-cache-"))
            cache["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        self._env = {
            **os.environ,
            **cache,
            "PATH": os.pathsep.join((str(shims), os.environ.get("PATH", ""))),
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
            "JAX_PLATFORMS": "cpu",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def _directory(self, prefix: str) -> Path:
        return Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))

    def session(self, name: str | None) -> Session:
        """The session `name` (made on first use); None: a new one of its own."""
        if name in self._sessions:
            return self._sessions[name]
        cwd = self._directory("mkgen-docs-")
        (cwd / "examples").symlink_to(REPO / "examples", target_is_directory=True)
        session = Session(cwd, self._directory("mkgen-docs-jobs-"), self._env)
        self._stack.callback(session.stop_all)
        if name is not None:
            self._sessions[name] = session
        return session

    def run(self, command: str, session: str | None) -> str:
        """`command`'s masked output, in `session` (None: a session of its own)."""
        running = self.session(session)
        output = running.run(command)
        if session is None:
            self._check_stopped(running, command)
        return output

    def check_all_stopped(self) -> None:
        for name, session in self._sessions.items():
            self._check_stopped(session, name)

    @staticmethod
    def _check_stopped(session: Session, name: str) -> None:
        for number, job in enumerate(session.jobs, 1):
            if job.process.poll() is None:
                raise RuntimeError(
                    f"example session {name!r} ends with job %{number} ({job.command!r}) "
                    f"running: add an example `kill %{number}` after its last use"
                )


def render(readme: str) -> str:
    """`readme` with every example block holding its command's current output."""
    with ExitStack() as stack:
        examples = Examples(stack)

        def block(match: re.Match[str]) -> str:
            command = match["command"].strip()
            output = examples.run(command, match["session"]).rstrip("\n")
            shown = f"$ {command}\n{output}".rstrip("\n")
            return f"{match['open']}```\n{shown}\n```\n{match['close']}"

        fresh = BLOCK.sub(block, readme)
        examples.check_all_stopped()
    return fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if README.md is stale.")
    args = parser.parse_args()
    current = README.read_text()
    fresh = render(current)
    if args.check:
        sys.exit(0 if fresh == current else 1)
    if fresh != current:
        README.write_text(fresh)
        print(f"rewrote {README.relative_to(REPO)}")
    else:
        print(f"{README.relative_to(REPO)} is up to date")


if __name__ == "__main__":
    main()
