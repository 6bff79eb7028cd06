"""The recipes in ``examples/deploy``: valid for their platform (checked offline by its own definitions: see
``checks``), the exit codes and grace periods set as lightning-spot needs, and each node's command one that
``lightning-spot run`` takes."""

from __future__ import annotations

import contextlib
import copy
import io
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.distributed import REPO
from tests.unit.deploy.checks import kubernetes_errors, pytorchjob_errors, sky_python, skypilot_tasks

DEPLOY = REPO / "examples" / "deploy"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
SKYPILOT = DEPLOY / "skypilot"
SBATCH = DEPLOY / "slurm" / "pipeline.sbatch"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _errors(document: dict[str, Any]) -> list[str]:
    return pytorchjob_errors(document) if document["kind"] == "PyTorchJob" else kubernetes_errors(document)


def _run_flags(command: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    """The torchrun command line (with its environment) that ``lightning-spot run`` makes of a recipe's command."""
    from lightning_spot.cli import main

    assert command[:2] == ["lightning-spot", "run"], command
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["run", "--dry-run", *command[2:]]) == 0
    return printed.getvalue()


def _shutdown_timeout(command: list[str]) -> int:
    joined = " ".join(command)
    found = re.search(r"--shutdown-timeout[= ](\d+)", joined)
    assert found, f"no --shutdown-timeout in {joined}: torchrun would kill the workers 30 s after the notice"
    return int(found[1])


@pytest.mark.parametrize("path", KUBERNETES, ids=lambda p: p.name)
def test_every_kubernetes_manifest_is_valid_for_kubernetes(path: Path) -> None:
    for document in _documents(path):
        assert _errors(document) == [], (path.name, document["kind"])


def test_a_misspelt_field_a_missing_name_or_an_unknown_crd_field_is_caught() -> None:
    """Kubernetes would apply the first and the last silently without the field; the checks refuse them."""
    job = next(d for d in _documents(DEPLOY / "kubernetes" / "torchft-pipelines.yaml") if d["kind"] == "Job")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["podFailurePolicies"] = misspelt["spec"].pop("podFailurePolicy")
    assert _errors(misspelt) == ["Job.spec.podFailurePolicies: not a field of V1JobSpec"]
    unnamed = copy.deepcopy(job)
    del unnamed["spec"]["template"]["spec"]["containers"][0]["name"]
    assert any("V1Container" in e and "name" in e for e in _errors(unnamed)), _errors(unnamed)
    elastic = next(
        d for d in _documents(DEPLOY / "kubernetes" / "elastic-pytorchjob.yaml") if d["kind"] == "PyTorchJob"
    )
    wrong = copy.deepcopy(elastic)
    wrong["spec"]["elasticPolicy"]["rdzvHosts"] = "coordinator"
    wrong["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["commands"] = []
    errors = _errors(wrong)
    assert any("'rdzvHosts' was unexpected" in e for e in errors), errors
    assert any("containers[0].commands: not a field of V1Container" in e for e in errors), errors


def test_each_kubernetes_pipeline_recovers_on_notices_and_lost_peers_and_fails_on_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One Indexed Job per pipeline: a disrupted pod or exit codes 75 and 69 make the pod again without counting a
    failure, exit code 1 fails the Job; the grace period covers the stop; each pipeline has its own
    REPLICA_GROUP_ID; the coordinator is not on spot nodes and the rendezvous is on it, also for the PyTorchJob."""
    documents = _documents(DEPLOY / "kubernetes" / "torchft-pipelines.yaml")
    jobs = [d for d in documents if d["kind"] == "Job"]
    assert len(jobs) >= 2
    groups = []
    for job in jobs:
        spec = job["spec"]
        rules = spec["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
        by_action = {r["action"]: sorted(r["onExitCodes"]["values"]) for r in rules[1:]}
        assert by_action == {"Ignore": [69, 75], "FailJob": [1]}
        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never"  # (what a podFailurePolicy requires)
        (container,) = pod["containers"]
        assert all(r["onExitCodes"]["containerName"] == container["name"] for r in rules[1:])
        assert pod["terminationGracePeriodSeconds"] > _shutdown_timeout(container["command"])
        env = {e["name"]: e["value"] for e in container["env"]}
        groups.append(env["REPLICA_GROUP_ID"])
        line = _run_flags(container["command"], monkeypatch, env)
        assert f"--rdzv-id=lightning-spot-pipeline-{env['REPLICA_GROUP_ID']}" in line, line
        assert "lightning-spot-coordinator:29400" in line and "is_host=false" in line, line
        assert "TORCHFT_LIGHTHOUSE=http://lightning-spot-coordinator:29510" in line, line
    assert len(set(groups)) == len(groups), "each pipeline needs its own REPLICA_GROUP_ID"
    coordinator = next(d for d in documents if d["kind"] == "Deployment")
    terms = coordinator["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    expression = terms["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expression == {"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}
    elastic = next(
        d for d in _documents(DEPLOY / "kubernetes" / "elastic-pytorchjob.yaml") if d["kind"] == "PyTorchJob"
    )
    policy = elastic["spec"]["elasticPolicy"]
    assert policy["rdzvHost"] == "lightning-spot-coordinator" and policy["rdzvPort"] == 29400
    (worker,) = elastic["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    line = _run_flags(worker["command"], monkeypatch, {})
    assert "--nnodes=1:4" in line and "lightning-spot-coordinator:29400" in line, line


def _sbatch_options(text: str) -> dict[str, str]:
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key] = value
    return options


def test_the_slurm_script_parses_requeues_on_notices_and_sizes_its_signal() -> None:
    """``bash -n``; ``--requeue``; the time-limit SIGTERM comes earlier than the stop takes; 75 requeues, 69
    relaunches (then requeues), any other code fails the job with it."""
    text = SBATCH.read_text()
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    options = _sbatch_options(text)
    assert "--requeue" in options and options["--ntasks-per-node"] == "1"
    signal, _, seconds = options["--signal"].partition("@")
    assert signal == "TERM", "the agents stop cleanly on SIGTERM (a B: prefix would reach only the batch shell)"
    assert int(seconds) > _shutdown_timeout(text.split())
    cases = dict(re.findall(r"^\s*(\d+|\*)\)(.*?)(?=^\s*(?:\d+|\*)\)|^\s*esac)", text, flags=re.M | re.S))
    assert "scontrol requeue" in cases["75"] and "exit 0" in cases["75"]
    assert "scontrol requeue" in cases["69"] and "launched again" in cases["69"]
    assert 'exit "$code"' in cases["*"]


@pytest.fixture(scope="module")
def sky_tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The recipes, and two copies of the pipeline's with a misspelt key each, as SkyPilot reads them."""
    python = sky_python()
    if python is None:
        pytest.skip("no SkyPilot environment (.venv-sky: bash scripts/quickstart.sh test makes it)")
    task = yaml.safe_load((SKYPILOT / "pipeline.yaml").read_text())
    misspelt = copy.deepcopy(task)
    misspelt["resources"]["use_spots"] = misspelt["resources"].pop("use_spot")
    recovery = copy.deepcopy(task)
    recovery["resources"]["job_recovery"]["recover_on_exit_code"] = [75]
    folder = tmp_path_factory.mktemp("sky")
    (folder / "misspelt.yaml").write_text(yaml.safe_dump(misspelt))
    (folder / "recovery.yaml").write_text(yaml.safe_dump(recovery))
    from lightning_spot.cli.deploy_recipes import Fleet, recipes

    fleet = Fleet(nodes=4, gpus=4, gpu_type="A100", script=USER_SCRIPT[0], args=USER_SCRIPT[1:])
    (folder / "generated.yaml").write_text(recipes("skypilot", fleet)["pipeline.yaml"])
    paths = [*sorted(SKYPILOT.glob("*.yaml")), *(folder / f"{n}.yaml" for n in ("misspelt", "recovery", "generated"))]
    return {Path(t["path"]).stem: t for t in skypilot_tasks(paths, python)}


def test_skypilot_reads_the_recipes_and_the_pipeline_recovers_on_75_and_69(
    sky_tasks: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline, coordinator = sky_tasks["pipeline"], sky_tasks["coordinator"]
    assert "error" not in pipeline and "error" not in coordinator, (pipeline, coordinator)
    assert pipeline["use_spot"] == [True] and coordinator["use_spot"] == [False]
    assert coordinator["ports"] == [["29400", "29510"]]
    (recovery,) = pipeline["recoveries"]
    assert recovery["strategy"] == "EagerFailoverStrategyExecutor" and recovery["unknown"] == []
    assert sorted(recovery["codes"]) == [69, 75] and recovery["restarts"] >= 0
    command = shlex.split(pipeline["run"].split("exec ", 1)[1].replace("\\\n", " "))
    env = {**pipeline["envs"], "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8", "COORDINATOR": "10.0.0.2"}
    expanded = [re.sub(r"\$(\w+)", lambda m: env[m[1]], word) for word in command]
    line = _run_flags(expanded, monkeypatch, env)
    assert "--nnodes=1:2" in line and "10.0.0.2:29400" in line and "--shutdown-timeout=25" in line, line


def test_skypilot_refuses_a_misspelt_key_and_the_check_a_misspelt_recovery_key(
    sky_tasks: dict[str, dict[str, Any]],
) -> None:
    """SkyPilot's client refuses a misspelt task or resources key; it lets a misspelt ``job_recovery`` key through
    (its server checks those): the check lists it."""
    assert "use_spots" in sky_tasks["misspelt"]["error"], sky_tasks["misspelt"]
    assert sky_tasks["recovery"]["recoveries"][0]["unknown"] == ["recover_on_exit_code"]


# ---------------------------------------------------------------- lightning-spot deploy (the recipes' generator)
USER_SCRIPT = ("train.py", "--lr", "3e-4", "--name", 'it\'s a "run" $HOME', "--fault-tolerance", "torchft")


def test_the_examples_are_the_generator_s_output_with_its_defaults() -> None:
    """``examples/deploy`` cannot drift from ``lightning-spot deploy``: each file is its output, byte for byte."""
    from lightning_spot.cli.deploy_recipes import Fleet, recipes

    made = {
        **{f"skypilot/{n}": t for n, t in recipes("skypilot", Fleet(), "examples/deploy/skypilot").items()},
        **{f"slurm/{n}": t for n, t in recipes("slurm", Fleet(), "examples/deploy/slurm").items()},
        **{f"kubernetes/{n}": t for n, t in recipes("kubernetes", Fleet(), "examples/deploy/kubernetes").items()},
        **{
            f"kubernetes/{n}": t
            for n, t in recipes("kubernetes", Fleet(restart_path=True, nodes=4), "examples/deploy/kubernetes").items()
        },
    }
    on_disk = {str(p.relative_to(DEPLOY)): p.read_text() for p in DEPLOY.rglob("*") if p.is_file()}
    assert sorted(made) == sorted(on_disk)
    stale = [name for name in made if made[name] != on_disk[name]]
    assert not stale, f"regenerate with lightning-spot deploy (see docs/deploy.md): {stale}"


def test_a_generated_fleet_of_three_pipelines_is_valid_and_carries_the_script_s_arguments_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three pipelines of four nodes, a script whose arguments hold spaces, quotes and ``$``: the Kubernetes file
    passes Kubernetes' models with three Jobs, the batch script parses and hands the arguments over unchanged, and
    the commands to start them are printed."""
    from lightning_spot.cli import main

    flags = ["--pipelines", "3", "--nodes", "4", "--gpus", "4", "--image", "reg.io/me/train:1"]
    for scheduler in ("kubernetes", "slurm"):
        assert main(["deploy", scheduler, *flags, "--out", str(tmp_path / scheduler), "--", *USER_SCRIPT]) == 0
    printed = capsys.readouterr().out
    assert f"kubectl apply -f {tmp_path}/kubernetes/torchft-pipelines.yaml" in printed
    assert printed.count("sbatch --export=ALL,REPLICA_GROUP_ID=") == 3
    documents = _documents(tmp_path / "kubernetes" / "torchft-pipelines.yaml")
    jobs = [d for d in documents if d["kind"] == "Job"]
    assert [_errors(d) for d in documents] == [[]] * len(documents)
    assert [j["spec"]["completions"] for j in jobs] == [4, 4, 4]
    for group, job in enumerate(jobs):
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["env"] == [{"name": "REPLICA_GROUP_ID", "value": str(group)}]
        assert container["image"] == "reg.io/me/train:1" and container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
        assert container["command"][-len(USER_SCRIPT) :] == list(USER_SCRIPT)
    sbatch = tmp_path / "slurm" / "pipeline.sbatch"
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    assert _sbatch_options(sbatch.read_text())["--nodes"] == "4"
    settings = ("DEFAULT_SCRIPT=", "DEFAULT_ARGS=", "SCRIPT=", "SCRIPT_ARGS=", 'eval "ARGS=')
    lines = [line for line in sbatch.read_text().splitlines() if line.startswith(settings)]
    shown = subprocess.run(
        ["bash", "-c", "\n".join([*lines, 'printf "%s\\n" "$SCRIPT" "${ARGS[@]}"'])],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nowhere"},
    ).stdout.splitlines()
    assert shown == list(USER_SCRIPT), "the script's arguments reach it as they were given"


def test_deploy_refuses_what_it_cannot_make(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_spot.cli import main

    with pytest.raises(SystemExit):
        main(["deploy", "slurm", "--restart-path"])
    assert "--restart-path is for kubernetes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["deploy", "nomad"])


def test_a_generated_skypilot_pipeline_is_read_by_skypilot_and_hands_the_arguments_over_whole(
    sky_tasks: dict[str, dict[str, Any]],
) -> None:
    generated = sky_tasks["generated"]
    assert "error" not in generated and generated["num_nodes"] == 4, generated
    env = {**generated["envs"], "PATH": "/usr/bin:/bin", "HOME": "/nowhere"}
    evaluated = next(line.strip() for line in generated["run"].splitlines() if line.strip().startswith("eval "))
    shown = subprocess.run(
        ["bash", "-c", f'{evaluated}\nprintf "%s\\n" "$SCRIPT" "${{ARGS[@]}}"'],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.splitlines()
    assert shown == list(USER_SCRIPT)
