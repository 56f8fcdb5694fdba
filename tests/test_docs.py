"""The documentation cannot rot: the site builds without a warning, the README's links and test command
hold (and it stays short, set-up first), and the command-line reference covers every command and option.

``mkdocs build --strict`` (mkdocs.yml) turns every warning into a failure: a link to a page or an
anchor that does not exist, a page left out of the navigation, a name the API reference cannot find.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
HOOK = REPO / "docs" / "hooks" / "cli_reference.py"
#: The Mermaid 11.16.0 release's mermaid.min.js (its sha256 as the wheel that vendors it records it).
MERMAID_SCRIPT_SHA256 = "74d7c46dabca328c2294733910a8aa1ed0c37451776e8d5295da38a2b758fb9b"

#: ``[text](target)`` and ``<img src="target">``; code spans and fenced blocks are removed first.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img[^>]+src=\"([^\"]+)\"")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.M | re.S)


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "WARNING" not in log, log[-5000:]
    cli_page = (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert "editkit bank import" in cli_page and "cli-reference" not in cli_page  # the hook filled the page
    # the front page's flowchart is drawn by a script the site carries (Material fetches none when one is loaded)
    front = (site / "index.html").read_text(encoding="utf-8")
    assert '<pre class="mermaid"><code>flowchart LR' in front
    assert '<script src="assets/javascripts/mermaid.min.js"></script>' in front
    script = (site / "assets" / "javascripts" / "mermaid.min.js").read_bytes()
    assert hashlib.sha256(script).hexdigest() == MERMAID_SCRIPT_SHA256
    assert script.rstrip().endswith(b'globalThis["mermaid"] = globalThis.__esbuild_esm_mermaid_nm["mermaid"].default;')


def markdown_text(path: Path) -> str:
    """The file without fenced code blocks and code spans, where a link is only an example."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text(encoding="utf-8")))


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as the site (and GitHub) make them."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    return {slug(re.sub(r"[`*]", "", heading), "-")
            for heading in re.findall(r"^#{1,6} (.+?)\s*$", FENCE.sub("", path.read_text(encoding="utf-8")), re.M)}


def test_readme_links_point_at_existing_files_and_headings():
    broken = []
    for match in LINK.finditer(markdown_text(README)):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        path = (README.parent / file).resolve() if file else README
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(REPO)}")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{fragment}")
    assert not broken, broken


def test_readme_test_command_is_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci.startswith("pip install"), ci
    assert ci in README.read_text(encoding="utf-8").splitlines()


def test_readme_is_a_five_minute_read_that_starts_with_set_up():
    """At most 200 lines, its first code block the two set-up commands; the rest of the numbers live in docs/."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    first_block = re.search(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S).group(1).splitlines()
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert first_block == ["pip install torch==2.13.0 && pip install -e . && editkit stream", ci], first_block
    assert "](docs/results.md)" in text


def typer_commands(app, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Every command path of a Typer app and its callback, read from the app's registrations (not from click)."""
    found = {}
    for info in app.registered_commands:
        found[(*prefix, info.name or info.callback.__name__.replace("_", "-"))] = info.callback
    for info in app.registered_groups:
        path = (*prefix, info.name)
        found[path] = None
        found.update(typer_commands(info.typer_instance, path))
    return found


def test_cli_reference_covers_every_command_and_option():
    import typer

    from editkit.cli.app import app

    spec = importlib.util.spec_from_file_location("cli_reference", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.reference()
    sections = dict(re.findall(r"^## `editkit ?(.*?)`\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S))
    commands = typer_commands(app)
    assert set(sections) == {""} | {" ".join(path) for path in commands}

    root = typer.main.get_command(app)
    ctx = root.make_context("editkit", [], resilient_parsing=True)
    missing = []
    for path in commands:
        command, sub = root, ctx
        for name in path:
            command = command.get_command(sub, name)
            sub = command.make_context(name, [], parent=sub, resilient_parsing=True) \
                if hasattr(command, "list_commands") else sub
        for param in command.params:
            for option in [*param.opts, *param.secondary_opts] if param.param_type_name == "option" else []:
                if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", sections[" ".join(path)]):
                    missing.append(f"editkit {' '.join(path)} {option}")
    assert not missing, missing
