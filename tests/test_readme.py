"""README.md is generated from nbs/index.ipynb (nbdev-readme needs Quarto, which some machines lack).
Regenerate with `python tests/test_readme.py`; the test fails when the two drift apart."""

import re, nbformat
from conftest import ROOT


def clone_links(md: str) -> str:
    """Point links to sibling notebooks (`](05b_ngram.ipynb)`, right on the docs site) into `nbs/`, where they are in a
    clone."""
    return re.sub(r"\]\((?!https?:|/|nbs/)([\w.-]+\.ipynb)\)", r"](nbs/\1)", md)


def render_index() -> str:
    """index.ipynb as Markdown: markdown cells as they are, code cells fenced with their text outputs; hidden cells
    skipped."""
    nb, parts = nbformat.read(ROOT / "nbs" / "index.ipynb", as_version=4), []
    for c in nb.cells:
        if c.cell_type == "markdown":
            parts.append(clone_links(c.source))
        elif c.cell_type == "code" and "#| hide" not in c.source:
            parts.append(f"```python\n{c.source}\n```")
            outs = [o.get("text") or o.get("data", {}).get("text/plain", "") for o in c.get("outputs", [])]
            if any(outs):
                parts.append("```\n" + "".join(outs).rstrip() + "\n```")
    return (
        "<!-- generated from nbs/index.ipynb by tests/test_readme.py: edit the notebook -->\n\n"
        + "\n\n".join(parts)
        + "\n"
    )


def test_clone_links():
    assert (
        clone_links("[how](00a_train_pair.ipynb) [x](https://a.b/c.ipynb) [y](nbs/01_prefill.ipynb)")
        == "[how](nbs/00a_train_pair.ipynb) [x](https://a.b/c.ipynb) [y](nbs/01_prefill.ipynb)"
    )
    missing = [m for m in re.findall(r"\]\((nbs/[\w.-]+\.ipynb)\)", render_index()) if not (ROOT / m).exists()]
    assert not missing, f"README links to notebooks that do not exist: {missing}"


def test_readme_matches_index():
    assert (ROOT / "README.md").read_text() == render_index(), "README.md is stale: run `python tests/test_readme.py`"


if __name__ == "__main__":
    (ROOT / "README.md").write_text(render_index())
