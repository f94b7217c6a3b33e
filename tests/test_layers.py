"""The layering rules (README "Architecture"): the ground floor and the router never import replica/, and the
ingress process imports no torch. Each check runs in a fresh interpreter so nothing already imported hides a change."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at any depth: lazy imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(("package", "forbidden"), [
    ("common", {"replica", "router", "cluster", "bench", "torch", "ray"}),
    ("router", {"replica", "cluster", "bench", "torch"}),
    ("replica", {"router", "cluster", "bench"}),
])
def test_imports_point_down(package, forbidden):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_modules(path) & forbidden)
        for path in sorted((ROOT / package).rglob("*.py"))
        if imported_modules(path) & forbidden
    }
    assert offenders == {}


def loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_the_ingress_imports_no_torch_and_no_engine():
    loaded = loaded_after_import("cluster.openai_api")
    assert "torch" not in loaded
    assert {name for name in loaded if name.startswith("replica")} <= {"replica", "replica.config"}


def test_the_ground_floor_and_the_router_policy_import_no_torch():
    loaded = loaded_after_import("common.types, common.routing_stats, common.page_format, router.policy, router.index")
    assert "torch" not in loaded and not any(name.startswith("replica") for name in loaded)
