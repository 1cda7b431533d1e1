"""The package's shape, checked from the source (ast, nothing imported): modules talk to each other through public names
only, and no module grows past a size one reader can hold. Issue #29: "no module imports another module's underscore
names"; the executor's phases are a public API (`specnb.executor`'s phase API) for that reason."""

import ast, io, subprocess, sys, tokenize
from pathlib import Path
from conftest import ROOT

PKG = ROOT / "specnb"
MAX_LINES = 450

# mlx-lm's private names specnb relies on, each because mlx-lm offers no public one. Any other private import from a
# third-party package fails, so a new dependency on someone's internals is a decision made here, in the open.
FOREIGN_PRIVATE = {
    (
        "mlx_lm.models.cache",
        "_BaseCache",
    ): "the base class of every mlx-lm cache (the `state`, `is_trimmable`, `size` and "
    "`from_state` defaults mlx-lm's cache functions call); there is no public one",
    ("mlx_lm.utils", "_get_classes"): "builds a model class from a config dict without weights (the default of "
    "`load_model`'s `get_model_classes`); there is no public one",
    (
        "xgrammar.testing",
        "_json_schema_to_ebnf",
    ): "xgrammar's JSON-schema converter with a style (Gemma 4's) and no free whitespace; "
    "its structural tag allows whitespace mlx-lm's gemma4 parser cannot read (08ca)",
}

# Files allowed to break a rule for now, with why. The lists only shrink: an entry whose file is gone or now keeps the
# rule fails `test_exceptions_still_needed`, so remove it then.
BEING_SPLIT = {}  # path -> reason: files that still import another module's private names while they are split up
LONG = {}  # path -> reason: files over the limit for now


def modules() -> list:
    "Every module of the package, as a path relative to the repository (`specnb/_modidx.py`, nbdev's index, excluded)."
    return sorted(p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py") if p.name != "_modidx.py")


def package_of(rel: str) -> list:
    """The dotted parts of the package `rel`'s relative imports start from (its folder, for a module and an `__init__`
    alike)."""
    return rel.split("/")[:-1]


def target(rel: str, node: ast.ImportFrom) -> str:
    "The dotted module an import reads from."
    if not node.level:
        return node.module or ""
    base = package_of(rel)
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_module(dotted: str) -> bool:
    "Is `specnb.x.y` a module or package of ours?"
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted(node) -> str | None:
    "`a.b.c` for an attribute chain on a name, else None."
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def private_uses(rel: str) -> list:
    """`(line, what)` for every private name `rel` takes from elsewhere: specnb's own, or a third party's not in
    `FOREIGN_PRIVATE`."""
    tree, found, aliases = ast.parse((ROOT / rel).read_text()), [], {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            mod = target(rel, n)
            ours = mod == "specnb" or mod.startswith("specnb.")
            for a in n.names:
                if ours and is_module(f"{mod}.{a.name}"):
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
                if any(map(private, mod.split("."))) or private(a.name):
                    if ours or (mod, a.name) not in FOREIGN_PRIVATE:
                        found.append((n.lineno, f"from {mod} import {a.name}"))
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("specnb") and a.asname:
                    aliases[a.asname] = a.name
                if any(map(private, a.name.split("."))):
                    found.append((n.lineno, f"import {a.name}"))
    for n in ast.walk(
        tree,  # `mod._name` on a module of ours bound above (`from . import executor`, `import specnb.x as y`)
    ):
        if isinstance(n, ast.Attribute) and private(n.attr) and (base := dotted(n.value)):
            head, _, rest = base.partition(".")
            mod = aliases.get(head, head if head == "specnb" else None)
            if mod and is_module(".".join([mod] + ([rest] if rest else []))):
                found.append((n.lineno, f"{base}.{n.attr}"))
    return sorted(found)


def n_lines(rel: str) -> int:
    """A module's length as a reader meets it in the formatted notebook: its lines that hold code, a docstring or a
    comment (blank lines, which the formatter sets, and nbdev's `# %%` cell markers not counted)."""
    return sum(1 for line in (ROOT / rel).read_text().splitlines() if line.strip() and not line.startswith("# %% "))


def test_the_checker_sees_private_imports(tmp_path, monkeypatch):
    """The rule's own gate: each way of reaching another module's private name is caught, public and allowed ones are
    not."""
    src = (
        "from .executor import spec_generate, _run\nfrom ..rollback import leaves\nfrom specnb.caches.rollback import "
        "_room\n"
        "from . import executor\nexecutor._round(r, 2)\nimport specnb.tap as tp\ntp._x\n"
        "from mlx_lm.models.cache import _BaseCache\nfrom mlx_lm.utils import _hidden\nfrom .executor import __all__\n"
    )
    (tmp_path / "specnb" / "sources").mkdir(parents=True)
    (tmp_path / "specnb" / "sources" / "probe.py").write_text(src)
    for m in ("executor", "rollback", "tap"):
        (tmp_path / "specnb" / f"{m}.py").write_text("")
    (tmp_path / "specnb" / "sources" / "executor.py").write_text("")
    (tmp_path / "specnb" / "sources" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [w for _, w in private_uses("specnb/sources/probe.py")] == [
        "from specnb.sources.executor import _run",
        "from specnb.caches.rollback import _room",
        "executor._round",
        "tp._x",
        "from mlx_lm.utils import _hidden",
    ]


def test_no_module_imports_another_modules_private_names():
    bad = {m: found for m in modules() if m not in BEING_SPLIT and (found := private_uses(m))}
    assert not bad, (
        "modules reaching into another module's private names (make the name public, documented, in the module "
        f"that owns it; or, for a third party's, add it to FOREIGN_PRIVATE with why): {bad}"
    )


def test_no_module_is_too_long():
    long = {m: n for m in modules() if m not in LONG and (n := n_lines(m)) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each by concern, one job a module): {long}"


def test_exceptions_still_needed():
    stale = [m for m in BEING_SPLIT if not (ROOT / m).exists() or not private_uses(m)]
    stale += [m for m in LONG if not (ROOT / m).exists() or n_lines(m) <= MAX_LINES]
    assert not stale, (
        f"these files keep the rule now (or are gone): remove them from BEING_SPLIT / LONG in {Path(__file__).name}: "
        f"{stale}"
    )


def imports_at_load(rel: str) -> set:
    """The specnb modules `rel` imports when it is loaded (top-level statements; an import inside a function runs later,
    on demand)."""
    out = set()
    for node in ast.parse((ROOT / rel).read_text()).body:
        if isinstance(node, ast.ImportFrom):
            mod = target(rel, node)
            if mod.startswith("specnb"):
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    out.add(sub if is_module(sub) else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("specnb.")}
    return out


def as_module(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_no_import_cycle():
    "Lower pieces never import higher ones: the graph of load-time imports between specnb's modules has no cycle."
    graph = {as_module(rel): {m for m in imports_at_load(rel) if m != as_module(rel)} for rel in modules()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph.get(m, ())):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


# The package by concern (issue #42): a module at the top is the executor, one of its phases, or something every package
# uses; the rest live in the package of their concern. A new top-level module, or a new package, is a decision made
# here.
TOP_LEVEL = {  # module -> its job
    "executor": "the one loop and its phase API",
    "prefill": "the prefill drain",
    "verify": "the verify forward",
    "accept": "the accept walk and the sampler",
    "tree": "draft trees: DDTree, the verify forward over a tree, the walk, the cache kept to the path",
    "tree_round": "the executor's round over a draft tree: verify on every cache kind, the walk, the path kept",
    "tap": "the target's hidden states",
    "grammar": "grammar masks in the walk",
    "models": "loading models, the bundled pair, tiny random models",
    "costs": "timers for a round's pieces and the speedup bound",
    "gguf": "GGUF files to mlx-lm folders",
    "blas": "the OpenBLAS fast path",
    "checkpoint": "one reader/writer for every published drafter format",
    "hub_fixture": "a loopback Hugging Face hub for tests",
    "gates": "the distribution gates",
    "oracle": "mlx-lm as the oracle",
    "detok": "streaming text",
    "distributed": "ranks of an mlx.launch job",
    "cli": "the `specnb` command",
    "serve_options": "every `specnb serve` option once (read by the CLI without loading the server)",
    "bench": "`specnb bench`",
    "convert": "`specnb convert`: quantized drafters",
    "widget": "the live view",
    "moved": "old module names, for one release",
}
PACKAGES = {
    "caches": "the caches and their rollback",
    "sources": "draft sources and their seam",
    "train": "training drafters",
    "batching": "batched rounds and the drafts that join them",
    "serve": "the server, its ranks and its test harness",
}


def test_layout_by_concern():
    top = {p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "_modidx")}
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert top == set(TOP_LEVEL), (
        f"top-level modules not in TOP_LEVEL: {top - set(TOP_LEVEL)}; gone: {set(TOP_LEVEL) - top}"
    )
    assert packages == set(PACKAGES), (
        f"packages not in PACKAGES: {packages - set(PACKAGES)}; gone: {set(PACKAGES) - packages}"
    )


def test_moved_names_are_not_files():
    "A moved module's old name is only an alias (specnb.moved): a file left behind would shadow the module it moved to."
    from specnb.moved import MOVED

    left = [old for old in MOVED if (PKG / f"{old}.py").exists()]
    assert not left, f"old modules still on disk: {left}"


# nbdev writes the head of every module: the notebook's one-line `>` summary as its docstring (the docs page's
# description, one line) and `__all__`, which it wraps at 120 before the 10 characters of `__all__ = `.
def generated_head(lines: list) -> int:
    "How many of a module's first lines nbdev wrote: its docstring, the AUTOGENERATED line and the `__all__` block."
    i = next((k for k, line in enumerate(lines) if line.startswith("# AUTOGENERATED")), -1) + 1
    if i and i + 2 < len(lines) and lines[i + 2].startswith("__all__ = "):
        i += 3
        while i < len(lines) and lines[i].startswith(" " * 11):
            i += 1
    return i


def excused(text: str) -> set:
    "Line numbers (from 0) of multi-line strings closed by `# noqa: E501`, as ruff reads them (chat templates)."
    out = set()
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.STRING and t.end[0] > t.start[0] and "noqa: E501" in t.line.splitlines()[-1]:
            out |= set(range(t.start[0] - 1, t.end[0]))
    return out


def test_package_lines_fit():
    "Every line of the package within 120 characters, as ruff holds the notebooks (nbdev's generated head excepted)."
    long = {}
    for m in modules():
        text = (ROOT / m).read_text()
        lines, ok = text.splitlines(), excused(text)
        head = generated_head(lines)
        long |= {f"{m}:{k + 1}": len(s) for k, s in enumerate(lines) if k >= head and k not in ok and len(s) > 120}
    assert not long, f"lines over 120 characters (edit the notebook; `ruff format` wraps code): {long}"


def test_formatted_and_linted():
    """`ruff format` leaves the notebooks and tests as they are, and `ruff check` (the rules in pyproject.toml: line
    length, one statement a line, undefined names) passes on them and on the exported package."""
    ruff = [sys.executable, "-m", "ruff"]
    fmt = subprocess.run(
        [*ruff, "format", "--check", "nbs", "tests", "specnb/__init__.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, f"run `ruff format nbs tests` (then nbdev-export):\n{fmt.stdout}{fmt.stderr}"
    lint = subprocess.run([*ruff, "check", "nbs", "tests", "specnb"], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
