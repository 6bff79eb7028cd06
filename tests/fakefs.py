"""Test-only fsspec filesystems (registered when imported): slow and flaky local storage.

* ``slowfile://``: like ``file://``, but opening a shard of checkpoint step ``SPOT_TEST_SLOW_STEP`` for
  writing leaves a marker file (``SPOT_TEST_MARKER``) and stalls (``SPOT_TEST_SLOW_SECONDS``, default
  600), so a test can act while an upload is in flight.
* ``flakyfile://``: like ``file://``, but the first write of every file raises ConnectionResetError,
  as a flaky network would; a retry succeeds.
* ``gatedfile://``: like ``file://``, but every operation raises ConnectionRefusedError while the file
  named by ``SPOT_TEST_GATE`` exists: storage that is unreachable for a while.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem


class SlowFileSystem(LocalFileSystem):
    protocol = ("slowfile",)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        handle = super()._open(path, mode, **kwargs)
        step = os.environ.get("SPOT_TEST_SLOW_STEP")
        if "w" in mode and step and f"step-{int(step):09d}" in path and path.endswith(".distcp"):
            handle.write(b"partial upload")
            handle.flush()
            with open(os.environ["SPOT_TEST_MARKER"], "w") as marker:
                marker.write(path)
            time.sleep(float(os.environ.get("SPOT_TEST_SLOW_SECONDS", 600)))
        return handle


class _CheckedWrites(LocalFileSystem):
    """``file://`` whose writes (opening for writing, ``pipe_file``) pass :meth:`before_write` first."""

    def before_write(self, path: str) -> None:
        raise NotImplementedError

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode:
            self.before_write(path)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:  # type: ignore[override]
        self.before_write(path)
        super().pipe_file(path, value, **kwargs)


class FlakyFileSystem(_CheckedWrites):
    protocol = ("flakyfile",)
    failed: ClassVar[set[str]] = set()
    lock = threading.Lock()

    def before_write(self, path: str) -> None:
        name = os.path.basename(str(path)).split(".tmp")[0]  # temporary names count as their target
        with self.lock:
            if name in self.failed:
                return
            self.failed.add(name)
        raise ConnectionResetError(f"flaky network while writing {name}")


class GatedFileSystem(LocalFileSystem):
    protocol = ("gatedfile",)

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        gate = os.environ.get("SPOT_TEST_GATE")
        if callable(attr) and not name.startswith("__") and gate and os.path.exists(gate):
            raise ConnectionRefusedError(f"storage unreachable (test gate {gate} is closed)")
        return attr


class DeniedFileSystem(_CheckedWrites):
    """``deniedfile://``: like ``file://``, but the rank named by ``SPOT_TEST_DENIED_RANK`` may not write
    checkpoint data (a bucket policy that refuses one node's role)."""

    protocol = ("deniedfile",)

    def before_write(self, path: str) -> None:
        if os.environ.get("RANK") == os.environ.get("SPOT_TEST_DENIED_RANK") and "step-" in str(path):
            raise PermissionError(f"access denied writing {path} (rank {os.environ.get('RANK')})")


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)
fsspec.register_implementation("flakyfile", FlakyFileSystem, clobber=True)
fsspec.register_implementation("gatedfile", GatedFileSystem, clobber=True)
fsspec.register_implementation("deniedfile", DeniedFileSystem, clobber=True)
