"Speculative decoding for MLX, written as a literate nbdev package."
__version__ = "0.0.1"

from . import models
from .accept import Sampling
from .executor import spec_generate, spec_stream, generate, SpecResult, SpecStats, SpecStream
from .sources.base import DraftProvider, DraftSource, TargetView, NoDraft
from .sources.two_model import TwoModelProvider
from .sources.ngram import NgramProvider
from .sources.adaptive import AdaptiveProvider
from .sources.lookup_first import LookupFirstProvider
from .sources.early_exit import EarlyExitProvider
from .sources.head import HeadProvider, load_head
from .tap import Tap

def __getattr__(name):
    # `specnb.grammar` imports xgrammar, which imports torch: load it on first use, not with `import specnb`
    if name == "grammar":
        import importlib
        return importlib.import_module(".grammar", __name__)
    raise AttributeError(f"module 'specnb' has no attribute {name!r}")
