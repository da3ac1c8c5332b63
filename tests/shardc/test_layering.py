"""One path: the passes below the user-facing decorator never import it (DESIGN.md, "One path")."""
import ast
import pathlib

import shardc

ROOT = pathlib.Path(shardc.__file__).parent
BELOW_AUTO = ["ir", "rules", "cost", "sim", "search", "pcg", "propagate.py", "plan.py", "lower.py",
              "lower_regions.py", "remat.py", "ties.py", "seeds.py", "sharding.py"]


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_passes_do_not_import_the_decorator():
    files = [p for name in BELOW_AUTO for p in ((ROOT / name).rglob("*.py") if (ROOT / name).is_dir() else [ROOT / name])]
    assert len(files) > 40
    offenders = sorted(str(p.relative_to(ROOT)) for p in files if "shardc.auto" in _imports(p))
    assert offenders == []
