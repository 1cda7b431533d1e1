"""Committed outputs a reader can trust (#42): an output in a notebook is what its cell printed on a clean run, so it
holds no path of the machine that ran it, no progress bar or widget, and no warning. (That an output is *current* is
checked by re-running: `nbdev-test --save`.)"""

import json, re
import pytest
from conftest import ROOT
from test_notebooks import NOTEBOOKS

LOCAL = re.compile(
    "|".join([re.escape(str(ROOT)), r"/tmp/tmp\w+", r"site-packages", r"/home/\w+", r"/Users/\w+", r"/root/"])
)
WARNING = re.compile(r"\b[A-Z]\w*Warning: ")
PROGRESS = re.compile(r"\d+/\d+ \[\d\d:\d\d<|\d+it/s\]")
WIDGET = "application/vnd.jupyter.widget-view+json"


def texts(output: dict) -> str:
    "Everything an output shows as text: a stream, or the text forms of a result."
    shown = [output.get("text", "")] + [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return "\n".join("".join(t) if isinstance(t, list) else str(t) for t in shown)


def problems(nb: dict) -> list:
    "`(cell, what)` for each output a reader should not find committed."
    found = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            text = texts(out)
            if WIDGET in out.get("data", {}):
                found.append((i, "a widget (progress bar?)"))
            if m := LOCAL.search(text):
                found.append((i, f"a local path: …{text[max(0, m.start() - 40) : m.end() + 20]!r}"))
            if m := WARNING.search(text):
                found.append((i, f"a warning: {text[m.start() : m.end() + 60]!r}"))
            if PROGRESS.search(text):
                found.append((i, "a progress bar"))
    return found


def test_the_checker_sees_each_kind():
    cell = lambda **out: {"cells": [{"cell_type": "code", "source": [], "outputs": [out]}]}
    assert problems(cell(name="stdout", text=["wrote /tmp/tmp3vrv0ksz/bench.json\n"]))
    assert problems(cell(name="stdout", text=[f"{ROOT}/specnb/__init__.py:9\n"]))
    assert problems(cell(name="stderr", text=["x.py:1: FutureWarning: `past_key_values` is deprecated\n"]))
    assert problems(cell(name="stderr", text=["Loading weights: 100%|##########| 14/14 [00:00<00:00, 90.1it/s]\n"]))
    assert problems(cell(output_type="display_data", data={WIDGET: {}, "text/plain": ["HBox()"]}))
    assert not problems(cell(name="stdout", text=["bench.json: 3 pairs; the warning names --draft-model\n"]))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_outputs_are_clean(nb):
    found = problems(json.loads(nb.read_text()))
    assert not found, f"{nb.name}: re-run these cells without them (or print a relative name): {found}"
