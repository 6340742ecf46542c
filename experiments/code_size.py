"""The size of ``autoscale/search/`` (or another package folder): lines, files, functions and the
longest of them, its docstrings and comments apart, at the working tree or at git revisions side by
side. The numbers in experiments/results/code_size.md come from here.

    python experiments/code_size.py                      # the working tree
    python experiments/code_size.py --rev HEAD~5 --rev HEAD --package autoscale/search
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAP = 80  # tests/test_layout.py's cap on a function's lines, its docstring included


def _sources(package: str, rev: str | None) -> dict[str, str]:
    if rev is None:
        return {
            str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / package).glob("*.py"))
        }
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{package}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    return {
        f"{package}/{n}": subprocess.run(
            ["git", "show", f"{rev}:{package}/{n}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for n in names
        if n.endswith(".py")
    }


def measure(package: str, rev: str | None = None) -> dict[str, object]:
    """Lines (all, code, docstrings, comments, blank), files, functions, those over :data:`CAP`."""
    total = docs = comments = blank = functions = 0
    long: list[tuple[int, str]] = []
    for path, src in _sources(package, rev).items():
        lines = src.splitlines()
        tree = ast.parse(src)
        doc_lines: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                first = body[0] if body else None
                value = getattr(first, "value", None)
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    doc_lines.update(range(first.lineno, first.end_lineno + 1))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions += 1
                n = node.end_lineno - node.lineno + 1
                if n > CAP:
                    long.append((n, f"{path}:{node.lineno} {node.name}"))
        total += len(lines)
        docs += len(doc_lines)
        for i, line in enumerate(lines, 1):
            if i in doc_lines:
                continue
            comments += line.strip().startswith("#")
            blank += not line.strip()
    code = total - docs - comments - blank
    return {
        "files": len(_sources(package, rev)), "lines": total, "code": code, "docstrings": docs,
        "comments": comments, "blank": blank, "functions": functions, "over_cap": sorted(long, reverse=True),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default="autoscale/search")
    ap.add_argument(
        "--rev", action="append", help="a git revision (repeat; default: the working tree)"
    )
    args = ap.parse_args()
    revs = args.rev or [None]
    rows = {rev or "working tree": measure(args.package, rev) for rev in revs}
    keys = ("files", "lines", "code", "docstrings", "comments", "blank", "functions")
    print(f"{args.package}: " + ", ".join(rows))
    print(f"| {'':12s} | " + " | ".join(f"{r:>14s}" for r in rows) + " |")
    for k in keys:
        print(f"| {k:12s} | " + " | ".join(f"{row[k]:>14}" for row in rows.values()) + " |")
    print(
        f"| {'over ' + str(CAP):12s} | "
        + " | ".join(f"{len(row['over_cap']):>14}" for row in rows.values())
        + " |"
    )
    for name, row in rows.items():
        for n, where in row["over_cap"]:
            print(f"  {name}: {n} lines  {where}")


if __name__ == "__main__":
    main()
