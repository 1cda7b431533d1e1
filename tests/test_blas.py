"""What `import specnb` does in a fresh Python: it loads Debian's OpenBLAS before MLX (nbs/00c_blas.ipynb) and nothing
heavy."""

import os, subprocess, sys, pytest
from specnb.blas import OPENBLAS

# a fresh Python started as a user's shell would start it: no preload, no kernels named, no opt-out
CLEAN = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE", "SPECNB_NO_OPENBLAS")}
HAVE = sys.platform == "linux" and OPENBLAS.exists()
needs_openblas = pytest.mark.skipif(not HAVE, reason=f"Debian's OpenBLAS is not installed ({OPENBLAS})")


def fresh(code, **env):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**CLEAN, **env})
    assert r.returncode == 0, r.stderr
    return r


@needs_openblas
def test_import_specnb_uses_openblas():
    assert fresh("import specnb; print(specnb.models.blas_in_use())").stdout.startswith("openblas")


@needs_openblas
def test_user_kernels_win():
    assert (
        fresh("import specnb; print(specnb.models.blas_in_use())", OPENBLAS_CORETYPE="Haswell").stdout.strip()
        == "openblas (Haswell kernels)"
    )


def test_opt_out():
    assert (
        fresh("import specnb; print(specnb.models.blas_in_use())", SPECNB_NO_OPENBLAS="1").stdout.strip() == "reference"
    )


def test_mlx_imported_first_warns_once():
    r = fresh("import mlx.core, specnb; specnb.blas.load_openblas(); print(specnb.blas.blas_in_use())")
    # loaded after MLX, OpenBLAS would never be called: not loaded, not reported
    assert r.stdout.strip() == "reference"
    assert r.stderr.count("MLX was imported before specnb") == (1 if HAVE else 0), r.stderr


def test_import_is_light():
    "`import specnb` (and so `specnb --help`) imports no MLX, mlx-lm or torch; the public names still resolve on use."
    code = (
        "import sys, specnb; heavy = lambda: [m for m in ('mlx.core', 'mlx_lm', 'torch', 'transformers') if m in "
        "sys.modules]; "
        "print(heavy()); print(specnb.TwoModelProvider.__module__, specnb.spec_generate.__module__); print(heavy()[:2])"
    )
    before, modules, after = fresh(code).stdout.splitlines()
    assert before == "[]"
    assert modules == "specnb.sources.two_model specnb.executor"
    assert after == "['mlx.core', 'mlx_lm']"


def test_public_names_resolve():
    import specnb

    for name in specnb.__all__:
        assert getattr(specnb, name) is not None, name
    with pytest.raises(AttributeError, match="no_such_name"):
        specnb.no_such_name
