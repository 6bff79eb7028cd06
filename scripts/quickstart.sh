#!/usr/bin/env bash
# Set up a virtual environment (once) and run the demo or the test suite.
#
#   bash scripts/quickstart.sh demo    # train the example GPT on 4 CPU processes (P2 x D2)
#   bash scripts/quickstart.sh test    # lint, format and type checks, then the whole test suite
#   bash scripts/quickstart.sh check   # only the lint, format and type checks (ruff, mypy)
#
# torch is installed first, pinned, so that pip never pulls a multi-GB CUDA build by accident.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" PIP_INDEX_URL=...), VENV, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
LITDATA_SPEC="litdata==0.2.76"  # pinned: lightning_spot.data.streams.LITDATA_VERSION
what="${1:-}"
shift || true

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "quickstart: creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "quickstart: installing $TORCH_SPEC"
    "$py" -m pip install --quiet "$TORCH_SPEC"
  fi
  if ! "$py" -c "import lightning_spot, pytest, pytest_timeout, moto, jsonargparse, matplotlib, ruff, mypy, transformers, torchdata, peft, kubernetes, jsonschema" >/dev/null 2>&1; then
    echo "quickstart: installing lightning-spot with its test extras"
    "$py" -m pip install --quiet -e ".[test]"
  fi
  if ! "$py" -c "import litdata" >/dev/null 2>&1; then
    # without its dependencies: LitData's torchvision requirement would replace the CPU torch with a CUDA build
    # (the ones it needs to import come with the [stream] extra, part of [test])
    echo "quickstart: installing $LITDATA_SPEC (--no-deps)"
    "$py" -m pip install --quiet --no-deps "$LITDATA_SPEC"
  fi
}

sky_setup() {
  # SkyPilot reads the SkyPilot recipes in the tests (tests/unit/deploy); its dependencies (click<8.2) stay out of
  # $VENV. Best effort: without it those two tests are skipped.
  local sky="${VENV_SKY:-.venv-sky}"
  export LIGHTNING_SPOT_SKY_PYTHON="$sky/bin/python"
  if [ ! -x "$sky/bin/python" ] || ! "$sky/bin/python" -c "import sky" >/dev/null 2>&1; then
    echo "quickstart: installing SkyPilot into $sky (for the recipe checks)"
    { "$PYTHON" -m venv "$sky" && "$sky/bin/python" -m pip install --quiet "skypilot==0.14.1"; } \
      || echo "quickstart: SkyPilot could not be installed; its recipe checks will be skipped" >&2
  fi
}

checks() {
  echo "quickstart: ruff check, ruff format --check, mypy"
  "$VENV/bin/python" -m ruff check .
  "$VENV/bin/python" -m ruff format --check --quiet .
  "$VENV/bin/python" -m mypy
}

case "$what" in
  demo)
    setup
    exec "$VENV/bin/python" examples/gpt/train.py "$@"
    ;;
  check)
    setup
    checks
    ;;
  test)
    setup
    sky_setup
    checks
    exec "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: bash scripts/quickstart.sh {demo|test|check} [extra args]" >&2
    exit 2
    ;;
esac
