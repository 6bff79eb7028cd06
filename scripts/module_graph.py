"""Draw the package's module graph from its imports: rooms (top-level modules and subpackages) in rows, each room
above the rooms it imports, arrows for imports (red where rooms import each other in a cycle).

    python scripts/module_graph.py --out docs/images/architecture.png
    python scripts/module_graph.py --src OTHER_CHECKOUT/src/lightning_spot --out before.png --title "before"

Each room's box gives its lines and its largest class; the rows are computed from the imports (a room with no
imports of the package at the bottom), so the script reads any version of the package.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = "lightning_spot"


def room_of(path: Path, src: Path) -> str:
    rel = path.relative_to(src)
    return rel.stem if len(rel.parts) == 1 else rel.parts[0]


def read_rooms(src: Path) -> tuple[dict[str, int], dict[str, tuple[str, int]], dict[tuple[str, str], int]]:
    """(lines per room, largest class per room, imports between rooms counted by statement)."""
    lines: dict[str, int] = defaultdict(int)
    largest: dict[str, tuple[str, int]] = {}
    edges: dict[tuple[str, str], int] = defaultdict(int)
    for path in sorted(src.rglob("*.py")):
        room = room_of(path, src)
        text = path.read_text()
        lines[room] += text.count("\n")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > largest.get(room, ("", 0))[1]:
                    largest[room] = (node.name, size)
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            for target in targets:
                parts = target.split(".")
                if parts[0] == PACKAGE:
                    other = parts[1] if len(parts) > 1 else "__init__"
                    if other != room:
                        edges[(room, other)] += 1
    return dict(lines), largest, dict(edges)


def cycles(rooms: list[str], edges: dict[tuple[str, str], int]) -> set[tuple[str, str]]:
    """The edges inside strongly connected groups of rooms (Tarjan's algorithm)."""
    out: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        out[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    group: dict[str, int] = {}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in out[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                group[w] = index[v]
                if w == v:
                    break

    for room in rooms:
        if room not in index:
            visit(room)
    return {(a, b) for a, b in edges if group[a] == group[b]}


def rows(rooms: list[str], edges: dict[tuple[str, str], int], cyclic: set[tuple[str, str]]) -> dict[str, int]:
    """Each room's row: one above the highest room it imports (edges inside a cycle ignored)."""
    out: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        if (a, b) not in cyclic:
            out[a].append(b)
    row: dict[str, int] = {}

    def of(room: str) -> int:
        if room not in row:
            row[room] = 0
            row[room] = 1 + max((of(b) for b in out[room]), default=-1)
        return row[room]

    for room in rooms:
        of(room)
    return row


def draw(src: Path, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    lines, largest, edges = read_rooms(src)
    rooms = sorted(lines)
    cyclic = cycles(rooms, edges)
    row = rows(rooms, edges, cyclic)
    by_row: dict[int, list[str]] = defaultdict(list)
    for room in sorted(rooms, key=lambda r: -lines[r]):
        by_row[row[room]].append(room)
    width = max(sum(1.2 + (lines[r] / 1000) ** 0.5 for r in rs) for rs in by_row.values())
    fig, ax = plt.subplots(figsize=(max(10.0, width * 1.6), 1.9 * (max(by_row) + 1) + 1))
    centre: dict[str, tuple[float, float]] = {}
    for r, members in by_row.items():
        total = sum(1.2 + (lines[m] / 1000) ** 0.5 for m in members)
        x = (width - total) / 2
        for m in members:
            w = 1.0 + (lines[m] / 1000) ** 0.5
            y = r * 1.9
            upward = any((m, b) in cyclic for b in rooms)
            ax.add_patch(
                FancyBboxPatch(
                    (x, y),
                    w,
                    1.0,
                    boxstyle="round,pad=0.02",
                    facecolor="#fde0dc" if upward else "#e8f0fe",
                    edgecolor="#c0392b" if upward else "#34568b",
                )
            )
            name = m if m in ("__init__", "_version") or (src / m).is_dir() else f"{m}.py"
            cls = f"\n{largest[m][0]}: {largest[m][1]}" if m in largest else ""
            ax.text(x + w / 2, y + 0.5, f"{name}\n{lines[m]} lines{cls}", ha="center", va="center", fontsize=7)
            centre[m] = (x + w / 2, y)
            x += w + 0.2
    for (a, b), count in sorted(edges.items()):
        (xa, ya), (xb, yb) = centre[a], centre[b]
        red = (a, b) in cyclic
        ax.annotate(
            "",
            xy=(xb, yb + 1.0),
            xytext=(xa, ya),
            arrowprops={
                "arrowstyle": "-|>",
                "color": "#c0392b" if red else "#7f8c8d",
                "alpha": 0.9 if red else 0.35,
                "lw": 0.5 + 0.15 * min(count, 10),
                "shrinkA": 0,
                "shrinkB": 0,
            },
        )
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(-0.5, 1.9 * (max(by_row) + 1))
    ax.axis("off")
    cycle_note = f"; {len(cyclic)} imports in cycles (red)" if cyclic else "; no cycles"
    ax.set_title(
        f"{title}: {len(rooms)} rooms, {sum(lines.values())} lines, {len(edges)} import arrows{cycle_note}. "
        f"Each room above what it imports; box: lines and the largest class (its lines).",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{out}: {len(rooms)} rooms, {len(edges)} arrows, {len(cyclic)} in cycles, {max(by_row) + 1} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src" / PACKAGE)
    parser.add_argument("--out", type=Path, default=Path("module-graph.png"))
    parser.add_argument("--title", default="lightning_spot")
    args = parser.parse_args()
    draw(args.src, args.out, args.title)


if __name__ == "__main__":
    main()
