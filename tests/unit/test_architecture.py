"""The import layering of docs/architecture.md, checked from the code: a module imports only from lower rows
of the table or from its own room (package), never upward or sideways."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "lightning_spot"

#: room -> row, as in docs/architecture.md ("Layers")
ROWS = {
    "cli": 8,
    "__init__": 7,
    "strategy": 6,
    "observe": 5,
    "torchft": 5,
    "planning": 4,
    "checkpoint": 4,
    "runtime": 3,
    "partition": 2,
    "data": 2,
    "watchdog": 2,
    "layout": 1,
    "preemption": 1,
    "replay": 0,
    "utils": 0,
    "_version": 0,
}


def _room(module: str) -> str:
    """``lightning_spot.checkpoint.durable.read`` -> ``checkpoint``; ``lightning_spot`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "lightning_spot"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_spot":
            found.add(node.module)
    return found


def test_every_module_belongs_to_a_row() -> None:
    rooms = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    assert rooms <= set(ROWS), f"add these to docs/architecture.md and ROWS: {sorted(rooms - set(ROWS))}"


def test_imports_run_downward_only() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        room = path.stem if len(rel.parts) == 1 else rel.parts[0]
        for module in _imports(path):
            target = _room(module)
            if target != room and ROWS[target] >= ROWS[room]:
                wrong.append(f"{rel} (row {ROWS[room]}) imports {module} (row {ROWS[target]})")
    assert not wrong, "imports that run up or sideways:\n  " + "\n  ".join(wrong)


def test_every_package_has_unit_tests() -> None:
    """Tests follow the code: each package of ``lightning_spot`` has its unit tests in ``tests/unit/<package>/``
    (in one process); the multi-process scenarios are apart, in ``tests/integration/``."""
    unit = Path(__file__).resolve().parent
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    missing = [name for name in packages if not list((unit / name).glob("test_*.py"))]
    assert packages and not missing, f"packages without unit tests in tests/unit/: {missing}"
