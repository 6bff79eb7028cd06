"""Offline checks of the deployment recipes in ``examples/deploy``, each by its platform's own definitions.

    kubernetes_errors(document)          # a Deployment, Service or Job: Kubernetes' Python models, no unknown key
    pytorchjob_errors(document)          # a PyTorchJob: the training operator's CRD schema (pod templates: models)
    skypilot_tasks([path, ...])          # SkyPilot's own Task.from_yaml and recovery strategies (its venv, see below)

Kubernetes drops fields it does not know when it applies a manifest (a misspelt ``podFailurePolicy`` is a Job
without one), and SkyPilot's client lets unknown ``job_recovery`` keys through to its server: here both are errors.
SkyPilot (~550 MB with its dependencies, and ``click<8.2``) lives in a virtual environment of its own,
``$LIGHTNING_SPOT_SKY_PYTHON`` or ``.venv-sky`` (``scripts/quickstart.sh`` makes it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from tests.distributed import REPO

SCHEMA = Path(__file__).with_name("pytorchjob-v1-schema.json")
#: the Kubernetes model of each kind the recipes use
MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service", ("batch/v1", "Job"): "V1Job"}


def _unknown_keys(data: Any, model: str, path: str) -> list[str]:
    """Keys of ``data`` that Kubernetes' model ``model`` (e.g. ``V1Job``, ``list[V1Container]``) does not have."""
    from kubernetes import client

    if data is None:
        return []
    if inner := re.fullmatch(r"[Ll]ist\[(.+)\]", model):
        return [e for i, item in enumerate(data) for e in _unknown_keys(item, inner[1], f"{path}[{i}]")]
    if inner := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", model):
        value_model = inner[1] or inner[2]
        return [e for k, item in data.items() for e in _unknown_keys(item, value_model, f"{path}.{k}")]
    klass = getattr(client, model, None)
    if klass is None:  # str, int, bool, object, datetime...
        return []
    if not isinstance(data, dict):
        return [f"{path}: {model} is an object, not {data!r}"]
    by_key = {key: name for name, key in klass.attribute_map.items()}
    errors = [f"{path}.{key}: not a field of {model}" for key in data if key not in by_key]
    for key, value in data.items():
        if key in by_key:
            errors += _unknown_keys(value, klass.openapi_types[by_key[key]], f"{path}.{key}")
    return errors


def _model_errors(data: dict[str, Any], model: str, path: str) -> list[str]:
    """Unknown keys, then what the model refuses (a missing required field, a value of the wrong type)."""
    from kubernetes import client

    errors = _unknown_keys(data, model, path)
    if not errors:
        try:
            getattr(client, model).from_dict(data)
        except (ValueError, TypeError) as err:  # (pydantic's ValidationError is a ValueError)
            errors.append(f"{path}: {err}")
    return errors


def kubernetes_errors(document: dict[str, Any]) -> list[str]:
    """What Kubernetes' own models find wrong in a Deployment, Service or Job manifest."""
    model = MODELS.get((document.get("apiVersion"), document.get("kind")))
    if model is None:
        return [f"{document.get('apiVersion')}/{document.get('kind')}: no model to check it against"]
    return _model_errors(document, model, document["kind"])


def pytorchjob_errors(document: dict[str, Any]) -> list[str]:
    """What the PyTorchJob v1 CRD's schema (``SCHEMA``) and Kubernetes' pod template model find wrong."""
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"PyTorchJob.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    for name, replicas in document.get("spec", {}).get("pytorchReplicaSpecs", {}).items():
        errors += _model_errors(replicas.get("template", {}), "V1PodTemplateSpec", f"PyTorchJob.{name}.template")
    return errors


def sky_python() -> Path | None:
    """The interpreter of the virtual environment that has SkyPilot, if there is one."""
    configured = os.environ.get("LIGHTNING_SPOT_SKY_PYTHON")
    candidate = Path(configured) if configured else REPO / ".venv-sky" / "bin" / "python"
    return candidate if candidate.exists() else None


SKY_CHECK = """
import json, sys
import sky
from sky.utils import registry
out = []
for path in sys.argv[1:]:
    try:
        task = sky.Task.from_yaml(path)
    except Exception as err:  # (SkyPilot's refusal, with its message)
        out.append({"path": path, "error": f"{type(err).__name__}: {err}"})
        continue
    recoveries = []
    for resources in task.resources:
        recovery = resources.job_recovery
        if isinstance(recovery, dict):
            recovery = dict(recovery)
            name = recovery.pop("strategy", None)
            codes = recovery.pop("recover_on_exit_codes", None)
            restarts = recovery.pop("max_restarts_on_errors", 0)
            strategy = registry.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(name)
            recoveries.append({"strategy": strategy.__name__ if strategy else None, "codes": codes,
                               "restarts": restarts, "unknown": sorted(recovery)})
        else:
            recoveries.append({"strategy": recovery})
    out.append({"path": path, "num_nodes": task.num_nodes, "envs": dict(task.envs), "run": task.run,
                 "use_spot": [r.use_spot for r in task.resources], "ports": [r.ports for r in task.resources],
                 "recoveries": recoveries})
print(json.dumps(out))
"""


def skypilot_tasks(paths: list[Path], python: Path) -> list[dict[str, Any]]:
    """Each SkyPilot task YAML as SkyPilot itself reads it (``error``: SkyPilot's message when it refuses one), in
    one process (importing SkyPilot takes seconds)."""
    proc = subprocess.run([str(python), "-c", SKY_CHECK, *map(str, paths)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"the SkyPilot check did not run: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
