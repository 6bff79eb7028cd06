"""Time from one rank's failure to the end of every rank of the job (issue 26: within 5 s).

Each kind runs ``tests/workers/fail_job.py``: a P2 pipeline (``SpotPipelineStrategy(step_timeout=3.0)``) with
``SpotCheckpoint``, CPU processes over gloo, in which one rank fails at a known step and writes the time:

* ``step``: ``training_step`` raises on the last stage (2 processes);
* ``callback``: a callback raises on one of 4 ranks (P2xD2);
* ``upload``: one rank may not write checkpoint data (2 processes);
* ``freeze``: one rank stops itself with SIGSTOP (a node that vanished without closing its sockets); the others
  give up after ``step_timeout`` = 3 s here (60 s by default).

For each run the script prints the seconds from the failure to the last exit of a rank that was not frozen,
and every rank's exit code (1: a failure, never 75, the preemption code).

Usage::

    python benchmarks/failure_stop.py                        # every kind, 3 runs each
    python benchmarks/failure_stop.py --kinds step,freeze --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.distributed import run_until_exit  # noqa: E402

WORLD = {"step": 2, "callback": 4, "upload": 2, "freeze": 2}
FAILING_RANK = 1


def run_once(kind: str, out: Path) -> tuple[float | None, list[int | None]]:
    exits = run_until_exit(
        WORLD[kind],
        ["tests/workers/fail_job.py", kind, str(out)],
        log_dir=out / "logs",
        env={"SPOT_TEST_DENIED_RANK": str(FAILING_RANK)},
        timeout=150,
        after_first_exit=20,
    )
    failed = out / "failed.json"
    if not failed.exists():
        return None, exits.codes
    at = json.loads(failed.read_text())["time"]
    ends = [t for r, t in enumerate(exits.times) if not (kind == "freeze" and r == FAILING_RANK)]
    if any(t is None for t in ends):
        return None, exits.codes
    return max(t for t in ends if t is not None) - at, exits.codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="step,callback,upload,freeze")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            seconds = []
            for i in range(args.repeats):
                took, codes = run_once(kind, Path(tmp) / f"{kind}-{i}")
                shown = f"{took:.2f}s" if took is not None else "did not stop"
                print(
                    f"{kind:9s} run {i + 1}: every rank ended {shown} after the failure; exit codes {codes}", flush=True
                )
                if took is not None:
                    seconds.append(took)
            rows.append((kind, seconds))
    print("\nkind       ranks  median   max     (seconds from the failure to the last rank's exit)")
    for kind, seconds in rows:
        if seconds:
            print(f"{kind:9s}  {WORLD[kind]:5d}  {statistics.median(seconds):6.2f}  {max(seconds):6.2f}")
        else:
            print(f"{kind:9s}  {WORLD[kind]:5d}  (no run stopped)")


if __name__ == "__main__":
    main()
