"Speculative decoding for MLX, written as a literate nbdev package."
__version__ = "0.0.1"

from . import models
from .executor import spec_generate, spec_stream, generate, SpecResult, SpecStats, SpecStream
from .sources.base import DraftProvider, DraftSource, TargetView, NoDraft
from .sources.two_model import TwoModelProvider
from .sources.ngram import NgramProvider
from .sources.adaptive import AdaptiveProvider
from .sources.early_exit import EarlyExitProvider
from . import grammar
