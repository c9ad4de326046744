"""A real PostgreSQL server for the tests: Debian's binaries, `initdb` and `pg_ctl` in a temporary
directory, on a free loopback port, with password (SCRAM) authentication.

PostgreSQL refuses to run as root: when the tests run as root (CI), the server's commands run as
the `postgres` user (`runuser`), in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.support.ports import free_port

USER = "diag"
PASSWORD = "pg-s3cret-Zq7"  # the tests look for it in every output: it must never appear there
DATABASE = "records"


def binaries() -> Path:
    """The directory of initdb and pg_ctl: pg_config's, else Debian's newest version."""
    found = shutil.which("pg_config")
    if found:
        bindir = subprocess.run([found, "--bindir"], capture_output=True, text=True).stdout.strip()
        if bindir and Path(bindir, "initdb").exists():
            return Path(bindir)
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if versions:
        return Path(versions[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    raise RuntimeError("PostgreSQL's server binaries are not installed (Debian: apt-get install postgresql); "
                       ".ci/run installs them")


class PostgresServer:
    """One server: start, stop (as a crash or an admin would), start again on the same port."""

    def __init__(self) -> None:
        self.bin = binaries()
        self.root = Path(tempfile.mkdtemp(prefix="llm-diag-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            os.chown(self.root, pwd.getpwnam("postgres").pw_uid, pwd.getpwnam("postgres").pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        password_file = self.root / "pw"
        password_file.write_text(PASSWORD + "\n")
        if self._as:
            os.chown(password_file, pwd.getpwnam("postgres").pw_uid, -1)
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=scram-sha-256", f"--pwfile={password_file}",
                  "-E", "UTF8", "--no-instructions")
        password_file.unlink()
        self.start()
        self.psql(f"CREATE DATABASE {DATABASE}", database="postgres")

    def _run(self, program: str, *args: str) -> str:
        done = subprocess.run([*self._as, str(self.bin / program), *args], capture_output=True, text=True,
                              cwd=self.root, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "-o",
                  f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                  f"-c max_connections=200", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def processes(self) -> list[int]:
        """The server's processes: the postmaster (its pid file's first line) and its children."""
        main = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError):
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == main:
                        children.append(int(entry.name))
        return [main, *children]

    def freeze(self) -> None:
        """Stop every process of the server (SIGSTOP): its kernel still accepts and acknowledges, nothing answers."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def url(self, password: str | None = PASSWORD, database: str = DATABASE) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def psql(self, statement: str, database: str = DATABASE) -> list[tuple[object, ...]]:
        import psycopg

        with psycopg.connect(self.url(database=database), autocommit=True) as connection:
            cursor = connection.execute(statement)
            return cursor.fetchall() if cursor.description else []

    def reset(self) -> None:
        """An empty table for the next test."""
        self.psql("DROP TABLE IF EXISTS llm_diag_records")

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
