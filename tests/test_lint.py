"""ruff check is clean over the package, tests, benchmarks, examples and docs scripts; mypy is clean
over the package, and every public signature is annotated (rules in pyproject.toml)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from conftest import ROOT
from test_docs import public_names


def test_ruff_check_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "tieredckpt", "tests", "benchmarks", "examples", "docs"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_is_clean_over_the_package():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _functions(name: str, obj: object):
    """The callables a user meets under a public name: a function, or a class's __init__ and public methods."""
    if inspect.isfunction(obj):
        yield name, obj
    elif inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            member = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            member = member.fget if isinstance(member, property) else member
            if inspect.isfunction(member):
                yield f"{name}.{attr}", member


SIGNATURES = [pair for name, obj in public_names() for pair in _functions(name, obj)]


@pytest.mark.parametrize("name, fn", SIGNATURES, ids=[n for n, _ in SIGNATURES])
def test_every_public_signature_is_annotated(name, fn):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    assert not missing, f"{name}: no annotation for {missing}"
