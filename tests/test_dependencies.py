"""Every package the code imports is declared in pyproject.toml: the package's own imports in its dependencies, the
examples' and benchmarks' in those plus the `examples` extra, the tests' in those plus the `test` extra. Imports
that are optional (inside `try` with an ImportError handler) or only for type checkers are not required."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
SCOPES = {
    "deepspeed_sdp4bit": ("core",),
    "examples": ("core", "examples"),
    "benchmarks": ("core", "examples"),
    "tests": ("core", "examples", "test"),
}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def declared() -> dict[str, set[str]]:
    """Distribution names per scope: core (dependencies) and each optional extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {"core": {_name(r) for r in project["dependencies"]}}
    found.update({extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()})
    return found


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the import sits in a `try` that handles ImportError or under `if TYPE_CHECKING`."""
    while node in parents:
        node, child = parents[node], node
        if (
            isinstance(node, ast.Try)
            and child in node.body
            and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers
            )
        ):
            return True
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return True
    return False


def required_imports(path: Path) -> set[str]:
    """Top-level modules a file imports unconditionally (relative imports left out)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module]
        else:
            continue
        if not _optional(node, parents):
            names.update(m.split(".")[0] for m in modules)
    return names


def local_modules() -> set[str]:
    """Modules that are files or folders of this repository (the package, scripts beside each other, test helpers)."""
    found = {"deepspeed_sdp4bit"}
    for folder in ("examples", "benchmarks", "tests"):
        found.update(p.stem for p in (ROOT / folder).glob("*.py"))
        found.update(p.name for p in (ROOT / folder).iterdir() if p.is_dir())
    return found


def test_every_import_is_declared() -> None:
    deps, local = declared(), local_modules()
    owners = importlib.metadata.packages_distributions()
    missing = []
    for folder, scopes in SCOPES.items():
        allowed = set().union(*(deps[scope] for scope in scopes)) | {"deepspeed-sdp4bit"}
        if folder != "deepspeed_sdp4bit":  # the repository's own support packages (dev/), never the library's
            allowed.add("deepspeed-sdp4bit-dev")
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in sorted(required_imports(path) - local - set(sys.stdlib_module_names)):
                names = {_name(d) for d in owners.get(module, [module])}
                if not names & allowed:
                    missing.append(
                        f"{path.relative_to(ROOT)} imports {module} ({', '.join(sorted(names))}), "
                        f"declared in none of {', '.join(scopes)}"
                    )
    assert not missing, "\n".join(missing)


def test_every_library_package_is_listed_for_the_wheel() -> None:
    """Every folder of the library with Python files is a package pyproject.toml lists, so that a wheel (which takes
    the listed packages only, where an editable install finds any folder) holds all of it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for top in ("deepspeed_sdp4bit", "sdp4bit_cost"):
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if any(folder.glob("*.py")) and "__pycache__" not in folder.parts:
                name = ".".join(folder.relative_to(ROOT).parts)
                assert name in listed, f"{name} is not in pyproject.toml's [tool.setuptools] packages"
