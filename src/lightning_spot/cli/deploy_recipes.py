"""The scheduler recipes of ``lightning-spot deploy`` (and of ``examples/deploy``, which are its output with the
defaults): text templates whose ``{{name}}`` fields a :class:`Fleet` fills.

    files = recipes("kubernetes", Fleet(pipelines=3, nodes=2, gpus=8, image="ghcr.io/me/train:1"))
    # {"torchft-pipelines.yaml": "...", ...}; commands("kubernetes", fleet, "deploy/kubernetes") says how to start them

One scheduler job per pipeline (``fault_tolerance="torchft"``, ``REPLICA_GROUP_ID`` per job) beside a coordinator
on a node that stays; exit codes as ``lightning-spot run`` gives them (0 done, 75 notice, 69 lost peers, 1 error);
grace periods longer than the stop (``--shutdown-timeout``). See docs/deploy.md.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from dataclasses import dataclass

SCHEDULERS = ("skypilot", "kubernetes", "slurm")
#: seconds a scheduler waits after its SIGTERM beyond the agent's own --shutdown-timeout (the agent's leave)
GRACE_MARGIN_S = 5
#: Slurm signals the job this long before its time limit, beyond the stop (srun and the requeue)
SLURM_SIGNAL_MARGIN_S = 30


@dataclass(frozen=True)
class Fleet:
    """What the recipes are made for: the pipelines, each of ``nodes`` nodes of ``gpus`` GPUs, and the training
    command (``script`` with ``args``; default: the example GPT with torchft and checkpoints in ``checkpoints``)."""

    pipelines: int = 2
    nodes: int = 2
    gpus: int = 8
    gpu_type: str = "H100"
    image: str = "IMAGE"
    checkpoints: str = "s3://my-bucket/runs/gpt"
    script: str = "examples/gpt/train.py"
    args: tuple[str, ...] | None = None
    restart_path: bool = False  # Kubernetes: one elastic PyTorchJob (no torchft) instead of a Job per pipeline
    shutdown_timeout: int = 25
    slurm_shutdown_timeout: int = 60

    def script_args(self) -> list[str]:
        if self.args is not None:
            return list(self.args)
        mode = ["--pipeline-stages", "auto"] if self.restart_path else ["--fault-tolerance", "torchft"]
        return ["--accelerator", "gpu", "--devices", str(self.gpus), *mode, "--checkpoint-dir", self.checkpoints]


def _yaml_word(word: str) -> str:
    """A YAML scalar for ``word``: as it is when YAML reads it back as that string, else JSON-quoted."""
    plain = re.fullmatch(r"[A-Za-z0-9_./:=+@%-]+", word) and not re.fullmatch(r"[-+.\d]+|true|false|null|~", word)
    return word if plain else json.dumps(word)


def _fill(template: str, **values: object) -> str:
    def value(match: re.Match[str]) -> str:
        if match[1] not in values:
            raise KeyError(f"the template's field {match[1]!r} has no value")
        return str(values[match[1]])

    return re.sub(r"\{\{(\w+)\}\}", value, template)


def recipes(scheduler: str, fleet: Fleet, folder: str = ".") -> dict[str, str]:
    """The files (name -> text) of ``scheduler``'s recipe for ``fleet``, to be written to ``folder`` (which their
    comments name)."""
    args = fleet.script_args()
    common = {"nodes": fleet.nodes, "gpus": fleet.gpus, "script": fleet.script, "folder": folder}
    if scheduler == "skypilot":
        return {
            "coordinator.yaml": _fill(SKYPILOT_COORDINATOR, folder=folder),
            "pipeline.yaml": _fill(
                SKYPILOT_PIPELINE,
                **common,
                gpu_type=fleet.gpu_type,
                shutdown=fleet.shutdown_timeout,
                args=json.dumps(shlex.join(args)),
            ),
        }
    if scheduler == "kubernetes":
        grace = fleet.shutdown_timeout + GRACE_MARGIN_S
        words = ["--nproc-per-node=gpu", f"--shutdown-timeout={fleet.shutdown_timeout}", fleet.script, *args]
        command = "".join(f"\n      - {_yaml_word(w)}" for w in words)  # (the container's command list)
        values = {**common, "image": fleet.image, "grace": grace}

        def pod(depth: int, container: str, env: str) -> str:
            text = _fill(_SPOT_POD, **values, container=container, container_env=env, command=command)
            return textwrap.indent(text, " " * depth)

        if fleet.restart_path:
            return {"elastic-pytorchjob.yaml": _fill(KUBERNETES_ELASTIC, **values, pod=pod(10, "pytorch", ""))}
        jobs = "".join(
            _fill(KUBERNETES_JOB, **values, group=g, pod=pod(6, "trainer", REPLICA_GROUP_ENV.format(g)))
            for g in range(fleet.pipelines)
        )
        return {"torchft-pipelines.yaml": _fill(KUBERNETES_HEAD, image=fleet.image, folder=folder) + jobs}
    if scheduler == "slurm":
        shutdown = fleet.slurm_shutdown_timeout
        return {
            "pipeline.sbatch": _fill(
                SLURM_PIPELINE,
                **{**common, "script": shlex.quote(fleet.script)},
                shutdown=shutdown,
                signal=shutdown + SLURM_SIGNAL_MARGIN_S,
                args=shlex.quote(shlex.join(args)),
            ),
            "lightning-spot-coordinator.service": _fill(SLURM_COORDINATOR, folder=folder),
        }
    raise ValueError(f"unknown scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}")


def commands(scheduler: str, fleet: Fleet, folder: str) -> list[str]:
    """The commands that start ``fleet`` from the recipe written to ``folder``."""
    if scheduler == "skypilot":
        launch = [f"sky launch -c spot-coordinator {folder}/coordinator.yaml"]
        return launch + [
            f"sky jobs launch -n pipeline-{g} {folder}/pipeline.yaml --env REPLICA_GROUP_ID={g} "
            f"--env COORDINATOR=$(sky status --ip spot-coordinator)"
            for g in range(fleet.pipelines)
        ]
    if scheduler == "kubernetes":
        name = "elastic-pytorchjob.yaml" if fleet.restart_path else "torchft-pipelines.yaml"
        return [f"kubectl apply -f {folder}/{name}"]
    if scheduler == "slurm":
        return [
            f"sudo cp {folder}/lightning-spot-coordinator.service /etc/systemd/system/",
            "sudo systemctl enable --now lightning-spot-coordinator",
        ] + [
            f"sbatch --export=ALL,REPLICA_GROUP_ID={g},COORDINATOR=$(hostname) {folder}/pipeline.sbatch"
            for g in range(fleet.pipelines)
        ]
    raise ValueError(f"unknown scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}")


EXIT_CODES = """\
# Exit codes (lightning-spot run): 0 training ended; 75 stopped by a notice; 69 restarts spent on lost peers;
# 1 an error of the training code."""

SKYPILOT_COORDINATOR = """\
# The coordinator of a lightning-spot job: every pipeline's rendezvous store (:29400) and the torchft lighthouse
# (:29510), one small process on an on-demand VM that outlives the spot nodes.
#
#   sky launch -c spot-coordinator {{folder}}/coordinator.yaml
#   sky status --ip spot-coordinator          # -> COORDINATOR of every pipeline (pipeline.yaml)
#
# Run from a checkout of your code with lightning-spot (workdir: the current directory). The ports are opened to
# the pipelines' VMs; on one cloud and network, their private address works as well.
name: lightning-spot-coordinator

resources:
  cpus: 2+
  use_spot: false  # it must not be preempted: a restart within the timeouts stops no pipeline, a loss stops all
  ports: [29400, 29510]

workdir: .

# (a checkout of lightning-spot; for your own project: pip install "lightning-spot[ft]" and its requirements)
setup: |
  pip install ".[ft]"

run: |
  lightning-spot coordinator --rdzv-port 29400 --lighthouse-port 29510
"""

SKYPILOT_PIPELINE = (
    """\
# One pipeline of a lightning-spot job as a SkyPilot managed job: launch one per pipeline, each with its own
# REPLICA_GROUP_ID. SkyPilot relaunches a managed job's whole cluster when one of its nodes is preempted; with one
# job per pipeline (fault_tolerance="torchft") the other pipelines train on meanwhile and the relaunched one takes
# their state when it is back.
#
#   sky jobs launch -n pipeline-0 {{folder}}/pipeline.yaml \\
#       --env REPLICA_GROUP_ID=0 --env COORDINATOR=$(sky status --ip spot-coordinator)
#
"""
    + EXIT_CODES
    + """
# SkyPilot recovers on 75 and 69 (recover_on_exit_codes: not counted as errors) and fails the job on 1 after
# max_restarts_on_errors.
name: lightning-spot-pipeline

num_nodes: {{nodes}}  # nodes of this pipeline (its stages)

resources:
  accelerators: {{gpu_type}}:{{gpus}}
  use_spot: true
  job_recovery:
    strategy: EAGER_NEXT_REGION
    max_restarts_on_errors: 1
    recover_on_exit_codes: [75, 69]

envs:
  REPLICA_GROUP_ID: "0"  # 0, 1, 2...: one managed job each
  COORDINATOR: ""  # the coordinator's address (coordinator.yaml)
  SCRIPT: {{script}}
  SCRIPT_ARGS: {{args}}

workdir: .

# (a checkout of lightning-spot; for your own project: pip install "lightning-spot[ft]" s3fs and its requirements)
setup: |
  pip install ".[ft]" s3fs

# Every node runs the same command; torchrun's rendezvous on the coordinator forms the pipeline from the nodes that
# arrive (1 to SKYPILOT_NUM_NODES). {{shutdown}} s to stop cleanly after a notice: inside GCP's 30 s, AWS's 120 s.
run: |
  if [ -z "$COORDINATOR" ]; then echo "set COORDINATOR (sky status --ip spot-coordinator)" >&2; exit 1; fi
  eval "ARGS=($SCRIPT_ARGS)"  # the script's arguments, split as a shell splits them
  exec lightning-spot run --coordinator "$COORDINATOR" --nnodes "1:$SKYPILOT_NUM_NODES" \\
    --nproc-per-node "$SKYPILOT_NUM_GPUS_PER_NODE" --shutdown-timeout {{shutdown}} "$SCRIPT" "${ARGS[@]}"
"""
)

_COORDINATOR_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: lightning-spot-coordinator
  labels: {app: lightning-spot-coordinator}
spec:
  replicas: 1
  strategy: {type: Recreate}  # never two coordinators: a restart within the timeouts stops no pipeline
  selector:
    matchLabels: {app: lightning-spot-coordinator}
  template:
    metadata:
      labels: {app: lightning-spot-coordinator}
    spec:
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchExpressions:
                  - {key: cloud.google.com/gke-spot, operator: DoesNotExist}
      containers:
        - name: coordinator
          image: {{image}}
          command: [lightning-spot, coordinator, --rdzv-port, "29400", {{lighthouse}}]
          ports:
            - {name: rendezvous, containerPort: 29400}{{lighthouse_port}}
          resources:
            requests: {cpu: "1", memory: 2Gi}
---
apiVersion: v1
kind: Service
metadata:
  name: lightning-spot-coordinator
spec:
  selector: {app: lightning-spot-coordinator}
  ports:
    - {name: rendezvous, port: 29400, targetPort: 29400}{{lighthouse_service}}
"""

KUBERNETES_HEAD = (
    """\
# A lightning-spot job on Kubernetes with fault_tolerance="torchft": the coordinator (rendezvous store and torchft
# lighthouse) on an on-demand node, and one Indexed Job per pipeline on spot nodes. A reclaimed spot node or an
# evicted pod costs its pipeline a restart (the pod is made again, not counted as a failure); the other pipelines
# train on, and the restarted one takes their state when it is back.
#
#   kubectl apply -f {{folder}}/torchft-pipelines.yaml
#
# IMAGE: an image with your training code and lightning-spot installed (docs/deploy.md has a Dockerfile).
# Spot and on-demand nodes are told apart by GKE's label cloud.google.com/gke-spot (on EKS: eks.amazonaws.com/
# capacityType SPOT / ON_DEMAND); on a cluster without it the affinities match every node.
"""
    + EXIT_CODES
    + """
# 75 and 69 are ignored by the podFailurePolicy (the pod is made again); 1 fails the Job.
"""
    + _fill(
        _COORDINATOR_DEPLOYMENT,
        image="{{image}}",
        lighthouse='--lighthouse-port, "29510"',
        lighthouse_port="\n            - {name: lighthouse, containerPort: 29510}",
        lighthouse_service="\n    - {name: lighthouse, port: 29510, targetPort: 29510}",
    )
)

#: the training container's environment in a pipeline's Job (in ``_SPOT_POD``, one level below the container)
REPLICA_GROUP_ENV = '\n    env:\n      - {{name: REPLICA_GROUP_ID, value: "{0}"}}'

#: a spot pod's spec after its restart policy and grace period, at the top level (each recipe indents it): on spot
#: nodes, one training container, host memory on /dev/shm
_SPOT_POD = """\
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - {key: cloud.google.com/gke-spot, operator: In, values: ["true"]}
containers:
  - name: {{container}}
    image: {{image}}{{container_env}}
    command:
      - lightning-spot
      - run
      - --coordinator=lightning-spot-coordinator
      - --nnodes=1:{{nodes}}{{command}}
    resources:
      limits: {nvidia.com/gpu: "{{gpus}}"}
    volumeMounts:
      - {name: snapshots, mountPath: /dev/shm}
volumes:
  - name: snapshots  # host-memory snapshots (and NCCL's shared memory)
    emptyDir: {medium: Memory}
"""

KUBERNETES_JOB = """\
---
apiVersion: batch/v1
kind: Job
metadata:
  name: lightning-spot-pipeline-{{group}}
  labels: {app: lightning-spot-pipeline, pipeline: "{{group}}"}
spec:
  completionMode: Indexed
  completions: {{nodes}}  # the pipeline's nodes (its stages); one pod per node
  parallelism: {{nodes}}
  backoffLimit: 2  # errors of the training code; notices and lost nodes do not count (podFailurePolicy)
  podReplacementPolicy: Failed  # a replacement starts once the old pod is gone (one pod per index)
  podFailurePolicy:
    rules:
      - action: Ignore  # a spot node reclaimed, a pod evicted or preempted
        onPodConditions:
          - type: DisruptionTarget
      - action: Ignore  # 75: stopped by a notice; 69: restarts spent on lost peers
        onExitCodes:
          containerName: trainer
          operator: In
          values: [75, 69]
      - action: FailJob  # an error of the training code, after lightning-spot run's own --max-failures restarts
        onExitCodes:
          containerName: trainer
          operator: In
          values: [1]
  template:
    metadata:
      labels: {app: lightning-spot-pipeline, pipeline: "{{group}}"}
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: {{grace}}  # the notice's stop (--shutdown-timeout) and the agent's leave
{{pod}}"""

KUBERNETES_ELASTIC = (
    """\
# The restart path on Kubernetes (no torchft): one elastic job of 1 to {{nodes}} nodes as a Kubeflow PyTorchJob
# (training operator v1), its rendezvous on the coordinator (on an on-demand node) instead of the operator's default,
# the first worker pod (a spot pod like the others: losing it would lose the rendezvous). A lost node restarts the
# job on the nodes left, at another pipeline-depth x data-parallel layout, from the newest snapshot or checkpoint.
#
#   kubectl apply -f {{folder}}/elastic-pytorchjob.yaml
#
# IMAGE: an image with your training code and lightning-spot installed (docs/deploy.md has a Dockerfile).
# The operator's PET_* variables are not read: lightning-spot run sets the rendezvous itself.
"""
    + _fill(
        _COORDINATOR_DEPLOYMENT,
        image="{{image}}",
        lighthouse="--no-lighthouse",
        lighthouse_port="",
        lighthouse_service="",
    )
    + """\
---
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: lightning-spot-elastic
spec:
  nprocPerNode: gpu
  elasticPolicy:
    rdzvBackend: c10d
    rdzvHost: lightning-spot-coordinator  # not worker-0: the rendezvous outlives any spot pod
    rdzvPort: 29400
    minReplicas: 1
    maxReplicas: {{nodes}}
    maxRestarts: 100  # preemptions and lost peers; errors of the code: lightning-spot run's --max-failures
  runPolicy:
    backoffLimit: 100
  pytorchReplicaSpecs:
    Worker:
      replicas: {{nodes}}
      restartPolicy: OnFailure
      template:
        spec:
          terminationGracePeriodSeconds: {{grace}}
{{pod}}"""
)

SLURM_PIPELINE = (
    """\
#!/bin/bash
# One pipeline of a lightning-spot job as a Slurm job: submit one per pipeline (fault_tolerance="torchft"), the
# coordinator running on a node that stays (lightning-spot-coordinator.service, e.g. on the head node).
#
#   sbatch --export=ALL,REPLICA_GROUP_ID=0,COORDINATOR=head-node {{folder}}/pipeline.sbatch
#
# Spot nodes (ParallelCluster, slurm-gcp) are reclaimed without a signal to the job: Slurm ends it with NODE_FAIL
# and, with --requeue, queues it again; meanwhile the other pipelines train on. Before the time limit Slurm sends
# SIGTERM to lightning-spot run (--signal): it stops cleanly (exit 75) and the job is queued again.
"""
    + EXIT_CODES
    + """
# 75 requeues the job; 69 launches again in this allocation (up to MAX_RELAUNCHES, then requeues); 1 fails it.
#SBATCH --job-name=lightning-spot-pipeline
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={{gpus}}
#SBATCH --requeue
#SBATCH --signal=TERM@{{signal}}
#SBATCH --open-mode=append
#SBATCH --output=lightning-spot-%x-%j.out
set -uo pipefail

: "${COORDINATOR:?set COORDINATOR to the host that runs lightning-spot coordinator}"
export REPLICA_GROUP_ID="${REPLICA_GROUP_ID:-0}"
DEFAULT_SCRIPT={{script}}
DEFAULT_ARGS={{args}}
SCRIPT="${SCRIPT:-$DEFAULT_SCRIPT}"
SCRIPT_ARGS="${SCRIPT_ARGS:-$DEFAULT_ARGS}"
eval "ARGS=($SCRIPT_ARGS)"  # the script's arguments, split as a shell splits them
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"
MAX_RELAUNCHES="${MAX_RELAUNCHES:-3}"
NODES="${SLURM_JOB_NUM_NODES:?run under sbatch}"

for ((launch = 0; ; launch++)); do
  # every node runs the agent; the pipeline forms from the nodes that reach the coordinator's rendezvous
  srun --kill-on-bad-exit=0 --ntasks-per-node=1 \\
    lightning-spot run --coordinator "$COORDINATOR" --nnodes "1:$NODES" --nproc-per-node "$NPROC_PER_NODE" \\
    --shutdown-timeout {{shutdown}} "$SCRIPT" "${ARGS[@]}"
  code=$?
  case "$code" in
    0) echo "lightning-spot: pipeline $REPLICA_GROUP_ID finished"; exit 0 ;;
    75)
      echo "lightning-spot: pipeline $REPLICA_GROUP_ID stopped by a notice: requeued"
      scontrol requeue "$SLURM_JOB_ID"
      exit 0
      ;;
    69)
      if ((launch >= MAX_RELAUNCHES)); then
        echo "lightning-spot: pipeline $REPLICA_GROUP_ID lost peers $((launch + 1)) times: requeued"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
      fi
      echo "lightning-spot: pipeline $REPLICA_GROUP_ID lost peers: launched again"
      ;;
    *) echo "lightning-spot: pipeline $REPLICA_GROUP_ID failed (exit code $code)" >&2; exit "$code" ;;
  esac
done
"""
)

SLURM_COORDINATOR = """\
# The coordinator of lightning-spot jobs on a Slurm cluster's head node (or any node that is not spot):
#
#   sudo cp {{folder}}/lightning-spot-coordinator.service /etc/systemd/system/
#   sudo systemctl enable --now lightning-spot-coordinator
#
# ExecStart: the lightning-spot command of the environment the jobs use. A restart within the timeouts (the
# stores' 120 s, torchft's quorum_timeout) stops no pipeline; a longer outage ends every node with exit code 69,
# which the job scripts relaunch: they resume from the newest durable checkpoint once the coordinator is back.
[Unit]
Description=lightning-spot coordinator (rendezvous store :29400, torchft lighthouse :29510)
After=network-online.target
Wants=network-online.target

[Service]
ExecStart=/opt/lightning-spot/venv/bin/lightning-spot coordinator --rdzv-port 29400 --lighthouse-port 29510
Restart=always
RestartSec=1
KillSignal=SIGTERM

[Install]
WantedBy=multi-user.target
"""
