"""The documentation: the site builds with ``mkdocs build --strict`` (broken links, missing API
names and bad references fail), every public name has a docstring and a place in the
reference, every error has a troubleshooting entry, and the README stays short."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tieredckpt
import tieredckpt.dcp
import tieredckpt.errors
import tieredckpt.hf
import tieredckpt.lightning

ROOT = Path(__file__).resolve().parent.parent
MODULES = (tieredckpt, tieredckpt.dcp, tieredckpt.hf, tieredckpt.lightning)


def public_names() -> list[tuple[str, object]]:
    return [(f"{m.__name__}.{n}", getattr(m, n)) for m in MODULES for n in m.__all__ if n != "__version__"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_site_builds_strict_with_every_page_in_it(site):
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in site.glob("*/index.html")} | {"index"}
    assert pages <= built, pages - built


@pytest.mark.parametrize("name, obj", public_names(), ids=[n for n, _ in public_names()])
def test_every_public_name_has_a_docstring_and_a_place_in_the_reference(site, name, obj):
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert own and own.strip(), f"{name} has no docstring of its own"
    api = (site / "api" / "index.html").read_text()
    assert f'id="{name}"' in api, f"{name} is not in docs/api.md"


def test_every_error_has_a_troubleshooting_entry():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^## (\w+)$", text, re.M))
    errors = {n for n, o in vars(tieredckpt.errors).items()
              if inspect.isclass(o) and issubclass(o, tieredckpt.errors.TieredCkptError)}
    assert errors <= headings, errors - headings


def test_the_readme_is_short_and_opens_with_the_two_commands():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 210, len(readme)
    commands = [line.strip() for line in readme[:20] if line.startswith("    python3 -m venv")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert len(commands) == 2 and commands[1] in ci and "examples/train_tiny_lm.py" in commands[0]


# The options a user sets: every named parameter of these has a ``:param name:`` entry (a row of
# the reference's table, with its type and default from the signature).
OPTIONS_OF = ("tieredckpt.CheckpointStore", "tieredckpt.StoreConfig", "tieredckpt.dcp.TieredWriter",
              "tieredckpt.dcp.TieredReader", "tieredckpt.hf.TieredCheckpointCallback",
              "tieredckpt.lightning.TieredCheckpointIO")
INTEGRATIONS = (tieredckpt.dcp, tieredckpt.hf, tieredckpt.lightning)


def _ours(obj) -> bool:
    return getattr(obj, "__module__", "").startswith("tieredckpt")


def _is_framework_hook(cls, name: str) -> bool:
    """A method the framework calls (Lightning's, transformers', DCP's), not the user: it
    overrides one of a base class from outside tieredckpt."""
    return any(name in vars(base) for base in cls.__mro__[1:] if not _ours(base))


def public_methods() -> list[tuple[str, object]]:
    out = []
    for qualified, cls in public_names():
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for name, value in vars(cls).items():
            func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            func = func.fget if isinstance(func, property) else func
            if not name.startswith("_") and callable(func) and not _is_framework_hook(cls, name):
                out.append((f"{qualified}.{name}", func))
    return out


def _named_params(func) -> list[str]:
    return [n for n, p in inspect.signature(func).parameters.items()
            if n not in ("self", "cls") and p.kind is not p.VAR_POSITIONAL]


def documented_callables() -> list[tuple[str, object, str]]:
    """Every option-taking callable a user calls: the classes above (their ``__init__``), the
    store's public methods, the integrations' own functions and methods."""
    named = dict(public_names())
    out = []
    for qualified in OPTIONS_OF:
        cls = named[qualified]
        out.append((qualified, cls, (cls.__doc__ or "") + (vars(cls).get("__init__").__doc__ or "")))
    for qualified, func in public_methods():
        if qualified.startswith(("tieredckpt.CheckpointStore.", *(m.__name__ + "." for m in INTEGRATIONS))):
            out.append((qualified, func, func.__doc__ or ""))
    for module in INTEGRATIONS:
        out += [(f"{module.__name__}.{n}", f, f.__doc__ or "") for n in module.__all__
                if inspect.isfunction(f := getattr(module, n))]
    return out


@pytest.mark.parametrize("name, func, doc", documented_callables(), ids=[n for n, _, _ in documented_callables()])
def test_every_option_has_an_entry_of_its_own_in_the_reference(name, func, doc):
    missing = [p for p in _named_params(func) if f":param {p}:" not in doc]
    assert not missing, f"{name}: no ':param' entry for {missing}"


@pytest.mark.parametrize("name, func", public_methods(), ids=[n for n, _ in public_methods()])
def test_every_public_method_has_a_docstring_and_a_place_in_the_reference(site, name, func):
    assert (func.__doc__ or "").strip(), f"{name} has no docstring"
    page = (site / "api" / "index.html").read_text()
    assert f'id="{name}"' in page, f"{name} is not rendered in the API reference"


def test_no_public_docstring_points_at_a_private_name():
    private = re.compile(r"``_(?!_)\w+|\b_(?:loop|tiers|format|cli)\b|\w\._[a-z]\w*")
    docs = [(n, inspect.getdoc(o) or "") for n, o in public_names()] + \
           [(n, f.__doc__ or "") for n, f in public_methods()] + \
           [(n, d) for n, _, d in documented_callables()]
    found = {n: private.findall(d) for n, d in docs if private.search(d)}
    assert not found, found


def _shape(text: str) -> list[str]:
    """A page's lines with what changes run to run masked: numbers, the writer's token."""
    text = re.sub(r"\([0-9a-f]{8}\)", "(TOKEN)", text)
    return [" ".join(re.sub(r"\d+(\.\d+)?", "N", line).split()) for line in text.splitlines()]  # widths too


def test_the_cli_page_is_what_the_commands_print_today():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    page, today = (ROOT / "docs" / "cli.md").read_text(), gen_cli.render()
    stale = [(a, b) for a, b in zip(_shape(page), _shape(today)) if a != b]
    assert not stale and len(page.splitlines()) == len(today.splitlines()), \
        f"docs/cli.md is stale (python docs/gen_cli.py writes it again): {stale[:3]}"
