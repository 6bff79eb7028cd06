"""Checkpoint storage on any fsspec URL: retries with backoff, atomic commits, clear errors.

store = Storage("s3://bucket/runs/gpt", {"endpoint_url": "http://127.0.0.1:5000"})
store.check_access()                       # fails now, before training, if the bucket is wrong
store.write_json("step-000000200/manifest.json", manifest)   # one object: committed or absent
store.committed()                          # ["step-000000100", "step-000000200"], oldest first
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from lightning_spot.checkpoint.checksum import digest, verify

log = logging.getLogger(__name__)
T = TypeVar("T")

MANIFEST = "manifest.json"
STEP_PREFIX = "step-"

_PERMANENT = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError, ValueError)
_TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "FSTimeoutError",
    "IncompleteRead",
}
_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EPIPE,
    errno.EHOSTUNREACH,
}


def dumps_by_line(obj: Any) -> str:
    """JSON with each top-level key of an object on a line of its own and the values compact: readable
    enough, and written by the C encoder (``indent`` falls back to pure Python: a manifest then costs
    milliseconds of CPU time under the GIL, next to training)."""
    if not isinstance(obj, dict) or not obj:
        return json.dumps(obj, sort_keys=True) + "\n"
    items = (f"{json.dumps(str(k))}: {json.dumps(obj[k], sort_keys=True)}" for k in sorted(obj))
    return "{\n" + ",\n".join(items) + "\n}\n"


class StorageError(RuntimeError):
    """Checkpoint storage cannot be used; the message says why and what to change."""


def is_transient(err: BaseException) -> bool:
    """Whether retrying ``err`` may help (network hiccups, throttling), as opposed to a wrong URL or credentials."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _PERMANENT):
            return False
        if isinstance(current, (ConnectionError, TimeoutError)) or type(current).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(current, OSError) and current.errno in _TRANSIENT_ERRNOS:
            return True
        text = str(current)
        if any(s in text for s in ("SlowDown", "Throttl", "RequestTimeout", "ServiceUnavailable", "InternalError")):
            return True
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict) and failures:
            inner = [f[0] if isinstance(f, tuple) else getattr(f, "exception", f) for f in failures.values()]
            return all(isinstance(e, BaseException) and is_transient(e) for e in inner)
        current = current.__cause__ or current.__context__
    return False


def retry(fn: Callable[[], T], what: str, *, attempts: int = 4, base_delay: float = 0.5) -> T:
    """Call ``fn``; on transient errors retry with exponential backoff, then raise :class:`StorageError`."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except BaseException as err:  # torch's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)) or not is_transient(err):
                raise
            if attempt == attempts:
                raise StorageError(f"{what} failed {attempts} times; the last error was: {err!r}") from err
            delay = base_delay * 2 ** (attempt - 1)
            log.warning("%s failed (%r); retrying in %.1fs (%d/%d)", what, err, delay, attempt, attempts - 1)
            time.sleep(delay)
    raise AssertionError("unreachable")


def join(*parts: str) -> str:
    """``parts`` joined by ``/``, skipping empty ones (``join("", "manifest.json") == "manifest.json"``)."""
    return "/".join(p for p in parts if p)


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


def step_of(dirname: str) -> int:
    return int(dirname.rsplit("/", 1)[-1][len(STEP_PREFIX) :])


class Storage:
    """A run directory (``url``) on any fsspec filesystem."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.options = dict(storage_options or {})
        try:
            self.fs, self.root = url_to_fs(self.url, **self.options)
        except (ImportError, ValueError) as err:
            raise StorageError(f"cannot open checkpoint location {self.url!r}: {err}") from err
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def url_of(self, *parts: str) -> str:
        """The URL of ``parts`` under the run directory (empty parts are skipped: ``url_of("")`` is the run)."""
        return join(self.url, *parts)

    def path_of(self, *parts: str) -> str:
        """The filesystem path of ``parts`` under the run directory (empty parts are skipped)."""
        return join(self.root.rstrip("/"), *parts)

    def _fresh(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception:
            pass

    # ------------------------------------------------------------------ checks
    def check_access(self) -> None:
        """Create the run directory and round-trip a small object; explain any failure."""
        self._probe_endpoint()
        probe = self.path_of(f".spot-probe-{uuid.uuid4().hex}")
        try:
            if self.is_local:
                retry(lambda: self.fs.makedirs(self.root, exist_ok=True), f"creating {self.url}", attempts=3)
            else:  # never create buckets implicitly (s3fs's makedirs would)
                bucket = self.root.split("/", 1)[0]
                if not retry(lambda: self.fs.exists(bucket), f"looking up {bucket}", attempts=3):
                    raise FileNotFoundError(f"bucket {bucket!r} not found")
            retry(lambda: self.fs.pipe_file(probe, b"ok"), f"writing to {self.url}", attempts=3)
            got = retry(lambda: self.fs.cat_file(probe), f"reading from {self.url}", attempts=3)
            retry(lambda: self.fs.rm_file(probe), f"deleting from {self.url}", attempts=3)
        except StorageError as err:
            raise StorageError(
                f"Cannot reach checkpoint storage {self.url!r}: {err}. Check the endpoint and network "
                f"(storage_options={_redact(self.options)})."
            ) from err
        except PermissionError as err:
            raise StorageError(
                f"Access to checkpoint storage {self.url!r} was denied ({err}). Check the credentials "
                f"(storage_options key/secret, AWS_PROFILE, instance role) and the bucket policy."
            ) from err
        except FileNotFoundError as err:
            raise StorageError(
                f"Checkpoint storage {self.url!r} does not exist ({err}). Create the bucket first, or fix `dirpath`."
            ) from err
        except Exception as err:
            raise StorageError(f"Checkpoint storage {self.url!r} is not usable: {err!r}") from err
        if got != b"ok":
            raise StorageError(f"Checkpoint storage {self.url!r} returned wrong data for a probe object.")

    def _probe_endpoint(self, timeout: float = 5.0) -> None:
        """Fail fast on an explicit endpoint that refuses connections (clients would retry for a minute)."""
        endpoint = self.options.get("endpoint_url") or self.options.get("client_kwargs", {}).get("endpoint_url")
        if not endpoint:
            return
        parsed = urllib.parse.urlparse(endpoint)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=timeout).close()
        except OSError as err:
            raise StorageError(
                f"Cannot reach checkpoint storage {self.url!r}: the endpoint {endpoint} does not accept connections "
                f"({err}). Check endpoint_url in storage_options and that the service is running."
            ) from err

    # ---------------------------------------------------------------- objects
    def write_json(self, rel: str, obj: Any) -> dict[str, Any]:
        """Write JSON as one object: on object stores a single PUT, locally a rename of a complete file.

        Returns the object's size and checksum, as recorded in manifests.
        """
        data = dumps_by_line(obj).encode()
        target = self.path_of(rel)

        def put() -> None:
            if self.is_local:
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                tmp = f"{target}.tmp-{uuid.uuid4().hex}"
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, target)
            else:
                self.fs.pipe_file(target, data)

        retry(put, f"writing {self.url_of(rel)}")
        return digest(data)

    def read_json(self, rel: str, expected: dict[str, Any] | None = None) -> Any:
        """Parse a JSON object; with ``expected`` (its record in a manifest), refuse bytes that do not match."""
        data = retry(lambda: self.fs.cat_file(self.path_of(rel)), f"reading {self.url_of(rel)}")
        if expected is not None:
            verify(data, expected, self.url_of(rel))
        return json.loads(data)

    def sizes(self, rel_dir: str) -> dict[str, int]:
        """Names and sizes of the objects directly in ``rel_dir``."""
        path = self.path_of(rel_dir)
        self._fresh(path)
        entries = retry(lambda: self.fs.ls(path, detail=True), f"listing {self.url_of(rel_dir)}")
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e.get("type") != "directory"
        }

    def open(self, rel: str, mode: str = "rb") -> Any:
        return self.fs.open(self.path_of(rel), mode)

    def delete(self, rel: str) -> None:
        path = self.path_of(rel)
        try:
            retry(lambda: self.fs.rm(path, recursive=True), f"deleting {self.url_of(rel)}")
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------- checkpoints
    def step_dirs(self) -> list[str]:
        """All ``step-*`` directories, committed or not, oldest first."""
        self._fresh(self.root)
        try:
            entries = retry(lambda: self.fs.ls(self.root, detail=False), f"listing {self.url}")
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted(n for n in names if n.startswith(STEP_PREFIX) and n[len(STEP_PREFIX) :].isdigit())

    def committed(self) -> list[str]:
        """Checkpoint directories that have a manifest (i.e. that exist), oldest first."""
        if self.is_local:  # one listing and a stat per directory (fsspec's glob walks into every directory)
            return [d for d in self.step_dirs() if os.path.isfile(self.path_of(d, MANIFEST))]
        pattern = self.path_of(f"{STEP_PREFIX}*", MANIFEST)
        self._fresh(self.root)
        try:
            found = retry(lambda: self.fs.glob(pattern), f"listing {self.url}")
        except FileNotFoundError:
            return []
        dirs = {p.rstrip("/").rsplit("/", 2)[-2] for p in found}
        return sorted(d for d in dirs if d[len(STEP_PREFIX) :].isdigit())


def _redact(options: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ("***" if any(s in k.lower() for s in ("secret", "key", "token", "password")) else v)
        for k, v in options.items()
    }
