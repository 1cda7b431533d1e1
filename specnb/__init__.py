"Speculative decoding for MLX, written as a literate nbdev package."

__version__ = "0.0.1"

import importlib

# First, before anything imports MLX: on Linux, Debian's OpenBLAS into the global symbol scope (see nbs/00c_blas.ipynb).
# It is a dlopen, and `specnb.blas` imports no MLX; SPECNB_NO_OPENBLAS=1 turns it off.
from .blas import load_openblas

load_openblas()

# Modules that moved keep their old names for one release (see nbs/99_moved.ipynb): an import hook, importing nothing.
from .moved import install_moved

install_moved()

# The public names, each loaded from its module on first use: `import specnb` (and `specnb --help`) pulls in no MLX,
# mlx-lm or torch until a name that needs them is touched.
_LAZY = {
    "Sampling": "accept",
    **dict.fromkeys(["spec_generate", "spec_stream", "generate", "SpecResult", "SpecStats", "SpecStream"], "executor"),
    **dict.fromkeys(["spec_generate_batch", "Batch"], "batching.rounds"),
    **dict.fromkeys(["DraftProvider", "DraftSource", "TargetView", "NoDraft"], "sources.base"),
    "TwoModelProvider": "sources.two_model",
    "NgramProvider": "sources.ngram",
    "AdaptiveProvider": "sources.adaptive",
    "LookupFirstProvider": "sources.lookup_first",
    "EarlyExitProvider": "sources.early_exit",
    **dict.fromkeys(["HeadProvider", "load_head"], "sources.chain"),
    **dict.fromkeys(["Eagle3Provider", "load_eagle3"], "sources.eagle3"),
    **dict.fromkeys(["MtpProvider", "load_mtp"], "sources.mtp"),
    **dict.fromkeys(["AssistantProvider", "load_assistant"], "sources.assistant"),
    **dict.fromkeys(["DFlashProvider", "load_dflash"], "sources.dflash"),
    **dict.fromkeys(["DSparkProvider", "load_dspark"], "sources.dspark"),
    "Tap": "tap",
}
__all__ = ["models", "grammar", *_LAZY]


def __getattr__(name):
    "A public name from `_LAZY`, or a submodule (`specnb.models`, `specnb.grammar`, ...), imported on first use."
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
