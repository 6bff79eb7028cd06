"""Survivors keep training (torchft): pipelines are replica groups joined by a lighthouse in this process.

Every job here trains the same model and data as a plain single-process Lightning run; whatever pipelines come and
go, the final parameters must equal that run's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_spot.checkpoint.durable.journal import read_events
from lightning_spot.checkpoint.durable.storage import Storage, step_dirname
from lightning_spot.checkpoint.tools.consolidate import load_full_state_dict
from lightning_spot.observe.run_report import build_report
from lightning_spot.preemption import PREEMPTED_EXIT_CODE
from tests.distributed import REPO, WorkerFailure, _logs, _running, free_port
from tests.parity import assert_same_params, reference_run
from tests.workers.ft_train import BATCH, FINETUNE_SAMPLES, SAMPLES, finetune_scenario

pytest.importorskip("torchft")


def _hostname_resolves() -> bool:
    try:
        socket.gethostbyname(socket.gethostname())
        return True
    except OSError:
        return False


#: torchft's managers and checkpoint transport advertise this machine's hostname to each other
needs_hostname = pytest.mark.skipif(not _hostname_resolves(), reason="this machine's hostname does not resolve")


WORKER = "tests/workers/ft_train.py"


@pytest.fixture
def lighthouse() -> Iterator[str]:
    from lightning_spot_launch.lighthouse import start_lighthouse

    server = start_lighthouse()
    try:
        yield server.address()
    finally:
        server.shutdown()


def _reference(
    steps: int, model: str = "tiny", accumulate: int = 1, family: str = "llama", tied: bool = False
) -> dict[str, Any]:
    if model == "finetune":
        return reference_run(finetune_scenario(steps, accumulate, family, tied))
    return reference_run(
        {"model": {"scheduler": True}, "loader": {"batch_size": BATCH, "n": SAMPLES}, "trainer": {"max_steps": steps}}
    )


def test_a_sigterm_makes_the_process_leave_even_while_its_main_thread_is_blocked(tmp_path: Path) -> None:
    """LeaveOnSignal: the main thread sits in a system call that Python restarts after each signal (as it would in
    a collective or in torchft's quorum); SIGTERM still ends the process within a second, with the preemption exit
    code, after the leave callback ran."""
    code = (
        "import os, sys\n"
        "from lightning_spot.torchft.leave import LeaveOnSignal\n"
        "LeaveOnSignal(lambda: print('callback ran', flush=True), who='pipeline 7 rank 0').start()\n"
        "print('ready', flush=True)\n"
        "r, w = os.pipe()\n"
        "os.read(r, 1)  # blocks for good: PEP 475 restarts it after the (no-op) Python handler\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # (inside os.read by now)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code_ = proc.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = proc.communicate()
    assert code_ == 75, (code_, out, err)
    assert took < 1.0, f"left after {took:.2f} s"
    assert "callback ran" in out and "pipeline 7 rank 0 leaves at once (SIGTERM)" in err


def _results(out: Path) -> dict[str, dict[str, Any]]:
    return {f.stem: torch.load(f) for f in sorted(out.glob("group*_rank*.pt"))}


@needs_hostname
@pytest.mark.timeout(300)
def test_survivors_keep_training_through_a_kill_and_a_replacement_heals(tmp_path: Path, lighthouse: str) -> None:
    """Three one-stage pipelines; pipeline 2 is killed in step 4 before its gradients reach the others; the two
    survivors go on in the same processes, the step that lost a peer is run again, and a replacement of pipeline 2
    started afterwards joins by taking a survivor's state. Every pipeline that finishes equals the reference, and
    the durable checkpoints (written by one pipeline of each quorum) hold the reference's weights.

    The data is what fine-tuning feeds: a transformers Llama on padded batches whose labels are -100 on prompts and
    padding, so every pipeline's share holds a different number of tokens (the gradients are averaged by tokens, not
    by pipelines), and each epoch ends with a short batch split 2:1:1 among three pipelines."""
    out, checkpoints = tmp_path / "out", tmp_path / "ckpt"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [
        WORKER,
        str(out),
        "--steps",
        "400",
        "--step-sleep",
        "0.1",
        "--checkpoint",
        str(checkpoints),
        "--groups",
        "3",
        "--model",
        "finetune",
        "--bucket-bytes",
        "16384",  # several gradient buckets per pipeline: all but the last may go during the backward
    ]
    argv += ["--end-after-heal", "2:6"]  # every pipeline ends 6 steps after the replacement of pipeline 2 joined
    with ExitStack() as stack:
        procs = []
        for group in (0, 2, 1):  # pipeline 1 starts late: pipeline 2 dies in the very step in which it joins
            if group == 1:
                time.sleep(2.0)
            extra = ["--die-at", "4"] if group == 2 else []
            extra += ["--timeline", str(tmp_path / "timeline")] if group == 0 else []
            procs += stack.enter_context(
                _running(1, [*argv, *extra], tmp_path / f"logs{group}", {**env, "REPLICA_GROUP_ID": str(group)})
            )
        procs = [procs[0], procs[2], procs[1]]
        survivors = {p.pid for p in procs[:2]}
        deadline = time.monotonic() + 240
        while procs[2].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert procs[2].returncode == -9, "pipeline 2 was to kill itself in step 4"
        # the replacement sends its gradient buckets during its backward (TorchFT(overlap=True)), the others after
        # it: each pipeline's choice, the same sums
        replacement = stack.enter_context(
            _running(1, [*argv, "--overlap"], tmp_path / "logs2b", {**env, "REPLICA_GROUP_ID": "2"})
        )[0]
        for p in [*procs[:2], replacement]:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in [*procs[:2], replacement]]
        if codes != [0, 0, 0]:
            logs = [*(_logs(tmp_path / f"logs{g}", 1)[0] for g in range(2)), _logs(tmp_path / "logs2b", 1)[0]]
            raise WorkerFailure(f"exit codes {codes}", logs)
    results = _results(out)
    assert sorted(results) == ["group0_rank0", "group1_rank0", "group2_rank0"]
    assert {results[f"group{g}_rank0"]["pid"] for g in range(2)} == survivors, "a survivor was restarted"
    steps = results["group0_rank0"]["global_step"]
    assert steps > 9, "the first epoch's short last batch (step 9) must be among the steps trained"
    ref = _reference(steps, "finetune")
    for name, got in results.items():
        assert got["global_step"] == steps, name
        assert_same_params(got["state_dict"], ref)
    for g in range(2):
        assert results[f"group{g}_rank0"]["discarded"] >= 1, "the step that lost its peer must have been run again"
    # logged values: the whole global batch's (summed over the quorum), each step logged once (the step run again
    # once: epoch means as one process's); pipeline 0 trained every epoch from its start
    # (and a torchmetrics.SumMetric of the labelled tokens, on steps and epochs)
    for name, got in results.items():
        assert got["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], rel=1e-4), name
        assert got["metrics"]["tokens_step"] == ref["metrics"]["tokens_step"], name
    for key in ("train_loss_epoch", "tokens_epoch"):
        means = [e[key] for e in results["group0_rank0"]["epoch_metrics"]]
        want = [e[key] for e in ref["epoch_metrics"]]
        assert len(means) == len(want) >= 2 and means == pytest.approx(want, rel=2e-5), (key, means, want)
    committed = Storage(str(checkpoints)).committed()  # one checkpoint per save, whichever pipeline wrote it
    assert committed and committed == [step_dirname(s) for s in range(5, steps + 1, 5)][-len(committed) :]
    last = steps - steps % 5
    # the step run again counts once in the data consumed (an epoch: 8 batches of 12, then one of 8)
    manifest = Storage(str(checkpoints)).read_json(f"{committed[-1]}/manifest.json")
    epochs, batches = divmod(last, math.ceil(FINETUNE_SAMPLES / BATCH))
    assert manifest["data"]["samples_consumed"] == epochs * FINETUNE_SAMPLES + batches * BATCH, manifest["data"]
    assert_same_params(load_full_state_dict(str(checkpoints)), ref if last == steps else _reference(last, "finetune"))
    # each pipeline's own history: the quorum changes and the step run again; the replacement resumed from a peer
    ft = build_report(Storage(str(checkpoints / "pipeline-0")))["fault_tolerance"]
    assert ft["steps_run_again"] >= 1 and ft["most_pipelines"] == 3 and ft["fewest_pipelines"] <= 2, ft
    # the job's report over the three histories: every pipeline's GPU-seconds against the fullest quorum's pace
    from lightning_spot.observe.job_report import build_job_report

    job = build_job_report(Storage(str(checkpoints)))
    assert sorted(job["pipelines"]) == ["pipeline-0", "pipeline-1", "pipeline-2"] and job["samples"] > 0
    # (the figure itself is noise in a run of a few seconds whose joins and kill dominate: the unit test checks it)
    assert job["full_quorum"]["pipelines"] == 3 and job["gpu_time_efficiency"] > 0, job
    starts = [e for e in read_events(Storage(str(checkpoints / "pipeline-2"))) if e["kind"] == "start"]
    assert starts[-1]["resumed_from"] == "peer" and starts[-1]["restart_count"] == 0, starts
    # pipeline 0's timeline marks the quorum (all but its first step), the gradient all-reduce and the commit vote
    trace = json.loads((tmp_path / "timeline" / "trace.json").read_text())["traceEvents"]
    spans = [e["name"] for e in trace if e.get("tid") == "torchft" and e.get("ph") == "X"]
    assert all(spans.count(name) >= 3 for name in ("quorum", "all-reduce", "commit")), spans
    assert results["group2_rank0"]["launched_early"] > 0 and results["group0_rank0"]["launched_early"] == 0
    died = int(next(out.glob("died_group2_step*")).name.rsplit("step", 1)[1])
    # (a forked replacement starts within milliseconds: it may join at the boundary of the very step run again)
    assert (results["group2_rank0"]["healed_at"] or 0) >= died > 0, "the replacement must have joined mid-run"


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(200)
def test_a_lighthouse_that_dies_mid_run_stops_every_pipeline_with_a_clear_error(tmp_path: Path) -> None:
    """Two one-stage pipelines; the lighthouse goes away after both trained a few steps: each pipeline fails its
    next quorum within quorum_timeout (5 s here) with an error that names the lighthouse, and exit code 69 (the
    coordinator lost, not an error of the job's code: a scheduler relaunches it)."""
    port = free_port()
    code = f"from lightning_spot_launch.lighthouse import start_lighthouse as s; x = s({port}); input()"
    server = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    up = time.monotonic() + 90  # its process imports torch first: the pipelines must not start before it listens
    while time.monotonic() < up and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    out = tmp_path / "out"
    argv = [WORKER, str(out), "--steps", "400", "--step-sleep", "0.1", "--quorum-timeout", "5"]
    with ExitStack() as stack:
        stack.callback(lambda: (server.kill(), server.wait()))
        procs = []
        for group in range(2):
            env = {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(group)}
            procs += stack.enter_context(_running(1, argv, tmp_path / f"logs{group}", env))
        deadline = time.monotonic() + 120
        logs = [tmp_path / f"logs{g}" / "rank0.log" for g in range(2)]
        together = ("2 pipelines train from step", "joined 2 pipelines")  # (a later join, or both in the first)
        while time.monotonic() < deadline and not any(w in p.read_text() for p in logs for w in together):
            time.sleep(0.2)  # until both are in one quorum (the first says so)
        time.sleep(1.0)
        server.kill()  # the lighthouse's process dies
        gone = time.monotonic()
        codes = [p.wait(timeout=60) for p in procs]
        ended = time.monotonic() - gone
    texts = [p.read_text() for p in logs]
    assert codes == [69, 69], texts[0][-3000:]
    assert ended < 5 + 20, f"the pipelines took {ended:.1f} s to stop"
    assert all(f"no quorum from the torchft lighthouse at {address} within 5 s" in t for t in texts), texts[0][-3000:]


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_a_two_stage_pipeline_that_loses_a_stage_returns_through_its_torchrun(tmp_path: Path) -> None:
    """`lightning-spot run --replica-groups 2`: two P2 pipelines, each under its own torchrun. The last stage of
    pipeline 1 dies in step 3; its torchrun stops the other stage and starts both again, and they take pipeline 0's
    state; pipeline 0 is never restarted. Both pipelines end equal to the single-process run."""
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "lightning_spot.cli", "run", "--replica-groups", "2", "--nproc-per-node", "2",
        "--lighthouse-port", "0", "--max-restarts", "2", WORKER, str(out), "--stages", "2", "--steps", "400",
        "--step-sleep", "0.1", "--die", "1:1:3", "--groups", "2", "--end-after-heal", "1:6",
    ]  # fmt: skip
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        try:
            code = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert code == 0, log.read_text()[-8000:]
    started = sorted(p.name.rsplit("_", 1)[0] for p in (out / "started").iterdir())
    assert started == ["group0_rank0", "group0_rank1", "group1_rank0", "group1_rank0", "group1_rank1", "group1_rank1"]
    results = _results(out)
    assert sorted(results) == ["group0_rank0", "group0_rank1", "group1_rank0", "group1_rank1"]
    steps = results["group0_rank0"]["global_step"]
    ref = _reference(steps)
    for g in range(2):
        assert results[f"group{g}_rank0"]["global_step"] == steps
        merged = {**results[f"group{g}_rank0"]["state_dict"], **results[f"group{g}_rank1"]["state_dict"]}
        assert_same_params(merged, ref)
    # it came back and took pipeline 0's state: at the step it died in or later (forked workers return in ~1 s,
    # often before pipeline 0 has committed another step)
    assert all((results[f"group1_rank{r}"]["healed_at"] or 0) >= 3 for r in range(2))


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_a_pipeline_that_loses_a_node_re_forms_at_depth_one_in_the_same_quorum(tmp_path: Path, lighthouse: str) -> None:
    """Two pipelines of two stages, each stage its own node (one agent per node, one rendezvous per pipeline, as
    `REPLICA_GROUP_ID=g lightning-spot run --nnodes 1:2 --nproc-per-node 1 --rdzv-endpoint ...` runs them). Node b of
    pipeline 1 is gone for good after step 8: node a's agent starts its worker again alone, a pipeline of depth 1, which
    joins the running quorum and takes pipeline 0's state from both of its ranks (its layers are cut in two there)
    at the quorum's step, never from step 0; the two pipelines, of depths 2 and 1, then train together until a
    stop file. Pipeline 0 is never restarted; both end equal to one process."""
    from tests.elastic import Agent, agents_cleanup, wait_for

    out, stop = tmp_path / "out", tmp_path / "stop"

    argv = [WORKER, str(out), "--stages", "0", "--steps", "400", "--step-sleep", "0.2", "--stop-file", str(stop)]
    ports = [free_port(), free_port()]
    with agents_cleanup([]) as agents:
        _start_pipelines_of_two_nodes(agents, ports, argv, tmp_path, lighthouse)
        survivors = agents[:3]
        wait_for(lambda: _all_at_step(lighthouse, 8), 200, "both pipelines at step 8", agents)
        agents[3].kill_node()  # node b of pipeline 1 is gone for good, with its agent
        killed = time.time()

        def reformed() -> list[dict[str, Any]]:
            return _heals(out, "1", after=killed)

        wait_for(lambda: bool(reformed()), 120, "the re-formed pipeline to heal", survivors)
        time.sleep(3.0)  # (a few steps together at depths 2 and 1)
        # a node comes back: pipeline 1 grows to depth 2 again (its agent restarts it with both nodes), takes
        # pipeline 0's state stage by stage, and the quorum is of one layout again
        returned = time.time()
        env = {"REPLICA_GROUP_ID": "1", "TORCHFT_LIGHTHOUSE": lighthouse}
        agents.append(Agent("1c", ports[1], 1, argv, tmp_path / "pipeline1c.log", nnodes="1:2", env=env))
        live = [*survivors, agents[4]]

        def grown() -> list[dict[str, Any]]:
            return [h for h in reformed() if h["time"] > returned]

        wait_for(lambda: {h["rank"] for h in grown()} == {0, 1}, 120, "pipeline 1 to grow back to depth 2", live)
        time.sleep(2.0)
        stop.touch()
        wait_for(lambda: all(a.proc.poll() is not None for a in live), 120, "the pipelines to end", live)
        codes = [a.proc.returncode for a in live]
        assert codes == [0, 0, 0, 0], (codes, survivors[2].output()[-5000:])
    started = sorted(p.name.rsplit("_", 1)[0] for p in (out / "started").iterdir())
    assert started.count("group0_rank0") == 1 and started.count("group0_rank1") == 1, "pipeline 0 was restarted"
    results = _results(out)
    assert sorted(results) == ["group0_rank0", "group0_rank1", "group1_rank0", "group1_rank1"]
    healed = [h for h in reformed() if h["time"] < returned]  # (and at its start, at depth 2, if it started late)
    assert [h["rank"] for h in healed] == [0] and healed[0]["step"] >= 8, healed  # at depth 1, at the quorum's step
    assert min(h["step"] for h in grown()) > healed[0]["step"], "grew back at a later step, never from step 0"
    steps0 = results["group0_rank0"]["global_step"]
    assert steps0 > healed[0]["step"] and results["group0_rank1"]["global_step"] == steps0
    merged = {**results["group0_rank0"]["state_dict"], **results["group0_rank1"]["state_dict"]}
    assert_same_params(merged, _reference(steps0))
    steps1 = results["group1_rank0"]["global_step"]  # (it may stop a step before or after pipeline 0)
    assert steps1 > healed[0]["step"] and abs(steps1 - steps0) <= 1 and results["group1_rank1"]["global_step"] == steps1
    grown_back = {**results["group1_rank0"]["state_dict"], **results["group1_rank1"]["state_dict"]}
    assert_same_params(grown_back, _reference(steps1))
    # (the phases, for the record: python -m pytest -s ... prints them)
    next_commit = min(t for _, t in results["group0_rank0"]["ended"] if t > killed)
    back = max(h["time"] for h in grown())
    print(
        f"\nre-form: node lost -> pipeline 0's next commit {next_commit - killed:.2f} s, pipeline 1 re-formed at depth 1"
        f" with its state {healed[0]['time'] - killed:.2f} s; node back -> depth 2 again {back - returned:.2f} s"
    )


def _start_pipelines_of_two_nodes(
    agents: list[Any], ports: list[int], argv: list[str], logs: Path, lighthouse: str
) -> None:
    """Pipelines 0 and 1 of two one-process nodes each, every node its own agent (``--nnodes 1:2``), one rendezvous
    per pipeline on ``ports``; appended to ``agents`` as 0a, 0b, 1a, 1b (logs ``pipeline1a.log``...)."""
    from tests.elastic import Agent, port_open, wait_for

    for group in (0, 1):
        for node in "ab":  # (node a first: it hosts its pipeline's rendezvous and survives)
            env = {"REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": lighthouse}
            log = logs / f"pipeline{group}{node}.log"
            agents.append(Agent(f"{group}{node}", ports[group], 1, argv, log, nnodes="1:2", env=env))
            if node == "a":
                wait_for(lambda g=group: port_open(ports[g]), 60, f"pipeline {group}'s rendezvous", agents)


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_every_pipeline_restarted_resumes_from_its_own_snapshots_and_a_laggard_takes_the_newest(
    tmp_path: Path, lighthouse: str
) -> None:
    """Two one-stage pipelines keep snapshots in host memory every step (each apart from the other's), durable
    checkpoints every 5. Both are killed in step 12. One pipeline's newest snapshot is then lost, and both start
    again: each resumes from its own memory, one a step behind the other; they do not train together from those
    different states: at the first step the one behind is handed the newer state, leaves, and rejoins with it (as
    its torchrun would restart it). Both end equal to one process.

    The other order is allowed, and checked: a pipeline still waiting at its join for the killed ones to vanish from
    the lighthouse (they linger a few seconds, and one may vanish later than the other) is handed the state of the
    one behind, which saw them gone first and is in its first step (a step retrained, the same math)."""
    from lightning_spot.checkpoint.memory.snapshot import SnapshotStore

    out, checkpoints = tmp_path / "out", tmp_path / "ckpt"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [WORKER, str(out), "--steps", "400", "--step-sleep", "0.1", "--checkpoint", str(checkpoints)]
    argv += ["--snapshot-every", "1"]

    def start(stack: ExitStack, group: int, extra: list[str], tag: str) -> subprocess.Popen:
        logs, group_env = tmp_path / f"{tag}{group}", {**env, "REPLICA_GROUP_ID": str(group)}
        return stack.enter_context(_running(1, [*argv, *extra], logs, group_env))[0]

    with ExitStack() as stack:
        first = [start(stack, g, ["--die", "0:0:12,1:0:12"], "first") for g in (0, 1)]
        assert [p.wait(timeout=200) for p in first] == [-9, -9]
    stores = [SnapshotStore.for_run(str(checkpoints), str(out / "snapshots"), str(g)) for g in range(2)]
    held = [sorted(store.shares()) for store in stores]
    assert held[0] and held[1] and max(held[0][-1], held[1][-1]) > 10, ("snapshots newer than step 10's save", held)
    # one pipeline's newest snapshots are lost, so that it holds an older step than the other, still newer than the
    # durable step 10 (each keeps its newest two; the newest of each may differ by a step: snapshots are written in
    # the background, and the kill may come first)
    lag, behind = next(
        (g, max(older))
        for g in (1, 0)
        if (older := [step for step in held[g] if 10 <= step < held[1 - g][-1]])
    )  # fmt: skip
    lead = 1 - lag
    stores[lag].drop_after(behind)
    starts = out / "starts.jsonl"
    before = len(starts.read_text().splitlines())
    again = ["--end-after-heal", "*:4"]  # (both end 4 steps after the first heal of this restart)
    with ExitStack() as stack:
        second = [start(stack, g, again, "second") for g in (0, 1)]
        lag_code = second[lag].wait(timeout=200)
        assert lag_code in (0, PREEMPTED_EXIT_CODE), lag_code
        processes = [second[lead], start(stack, lag, again, "third") if lag_code else second[lag]]
        codes = [p.wait(timeout=200) for p in processes]  # (the third: as its torchrun restarts it)
        if codes != [0, 0]:
            logs = [_logs(tmp_path / d, 1)[0] for d in (f"second{lead}", f"third{lag}" if lag_code else f"second{lag}")]
            raise WorkerFailure(f"exit codes {codes}", logs)
    resumed = [json.loads(line) for line in starts.read_text().splitlines()[before:]]
    tier_of = {r["group"]: (r["tier"], r["step"]) for r in resumed[:2]}
    if lag_code == PREEMPTED_EXIT_CODE:  # each from its own memory; the one behind then took the newer state
        assert tier_of == {str(lead): ("memory", held[lead][-1]), str(lag): ("memory", behind)}, (resumed, held)
        rejoined = resumed[2]
        assert rejoined["group"] == str(lag) and rejoined["tier"] == "peer", resumed
        assert rejoined["step"] >= held[lead][-1], resumed
    else:  # the one ahead, still at its join, took the state of the one behind (from its memory)
        assert tier_of[str(lag)] == ("memory", behind), (resumed, held)
        assert tier_of[str(lead)][0] == "peer" and tier_of[str(lead)][1] >= behind, (resumed, held)
    results = _results(out)
    steps = results["group0_rank0"]["global_step"]
    ref = _reference(steps)
    for name, got in results.items():
        assert got["global_step"] == steps, name
        assert_same_params(got["state_dict"], ref)


def _kill_and_replace(tmp_path: Path, argv: list[str], env: dict[str, str], die_at: int) -> int:
    """Pipelines 0 and 1 of one rank each; pipeline 1 kills itself in step ``die_at`` (SIGKILL), then a replacement
    of it starts; both that and pipeline 0 must end with 0. Returns pipeline 0's process id."""
    with ExitStack() as stack:
        first = stack.enter_context(_running(1, argv, tmp_path / "logs0", {**env, "REPLICA_GROUP_ID": "0"}))[0]
        dying = stack.enter_context(
            _running(1, [*argv, "--die-at", str(die_at)], tmp_path / "logs1", {**env, "REPLICA_GROUP_ID": "1"})
        )[0]
        deadline = time.monotonic() + 200
        while dying.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dying.returncode == -9, f"pipeline 1 was to kill itself in step {die_at}"
        replacement = stack.enter_context(_running(1, argv, tmp_path / "logs1b", {**env, "REPLICA_GROUP_ID": "1"}))[0]
        for p in (first, replacement):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [first.returncode, replacement.returncode]
        if codes != [0, 0]:
            raise WorkerFailure(f"exit codes {codes}", [_logs(tmp_path / d, 1)[0] for d in ("logs0", "logs1b")])
        return first.pid


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_optimizer_offload_under_torchft_survives_a_kill_and_heals_into_host_masters(
    tmp_path: Path, lighthouse: str
) -> None:
    """offload="optimizer" with fault_tolerance="torchft": two one-stage pipelines whose fp32 masters and Adam state
    live in host memory. Pipeline 1 dies in step 4 before its gradients reach pipeline 0, which runs the step again
    alone and updates its masters from the quorum's gradients only; a replacement of pipeline 1 takes pipeline 0's
    masters and optimizer state into its own host memory. Both end equal to one process without offload."""
    out = tmp_path / "out"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [WORKER, str(out), "--steps", "400", "--step-sleep", "0.1", "--offload", "optimizer", "--groups", "2"]
    argv += ["--end-after-heal", "1:6"]
    first_pid = _kill_and_replace(tmp_path, argv, env, die_at=4)
    results = _results(out)
    steps = results["group0_rank0"]["global_step"]
    assert steps > 4 and results["group0_rank0"]["pid"] == first_pid
    assert results["group0_rank0"]["discarded"] >= 1, "the step that lost its peer must have been run again"
    assert (results["group1_rank0"]["healed_at"] or 0) >= 4, "the replacement must have taken pipeline 0's state"
    ref = _reference(steps)
    for name, got in results.items():
        assert got["global_step"] == steps, name
        assert_same_params(got["state_dict"], ref)


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_accumulated_batches_under_torchft_equal_one_process_through_a_kill(
    tmp_path: Path, lighthouse: str, family: str
) -> None:
    """accumulate_grad_batches=2 with fault_tolerance="torchft": two one-stage pipelines fine-tune a Llama (and a
    GPT-2, whose embedding is tied to its head) on padded
    batches whose labelled tokens vary from batch to batch (each batch's gradients must enter as its part of its own
    batch's token mean, not the window's) and whose epochs end with a short batch. Pipeline 1 dies in the second
    batch of a window (its first batch's weights were summed with pipeline 0's): pipeline 0 runs the whole window
    again alone, its first batch included; a replacement joins at a window's boundary. Parameters, logged values
    and epoch means equal one process accumulating the same batches."""
    out = tmp_path / "out"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [WORKER, str(out), "--steps", "400", "--step-sleep", "0.05", "--model", "finetune", "--accumulate", "2"]
    argv += ["--groups", "2", "--end-after-heal", "1:6", "--family", family]
    first_pid = _kill_and_replace(tmp_path, argv, env, die_at=3)
    results = _results(out)
    steps = results["group0_rank0"]["global_step"]
    assert steps > 5, "an epoch's short last batch (its 9th) must be among the batches trained"
    assert results["group0_rank0"]["pid"] == first_pid
    assert results["group0_rank0"]["discarded"] >= 1, "the window that lost its peer must have been run again"
    assert (results["group1_rank0"]["healed_at"] or 0) >= 3, "the replacement must have taken pipeline 0's state"
    ref = _reference(steps, "finetune", accumulate=2, family=family)
    for name, got in results.items():
        assert got["global_step"] == steps, name
        assert_same_params(got["state_dict"], ref)
        assert got["metrics"]["train_loss"] == pytest.approx(ref["metrics"]["train_loss"], rel=1e-4), name
        assert got["metrics"]["tokens_step"] == ref["metrics"]["tokens_step"], name
    for key in ("train_loss_epoch", "tokens_epoch"):
        means = [e[key] for e in results["group0_rank0"]["epoch_metrics"]]
        want = [e[key] for e in ref["epoch_metrics"]]
        assert len(means) == len(want) >= 1 and means == pytest.approx(want, rel=2e-5), (key, means, want)


@needs_hostname
@pytest.mark.timeout(300)
def test_pipelines_of_different_depths_train_in_one_quorum_equal_to_one_process(
    tmp_path: Path, lighthouse: str
) -> None:
    """Pipelines [2, 1] from the start in one torchft quorum (min_replicas=2: the first quorum holds both), on GPT-2
    with its embedding tied to its output layer: pipeline 0 runs four stages on two processes (Interleaved1F1B,
    stages 0 and 2 on its first process), pipeline 1 the whole model on one. Each parameter is averaged between its
    two holders (pipeline 0's process that holds it and pipeline 1's only rank), weighted by their rows; the tied
    weight among all three copies (pipeline 0's two, which it summed first, and pipeline 1's one), each pipeline's
    counted once; the logged loss is the whole batch's: both pipelines equal one process. Every 10 commits the pipelines' speeds (rows
    per second of their last schedule, summed over the last stages) set the next shares: both hold the same speeds,
    and each trains its proportional part (whole micro-batches)."""
    from lightning_spot.torchft.batch_split import proportional_units

    out = tmp_path / "out"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [WORKER, str(out), "--steps", "12", "--min-replicas", "2", "--model", "finetune", "--family", "gpt2"]
    argv += ["--tied"]
    looped = ["--stages", "2", "--schedule", "Interleaved1F1B"]
    with ExitStack() as stack:
        deep = stack.enter_context(_running(2, [*argv, *looped], tmp_path / "logs0", {**env, "REPLICA_GROUP_ID": "0"}))
        whole = stack.enter_context(
            _running(1, [*argv, "--stages", "1"], tmp_path / "logs1", {**env, "REPLICA_GROUP_ID": "1"})
        )
        deadline = time.monotonic() + 200
        for p in [*deep, *whole]:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in [*deep, *whole]]
        if codes != [0, 0, 0]:
            raise WorkerFailure(f"exit codes {codes}", [*_logs(tmp_path / "logs0", 2), *_logs(tmp_path / "logs1", 1)])
    results = _results(out)
    assert sorted(results) == ["group0_rank0", "group0_rank1", "group1_rank0"]
    ref = _reference(12, "finetune", family="gpt2", tied=True)
    merged = {**results["group0_rank0"]["state_dict"], **results["group0_rank1"]["state_dict"]}
    assert_same_params(merged, ref)
    assert_same_params(results["group1_rank0"]["state_dict"], ref)
    for name in ("group0_rank1", "group1_rank0"):  # (the last stages: their logged loss is the whole batch's)
        got = results[name]["metrics"]["train_loss"]
        assert got == pytest.approx(ref["metrics"]["train_loss"], rel=1e-4), name
    speeds = [results[n]["shares"] for n in ("group0_rank0", "group0_rank1", "group1_rank0")]
    assert speeds[0] is not None and speeds[0] == speeds[1] == speeds[2], speeds  # (agreed at step 10)
    units = proportional_units(BATCH // 2, speeds[0][0])  # (12 rows in micro-batch pairs: 6 units)
    for name in ("group0_rank0", "group1_rank0"):  # (step 12's rows: the finetune data's batches are all full there)
        assert results[name]["rows"] == 2 * units[results[name]["participant_rank"]], (name, speeds, units)


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_a_pipeline_deeper_than_the_live_one_joins_it_mid_run(tmp_path: Path, lighthouse: str) -> None:
    """GPT-2 with its embedding tied to its output layer. Pipeline 0, whole on one process, trains alone; at step 6
    or later pipeline 1 joins, four stages on two processes (Interleaved1F1B): its first rank heals from pipeline
    0's only rank (torchft's rule), its second rank, which pipeline 0 does not have, is pointed at the same rank
    (heal_across.heal_source_rank), and each keeps its own layers (the tied weight's copy on each). The two train
    together ([1, 2]) until a stop file; both equal one process."""
    out, stop = tmp_path / "out", tmp_path / "stop"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [WORKER, str(out), "--steps", "400", "--step-sleep", "0.1", "--stop-file", str(stop)]
    argv += ["--model", "finetune", "--family", "gpt2", "--tied"]

    def healed() -> list[dict[str, Any]]:
        return _heals(out, "1")

    with ExitStack() as stack:
        whole = stack.enter_context(
            _running(1, [*argv, "--stages", "1"], tmp_path / "logs0", {**env, "REPLICA_GROUP_ID": "0"})
        )
        deadline = time.monotonic() + 200
        while not list(out.glob("started/group0_*")) or _step_of(lighthouse, "0") < 6:
            assert time.monotonic() < deadline and whole[0].poll() is None, "pipeline 0 must train alone first"
            time.sleep(0.2)
        deep = stack.enter_context(
            _running(
                2,
                [*argv, "--stages", "2", "--schedule", "Interleaved1F1B"],
                tmp_path / "logs1",
                {**env, "REPLICA_GROUP_ID": "1"},
            )
        )
        while {h["rank"] for h in healed()} != {0, 1}:
            failed = [p.returncode for p in [*whole, *deep] if p.poll() is not None]
            if failed or time.monotonic() > deadline:
                raise WorkerFailure(f"no heal of both ranks ({failed})", [*_logs(tmp_path / "logs1", 2)])
            time.sleep(0.2)
        time.sleep(2.0)  # (a few steps together)
        stop.touch()
        for p in [*whole, *deep]:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in [*whole, *deep]]
        if codes != [0, 0, 0]:
            raise WorkerFailure(f"exit codes {codes}", [*_logs(tmp_path / "logs0", 1), *_logs(tmp_path / "logs1", 2)])
    results = _results(out)
    joined = min(h["step"] for h in healed())
    assert joined >= 6 and {h["step"] for h in healed()} == {joined}, healed()  # (both ranks at one step)
    steps = results["group0_rank0"]["global_step"]
    assert steps > joined
    assert_same_params(results["group0_rank0"]["state_dict"], _reference(steps, "finetune", family="gpt2", tied=True))
    steps1 = results["group1_rank0"]["global_step"]  # (it may stop a step before or after pipeline 0)
    assert abs(steps1 - steps) <= 1 and results["group1_rank1"]["global_step"] == steps1
    merged = {**results["group1_rank0"]["state_dict"], **results["group1_rank1"]["state_dict"]}
    assert_same_params(merged, _reference(steps1, "finetune", family="gpt2", tied=True))


def _heals(out: Path, group: str, after: float = 0.0) -> list[dict[str, Any]]:
    """The heals the processes of pipeline ``group`` recorded in ``OUT/heals.jsonl`` after time ``after``."""
    heals = out / "heals.jsonl"
    lines = heals.read_text().splitlines() if heals.exists() else []
    return [h for h in map(json.loads, lines) if h["group"] == group and h["time"] > after]


def _all_at_step(lighthouse: str, step: int, pipelines: int = 2) -> bool:
    """Whether the lighthouse's latest quorum holds ``pipelines`` pipelines, all at ``step`` or later."""
    from lightning_spot.torchft.running_quorum import read_running

    running = read_running(lighthouse, timeout=2)
    return running is not None and len(running.members) == pipelines and min(m.step for m in running.members) >= step


def _step_of(lighthouse: str, group: str) -> int:
    """The step pipeline ``group`` holds in the lighthouse's latest quorum (0: not in it)."""
    from lightning_spot.torchft.running_quorum import read_running

    running = read_running(lighthouse, timeout=2)
    return max((m.step for m in running.members if m.group == group), default=0) if running else 0


@pytest.mark.slow
@needs_hostname
@pytest.mark.timeout(300)
def test_a_deep_pipeline_trains_on_alone_when_a_pipeline_of_other_cuts_dies(tmp_path: Path, lighthouse: str) -> None:
    """Pipelines [2, 1] in one quorum; pipeline 1 (whole, one process) dies in step 5, before its gradients reach
    pipeline 0: pipeline 0 runs that step again alone, back on torchft's own per-stage groups, and trains on to the
    end, equal to one process. (Pipeline 1 starts first and commits nothing alone: min_replicas=2 for it.)"""
    from lightning_spot.torchft.running_quorum import read_running

    out = tmp_path / "out"
    env = {"TORCHFT_LIGHTHOUSE": lighthouse}
    argv = [WORKER, str(out), "--steps", "12", "--step-sleep", "0.05", "--groups", "2"]
    with ExitStack() as stack:
        whole = stack.enter_context(
            _running(
                1,
                [*argv, "--stages", "1", "--die-at", "5", "--min-replicas", "2"],
                tmp_path / "logs1",
                {**env, "REPLICA_GROUP_ID": "1"},
            )
        )[0]
        deadline = time.monotonic() + 200
        while not ((running := read_running(lighthouse, timeout=2)) and running.members):
            assert time.monotonic() < deadline and whole.poll() is None, "pipeline 1 never reached the lighthouse"
            time.sleep(0.2)
        deep = stack.enter_context(
            _running(2, [*argv, "--stages", "2"], tmp_path / "logs0", {**env, "REPLICA_GROUP_ID": "0"})
        )
        for p in deep:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        whole.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in deep]
        if codes != [0, 0]:
            raise WorkerFailure(f"exit codes {codes}", _logs(tmp_path / "logs0", 2))
        assert whole.returncode == -9, "pipeline 1 was to kill itself in step 5"
    results = _results(out)
    assert sorted(results) == ["group0_rank0", "group0_rank1"]
    assert results["group0_rank0"]["global_step"] == 12 and results["group0_rank0"]["discarded"] >= 1
    merged = {**results["group0_rank0"]["state_dict"], **results["group0_rank1"]["state_dict"]}
    assert_same_params(merged, _reference(12))
