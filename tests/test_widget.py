"""The live widget's figures are true at every frame, not only at the end (issue #34): `watch` run end to end, its view
read as it changes."""

import re
import ipywidgets
import specnb.widget as W
from specnb.models import load_pair
from specnb.sources.two_model import TwoModelProvider

FIGURES = re.compile(r"(\d+) (tokens?) · [\d.]+ tok/s · acceptance (\d+%) · ([\d.]+) tokens per target call")


def test_watch_live_figures(monkeypatch):
    """Every value the live widget takes shows the tokens, acceptance and tokens per target call counted up to that
    moment."""
    streams, seen, spec_stream = [], [], W.spec_stream

    def spy_stream(*args, **kwargs):
        streams.append(spec_stream(*args, **kwargs))
        return streams[-1]

    class SpyView(ipywidgets.HTML):
        "The live widget, recording each frame with the stream's counters at that moment."

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.observe(self.record, "value")

        def record(self, change):
            st = streams[-1].result.stats
            seen.append((change.new, st.target_calls, st.accepted, st.drafted))

    monkeypatch.setattr(W, "spec_stream", spy_stream)
    monkeypatch.setattr(W.widgets, "HTML", SpyView)
    pair = load_pair()
    tok = pair.tokenizer
    r = W.watch(
        pair.target,
        TwoModelProvider(pair.draft),
        tok.encode("class Stack:\n    def __init__(self):\n        "),
        tok,
        refresh_s=0,
        num_draft_tokens=4,
        max_tokens=40,
    )
    for n, (frame, calls, accepted, drafted) in enumerate(seen[: len(r.tokens)], 1):
        shown = FIGURES.search(frame).groups()
        assert shown == (str(n), "token" if n == 1 else "tokens", f"{accepted / drafted:.0%}", f"{n / calls:.2f}"), (
            n,
            shown,
        )
        assert float(shown[3]) > 0
    # a frame per token, then the finished view (no change event when it draws the same)
    assert len(seen) >= len(r.tokens)
    st = r.stats
    assert FIGURES.search(seen[-1][0]).groups() == (
        str(st.generated),
        "tokens",
        f"{st.acceptance_rate:.0%}",
        f"{st.tokens_per_call:.2f}",
    )
