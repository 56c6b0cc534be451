"""The tools and examples name only what her_store has: each ``from her_store... import name`` in tools/ and
examples/, lazy ones inside functions included, resolves (a benchmark's import of a moved constant failed only when
that figure ran), and none imports from tests/."""

from __future__ import annotations

import ast
import importlib
import os

import pytest

from tests.conftest import ROOT

SCRIPTS = sorted(
    os.path.join(folder, name)
    for folder in ("tools", "examples")
    for name in os.listdir(os.path.join(ROOT, folder))
    if name.endswith(".py")
)


def _imports(path: str) -> list[ast.ImportFrom]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]


@pytest.mark.parametrize("path", SCRIPTS)
def test_every_name_a_script_imports_from_her_store_exists(path):
    for node in _imports(path):
        assert not node.module.startswith("tests"), f"{path}:{node.lineno} imports from the test suite"
        if not node.module.startswith("her_store"):
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(module, alias.name):  # a submodule, imported by name
                importlib.import_module(f"{node.module}.{alias.name}")
