"""pipeline/objectives/: every recipe a folder of one shape, and the rule that keeps the run config light
(docs/objectives.md, "Adding one"): importing pipeline.objectives loads every recipe's config.py and nothing
else of it, neither torch nor any objective."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OBJECTIVES = ROOT / "pipeline" / "objectives"


def _imports(path: Path) -> list[str]:
    """The modules a file imports at its top level (not inside a function)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found.append(node.module or "")
    return found


def test_every_recipe_is_a_folder_of_one_shape():
    from pipeline.objectives import RECIPES

    for name, recipe in RECIPES.items():
        module = recipe.objective.__module__  # the recipe's config.py declares it
        folder = OBJECTIVES / module.split(".")[2]
        assert module == f"pipeline.objectives.{folder.name}.config", (name, module)
        for part in ("__init__.py", "objective.py", "config.py"):
            assert (folder / part).is_file(), f"{folder.relative_to(ROOT)} lacks {part}"
        assert _imports(folder / "__init__.py") == [], f"{folder.relative_to(ROOT)}/__init__.py imports"
        assert not [m for m in _imports(folder / "config.py") if m.endswith(".objective") or m == "torch"], name
        assert recipe.objective().__module__ == f"pipeline.objectives.{folder.name}.objective", name
    flat = sorted(p.name for p in OBJECTIVES.glob("*_config.py"))
    assert flat == [], f"a recipe's declaration outside its folder: {flat}"


def test_reading_the_run_config_loads_neither_torch_nor_an_objective():
    """In a fresh interpreter, as a command starts: pipeline.objectives and a config read and checked."""
    code = ("import sys; from pipeline.objectives import load_config; "
            "cfg = load_config('configs/pretrain/dinov3_demo.yaml'); "
            "heavy = [m for m in sys.modules if m == 'torch' or m.endswith('.objective')]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
