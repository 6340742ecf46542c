"""The package's shape: imports point one way, nobody imports another module's private names, and
the wheel's package list covers every subpackage."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autoscale"

# Lower layers never import higher ones (docs/design.md 2). errors/resources sit under everything;
# integrations plug the run-time scalers into frameworks and stand beside training.
LAYERS = {
    "errors": 0,
    "resources": 0,
    "processes": 0,
    "yamlio": 0,
    "progress": 0,
    "scalers": 1,
    "observe": 1.5,
    "integrations": 2,
    "training": 2,
    "envs": 3,
    "agents": 4,
    "search": 5,
    "selection": 5.5,
    "report": 5,
    "commands": 6,
    "cli": 6,
    "__init__": 2,
    "__main__": 6,
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every autoscale import, lazy ones in functions too."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autoscale"):
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("autoscale"):
                    found.append((alias.name, [], node.lineno))
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS[key]


def test_every_top_level_module_has_a_layer():
    for module, _ in _modules():
        parts = module.split(".")
        assert (parts[1] if len(parts) > 1 else "__init__") in LAYERS, module


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_imports_point_one_way_and_respect_privacy(module, path):
    mine = _layer(module)
    for target, names, line in _imports(path):
        if target == "autoscale":
            continue  # the package root (version, IMPORT_TIME) is read by all
        assert _layer(target) <= mine, (
            f"{module}:{line} imports {target}, a higher layer: move the shared piece down"
        )
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, (
            f"{module}:{line} imports private {private} from {target}: give it a public name"
        )


def test_the_wheel_lists_every_subpackage():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {p for p in config["packages"] if not p.startswith("autoscale._shipped")}
    actual = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert listed == actual
    shipped = config["package-dir"]
    assert shipped == {
        "autoscale._shipped.envs": "envs",
        "autoscale._shipped.policies": "policies",
        # the example workloads, at the path the shipped suite names them from envs/
        "autoscale._shipped.experiments.workloads": "experiments/workloads",
    }


def test_the_tests_run_on_the_python_the_package_claims():
    """``requires-python`` is what the tests run on (they read pyproject with tomllib: 3.11+), and
    ruff checks the same version's syntax."""
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    claimed = project["project"]["requires-python"]
    assert claimed.startswith(">=")
    least = tuple(int(x) for x in claimed[2:].split("."))
    assert sys.version_info[:2] >= least
    assert project["tool"]["ruff"]["target-version"] == "py" + "".join(map(str, least))


OPTIONAL = {"accelerate", "lightning", "transformers", "wandb", "tensorboard", "deepspeed"}


def _skip_first(path: Path) -> list[str]:
    """Optional frameworks ``path`` imports at module level before skipping on their absence."""
    tree = ast.parse(path.read_text())
    skipped, bad = set(), []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "importorskip" and node.value.args:
                skipped.add(str(node.value.args[0].value).split(".")[0])
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        bad += [n for n in names if n.split(".")[0] in OPTIONAL - skipped]
    return bad


def test_tests_skip_with_a_reason_when_an_optional_framework_is_absent():
    """A test module that imports an optional framework at its top skips first (with
    ``pytest.importorskip(NAME, reason=...)``), so a venv without it skips those tests instead
    of failing to collect them."""
    offenders = {
        str(p.relative_to(ROOT)): bad
        for p in (ROOT / "tests").rglob("test_*.py")
        if (bad := _skip_first(p))
    }
    assert offenders == {}


def test_the_parametric_search_does_not_import_the_agents():
    """``search/`` reaches ``autoscale.agents`` (SB3 and its kin) only from its RL code: the
    sampling of an agent's hyperparameters and the RL objective."""
    allowed = {("space.py", "suggest_residual"), ("agent_trials.py", "RLObjective")}
    found = set()
    for path in (PACKAGE / "search").glob("*.py"):
        tree = ast.parse(path.read_text())
        for top in tree.body:
            for node in ast.walk(top):
                module = None
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    module = node.module
                elif isinstance(node, ast.Import):
                    module = node.names[0].name
                if module and module.startswith("autoscale.agents"):
                    found.add((path.name, getattr(top, "name", "<module>")))
    assert found <= allowed, found - allowed


def _graph() -> dict[str, set[str]]:
    """Module -> the autoscale modules it imports (lazy ones too; not those under TYPE_CHECKING)."""
    modules = {name for name, _ in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = {d for d in deps if not d.endswith("__init__")}
    return graph


def test_no_import_circle():
    """No module reaches itself through autoscale's imports, lazy ones included (a package's
    ``__init__`` re-exports are not edges back)."""
    graph = _graph()
    graph = {
        k.removesuffix(".__init__"): {d.removesuffix(".__init__") for d in v}
        for k, v in graph.items()
    }
    packages = {k for k in graph if (PACKAGE / Path(*k.split(".")[1:]) / "__init__.py").is_file()}
    graph = {k: v - packages for k, v in graph.items() if k not in packages}
    state: dict[str, int] = {}
    circles = []

    def visit(node, trail):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                circles.append(trail[trail.index(dep) :] + [dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []


FUNCTION_CAP = 80  # lines of a function, its docstring included


def test_no_function_is_over_80_lines():
    """Size by function, not by file: a function past 80 lines does more than one thing (a file
    cap split modules by size, not responsibility: the search driver was cut in three by it)."""
    import ast

    long = {}
    for _, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                key = f"{path.relative_to(ROOT)}:{node.name}"
                if n > FUNCTION_CAP:
                    long[key] = n
    assert not long, long


def test_the_experiments_import_names_the_package_has():
    """Every ``from autoscale.X import Y`` in experiments/ (lazy ones in functions too) names a
    module and an attribute that exist: a script that runs for hours must not fail at its end
    on a name that moved."""
    import importlib

    missing = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autoscale")
            ):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(
                            f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}"
                        )
    assert not missing, missing
