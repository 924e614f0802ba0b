"""Imports point one way (DESIGN.md): the coordinator and the workers share the
``dataplane`` package and never import each other; ``dataplane`` and ``schemas``
import neither of them. Inside the coordinator, its three programs are packages of
their own: the realtime API (every module of ``coordinator`` outside the two
subpackages), the control plane (``coordinator.controlplane``) and the launcher
(``coordinator.launcher``: the command line and the local stack, on top of both).
The API and the control plane import neither each other nor the launcher; both may
use ``coordinator.output_reader``, the journal reader they share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "schemas": {"dataplane", "coordinator", "workers"},
    "dataplane": {"coordinator", "workers"},
    "coordinator": {"workers"},
    "workers": {"coordinator"},
}
SHARED = {"coordinator.output_reader"}
"""Modules of the coordinator that every one of its programs may import."""
PROGRAMS = {
    "coordinator.controlplane": {"coordinator.launcher", "coordinator"},
    "coordinator.launcher": set(),
    "coordinator": {"coordinator.controlplane", "coordinator.launcher"},
}
"""Each program of the coordinator -> the others it must not import (``coordinator``
alone: the realtime API's modules)."""


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def program_of(module: str) -> str | None:
    """The coordinator program ``module`` belongs to (None: outside the coordinator, or
    one of its shared modules)."""
    shared = any(module == m or module.startswith(m + ".") for m in SHARED)
    if not module.startswith("coordinator") or shared or module == "coordinator":
        return None
    for program in ("coordinator.controlplane", "coordinator.launcher"):
        if module == program or module.startswith(program + "."):
            return program
    return "coordinator"


def test_the_coordinators_programs_import_one_way():
    offenders: dict[str, list[str]] = {}
    for path in (ROOT / "coordinator").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own = program_of(module.removesuffix(".__init__"))
        if own is None:
            continue
        for imported in imported_modules(path):
            other = program_of(imported)
            if other is not None and other != own and other in PROGRAMS[own]:
                offenders.setdefault(module, []).append(imported)
    assert offenders == {}
