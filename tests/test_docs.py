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
