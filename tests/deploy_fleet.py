"""The deployment recipes run as a local fleet, for the test and the benchmark (``run_fleet``): each node started
by the recipe's own command with the environment its scheduler gives; a node preempted with notice, one killed,
each started again as the scheduler would.

    figures = run_fleet(tmp_path)   # the pauses the other pipeline saw, the notice's exit; the runs' results in OUT
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from tests.distributed import REPO, free_port
from tests.integration.test_coordinator import _coordinator
from tests.integration.test_fault_tolerance import WORKER, _heals
from tests.integration.test_snapshots import _config as snapshot_config

DEPLOY = REPO / "examples" / "deploy"
#: Slurm's commands inside the batch script: srun runs its command here (one node), scontrol notes a requeue
SHIMS = {
    "srun": '#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n',
}


class Fleet:
    """The nodes of the test, each a process group (the recipe's shell, the agent, its workers)."""

    def __init__(self, tmp_path: Path, base_env: dict[str, str]) -> None:
        self.tmp_path, self.base_env = tmp_path, base_env
        self.nodes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.tmp_path / f"{name}.log", "a") as log:  # (the process keeps its own copy of the file)
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**self.base_env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.nodes[name] = proc
        return proc

    def output(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()[-6000:]

    def close(self) -> None:
        for proc in self.nodes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _skypilot_run(fleet: Fleet, name: str, group: int, coordinator: str, args: str) -> subprocess.Popen:
    """A node of pipeline ``group`` as SkyPilot runs a managed job's ``run`` (its ``envs``, its variables)."""
    task = yaml.safe_load((DEPLOY / "skypilot" / "pipeline.yaml").read_text())
    env = {k: str(v) for k, v in task["envs"].items()}
    env.update(REPLICA_GROUP_ID=str(group), COORDINATOR=coordinator, SCRIPT=WORKER, SCRIPT_ARGS=args)
    env.update(SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_RANK="0", SKYPILOT_NODE_IPS="127.0.0.1")
    env.update(SKYPILOT_NUM_GPUS_PER_NODE="1", SKYPILOT_TASK_ID=f"sky-managed-{group}")
    env["CHECKPOINTS"] = str(fleet.tmp_path / "ckpt")
    return fleet.start(name, ["bash", "-c", task["run"]], env)


def _kubernetes_pod(fleet: Fleet, name: str, group: int, coordinator: str, args: str) -> subprocess.Popen:
    """A pod of pipeline ``group``'s Indexed Job (examples/deploy/kubernetes/torchft-pipelines.yaml): its container's
    command and environment as written, the pod's hostname and completion index; one process, the test worker as
    the script, the coordinator Service's name replaced by its local address."""
    documents = yaml.safe_load_all((DEPLOY / "kubernetes" / "torchft-pipelines.yaml").read_text())
    job = next(d for d in documents if d["kind"] == "Job" and d["metadata"]["labels"]["pipeline"] == str(group))
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    env.update(HOSTNAME=f"{job['metadata']['name']}-0-{name}", JOB_COMPLETION_INDEX="0")
    return fleet.start(name, [*_local_flags(container["command"], coordinator), WORKER, *args.split()], env)


def _local_flags(command: list[str], coordinator: str) -> list[str]:
    """A recipe container's ``lightning-spot run`` command up to its script, as one CPU process on this machine runs
    it: the coordinator Service's name replaced by its local address, one process per node."""
    flags = command[: next(i for i, word in enumerate(command) if word.endswith(".py"))]
    flags = [f"--coordinator={coordinator}" if w.startswith("--coordinator=") else w for w in flags]
    return ["--nproc-per-node=1" if w.startswith("--nproc-per-node=") else w for w in flags]


def _slurm_job(fleet: Fleet, name: str, group: int, coordinator: str, args: str, restarts: int) -> subprocess.Popen:
    """A one-node job of pipeline ``group`` as Slurm runs the batch script (``SLURM_*``; srun and scontrol shims)."""
    env = {"REPLICA_GROUP_ID": str(group), "COORDINATOR": coordinator, "SCRIPT": WORKER, "SCRIPT_ARGS": args}
    env.update(NPROC_PER_NODE="1", SLURM_JOB_ID=f"{100 + group}", SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1")
    env.update(SLURM_RESTART_COUNT=str(restarts), SLURM_JOB_NAME="lightning-spot-pipeline")
    return fleet.start(name, ["bash", str(DEPLOY / "slurm" / "pipeline.sbatch")], env)


def _longest_pause(samples: list[tuple[float, dict[str, int]]], group: str, start: float, end: float) -> float:
    """The longest time pipeline ``group`` was seen at one step between ``start`` and ``end``."""
    seen = [(t, steps[group]) for t, steps in samples if start <= t <= end and group in steps]
    assert len(seen) > 10, f"too few samples of the lighthouse between {start} and {end}"
    pauses, since = [0.0], seen[0]
    for t, step in seen[1:]:
        if step != since[1]:
            pauses.append(t - since[0])
            since = (t, step)
    return max([*pauses, seen[-1][0] - since[0]])


class Sampler(threading.Thread):
    """Reads every pipeline's step from the lighthouse's page every 0.1 s: (time, {pipeline: step})."""

    def __init__(self, lighthouse: str) -> None:
        super().__init__(daemon=True)
        self.lighthouse, self.done = lighthouse, threading.Event()
        self.samples: list[tuple[float, dict[str, int]]] = []

    def run(self) -> None:
        from lightning_spot.torchft.running_quorum import read_running

        while not self.done.wait(0.1):
            running = read_running(self.lighthouse, timeout=2)
            now = {m.group: m.step for m in running.members if m.live} if running else {}
            self.samples.append((time.time(), now))


def run_fleet(tmp_path: Path, pipeline1: str = "skypilot") -> dict[str, float]:
    """The coordinator; pipeline 0 as a Slurm job (examples/deploy/slurm/pipeline.sbatch), pipeline 1 as a SkyPilot
    managed job (examples/deploy/skypilot/pipeline.yaml's ``run``; ``pipeline1="kubernetes"``: a pod of the
    Kubernetes recipe's Indexed Job instead), one CPU node each, fault_tolerance="torchft". Pipeline 1's node gets a
    notice (SIGTERM) and must exit 75; SkyPilot's relaunch (the pod made again) joins again. Then pipeline 0's node
    is killed (no notice); Slurm's requeue joins again. Both end (exit 0) after a stop file. Returns the figures; the
    pipelines' results are in ``tmp_path / "out"`` (``group{G}_rank0.pt``)."""
    from tests.elastic import port_open, wait_for

    rdzv_port, lighthouse_port = free_port(), free_port()
    lighthouse = f"http://127.0.0.1:{lighthouse_port}"
    coordinator = _coordinator(rdzv_port, lighthouse_port, tmp_path / "coordinator.log")
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    out, stop = tmp_path / "out", tmp_path / "stop"
    path = f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    base_env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "TORCHFT_LIGHTHOUSE": lighthouse}
    base_env["SCONTROL_LOG"] = str(tmp_path / "scontrol.log")
    fleet = Fleet(tmp_path, base_env)
    args = f"{out} --steps 400 --step-sleep 0.1 --stop-file {stop} --checkpoint-dir {tmp_path / 'ckpt'}"
    address = f"127.0.0.1:{rdzv_port}"
    sampler = Sampler(lighthouse)

    def steps() -> dict[str, int]:
        return sampler.samples[-1][1] if sampler.samples else {}

    def fail(what: str) -> str:
        return "\n".join(f"----- {n} -----\n{fleet.output(n)}" for n in fleet.nodes) + f"\n{what}"

    try:
        wait_for(lambda: port_open(rdzv_port) and port_open(lighthouse_port), 90, "the coordinator", [])
        sampler.start()
        slurm = _slurm_job(fleet, "slurm0", 0, address, args, restarts=0)
        other = _kubernetes_pod if pipeline1 == "kubernetes" else _skypilot_run
        sky = other(fleet, "sky1", 1, address, args)
        deadline = time.monotonic() + 200
        while not (len(steps()) == 2 and min(steps().values()) >= 5):
            assert time.monotonic() < deadline and slurm.poll() is None and sky.poll() is None, fail("both at step 5")
            time.sleep(0.2)
        noticed = time.time()
        sky.send_signal(signal.SIGTERM)  # (the process SkyPilot started: bash exec'd lightning-spot run)
        assert sky.wait(timeout=90) == 75, fail("the notice's exit code")
        left = time.time()
        time.sleep(1.0)
        relaunched = time.time()
        sky = other(fleet, "sky1-recovered", 1, address, args)  # (recover_on_exit_codes: [75]; exit code 75: Ignore)
        deadline = time.monotonic() + 200
        while not _heals(out, "1", relaunched):
            assert time.monotonic() < deadline and sky.poll() is None, fail("pipeline 1 back")
            time.sleep(0.2)
        time.sleep(1.0)
        killed = time.time()
        os.killpg(slurm.pid, signal.SIGKILL)  # (node 0 gone without a notice: Slurm's NODE_FAIL)
        slurm.wait()
        time.sleep(2.0)
        gone = time.time()
        slurm = _slurm_job(fleet, "slurm0-requeued", 0, address, args, restarts=1)  # (--requeue)
        deadline = time.monotonic() + 200
        while not _heals(out, "0", gone):
            assert time.monotonic() < deadline and slurm.poll() is None and sky.poll() is None, fail("pipeline 0 back")
            time.sleep(0.2)
        time.sleep(1.0)
        stop.touch()
        codes = [slurm.wait(timeout=120), sky.wait(timeout=120)]
        assert codes == [0, 0], fail(f"exit codes {codes}")
    finally:
        sampler.done.set()
        fleet.close()
        coordinator.kill()
        coordinator.wait()
    assert "finished" in fleet.output("slurm0-requeued")
    assert not (tmp_path / "scontrol.log").exists(), "nothing was requeued by the script: the kill had no exit code"
    return {
        "notice_exit_seconds": left - noticed,
        "pause_during_notice_seconds": _longest_pause(sampler.samples, "0", noticed, relaunched),
        "pause_after_kill_seconds": _longest_pause(sampler.samples, "1", killed, gone),
    }


def _pytorchjob_pod(
    fleet: Fleet, name: str, index: int, coordinator: str, config: Path, snapshots: Path
) -> subprocess.Popen:
    """A worker pod of the elastic PyTorchJob (examples/deploy/kubernetes/elastic-pytorchjob.yaml): its container's
    ``lightning-spot run`` flags as written, with the environment the training operator gives a pod (its hostname,
    the ``PET_*`` variables, which lightning-spot run does not read); on this machine the coordinator Service's
    name is its address, one process per pod, and the test worker is the script."""
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "elastic-pytorchjob.yaml").read_text()))
    job = next(d for d in documents if d["kind"] == "PyTorchJob")
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    flags = _local_flags(container["command"], coordinator)
    policy = job["spec"]["elasticPolicy"]
    env = {"HOSTNAME": f"lightning-spot-elastic-worker-{index}", "PET_RDZV_BACKEND": policy["rdzvBackend"]}
    env.update(PET_RDZV_ENDPOINT=f"{policy['rdzvHost']}:{policy['rdzvPort']}", PET_NPROC_PER_NODE="gpu")
    env.update(
        PET_NNODES=f"{policy['minReplicas']}:{policy['maxReplicas']}", PET_MAX_RESTARTS=str(policy["maxRestarts"])
    )
    env["SPOT_TEST_SNAPSHOT_DIR"] = str(snapshots)  # (the memory of the pod's node)
    return fleet.start(name, [*flags, "tests/workers/elastic_train.py", str(config)], env)


def run_restart_fleet(tmp_path: Path, steps: int = 40, regrow: bool = True) -> dict[str, float]:
    """The restart path (no torchft): two worker pods of the elastic PyTorchJob on one coordinator, snapshots in
    host memory every step, one "node" each (its own snapshot folder). Pod b is killed (its node gone); pod a's
    agent restarts the job on itself from memory; with ``regrow``, a pod made again joins and the job grows back;
    all end (exit 0).
    Returns the first restart's time lost (the report's: from the last step before the loss to the first after);
    the final ranks' records are in ``tmp_path / "out" / "final"``."""
    from tests.elastic import port_open, wait_for

    rdzv_port, lighthouse_port = free_port(), free_port()
    coordinator = _coordinator(rdzv_port, lighthouse_port, tmp_path / "coordinator.log")
    # snapshots every step, durable only at the end: the restart resumes from memory; the pod made again joins
    # before the end
    config = snapshot_config(
        tmp_path,
        max_steps=steps,
        snapshot_every=1,
        strategy={"pipeline_stages": "auto", "microbatches": "auto"},
        **({"hold": {"world": 2, "step": steps - 8}} if regrow else {}),
    )
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    fleet = Fleet(tmp_path, {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    shm = {name: tmp_path / f"shm-{name}" for name in ("a", "b", "b2")}
    address = f"127.0.0.1:{rdzv_port}"

    def snapshot_steps(node: str) -> set[int]:
        return {int(p.parent.name.split("-")[1]) for p in shm[node].glob("*/step-*/rank*.json")}

    def pod(name: str, index: int, node: str) -> subprocess.Popen:
        return _pytorchjob_pod(fleet, name, index, address, config, shm[node])

    try:
        wait_for(lambda: port_open(rdzv_port), 90, "the coordinator", [])
        a, b = pod("pod-a", 0, "a"), pod("pod-b", 1, "b")
        deadline = time.monotonic() + 240
        while not any(s >= 4 for s in snapshot_steps("a")):
            assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, fleet.output("pod-a")
            time.sleep(0.2)
        os.killpg(b.pid, signal.SIGKILL)  # (its node gone: the pod is made again elsewhere)
        b.wait()
        deadline = time.monotonic() + 120
        while "in-memory snapshot" not in fleet.output("pod-a"):
            assert time.monotonic() < deadline and a.poll() is None, fleet.output("pod-a")
            time.sleep(0.2)
        again = pod("pod-b-again", 1, "b2") if regrow else None
        assert a.wait(timeout=300) == 0, fleet.output("pod-a")
        assert again is None or again.wait(timeout=120) == 0, fleet.output("pod-b-again")
    finally:
        fleet.close()
        coordinator.kill()
        coordinator.wait()
    report = torch.load(tmp_path / "out" / "final" / "rank0.pt")["report"]
    lost = report["restarts"][0]
    assert lost["cause"].startswith("failure") and lost["resumed_from"] == "memory", lost
    return {"restart_time_lost_seconds": float(lost["time_lost_seconds"]), "restarts": float(len(report["restarts"]))}
