"""Shared fixtures: a real S3-compatible server (moto's standalone server) on 127.0.0.1, forked workers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.distributed import free_port
from tests.fork_server import stop_fork_server, use_forks


@pytest.fixture(scope="session", autouse=True)
def _forked_workers() -> Iterator[None]:
    """Workers of the jobs tests launch are forks of one preloaded interpreter (tests/fork_server.py)."""
    use_forks()
    try:
        yield
    finally:
        use_forks(False)
        stop_fork_server()


@pytest.fixture(scope="session", autouse=True)
def _fresh_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A home directory of the test session's own: layer profiles, hardware measurements and remembered plans
    (``~/.cache/lightning_spot``) start empty and do not leak between runs or into the user's cache."""
    saved = os.environ.get("HOME")
    os.environ["HOME"] = str(tmp_path_factory.mktemp("home"))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = saved


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start ``moto`` as a standalone HTTP server in its own process; stop it by process id."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh bucket: returns its URL and the storage_options that reach it."""
    import s3fs

    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    name = f"spot-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(name)
    return f"s3://{name}", options
