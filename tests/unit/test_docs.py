"""The README and docs/ say what is true of the repository: their links lead somewhere, and every
`dsf` command they show in a code block is one the command line accepts.

In-process and quick: no command is run. Each `dsf ...` line of a fenced block (also `.venv/bin/dsf`
and `deepspeed ... $(which dsf) train ...`) is parsed by the click command it names, with its
flags and their values checked by click's own parser (`make_context`); placeholder arguments such
as RUN.yaml are fine, since no path is read.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from dsframework.commands.cli import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,}|~{3,})")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).+?\1")


def split_fences(text: str) -> tuple[list[str], list[list[str]]]:
    """(the lines outside fenced code blocks, the lines of each fenced block)."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fence: str | None = None
    for line in text.splitlines():
        match = FENCE.match(line.lstrip())
        if fence is None and match:
            fence = match.group(1)[0] * 3
            blocks.append([])
        elif fence is not None and line.lstrip().startswith(fence):
            fence = None
        elif fence is not None:
            blocks[-1].append(line)
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation out, spaces to hyphens.

    >>> slug("`dsf plan`: which layout, and why")
    'dsf-plan-which-layout-and-why'
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and underscores, as GitHub does
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of a markdown file produce (a repeated one gets -1, -2, ...)."""
    prose, _ = split_fences(path.read_text())
    found: set[str] = set()
    for line in prose:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = anchor = slug(match.group(1))
        count = 0
        while anchor in found:
            count += 1
            anchor = f"{base}-{count}"
        found.add(anchor)
    return found


def relative_links(path: Path) -> list[str]:
    """The link targets of a page's prose that point into the repository (no URL scheme)."""
    prose, _ = split_fences(path.read_text())
    text = INLINE_CODE.sub("", "\n".join(prose))
    return [target for target in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def link_problem(page: Path, target: str) -> str | None:
    """Why `target`, a link on `page`, leads nowhere; None when it resolves."""
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    if not dest.exists():
        return f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
    if anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
        return f"{target}: no heading of {dest.name} has the anchor #{anchor}"
    return None


def dsf_commands(path: Path) -> list[list[str]]:
    """The argument lists (after `dsf`) of every dsf command in a page's fenced code blocks."""
    _, blocks = split_fences(path.read_text())
    commands = []
    for block in blocks:
        for line in _joined(block):
            args = dsf_args(line)
            if args is not None:
                commands.append(args)
    return commands


def _joined(block: list[str]) -> list[str]:
    """The block's lines with backslash continuations joined."""
    lines, current = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            lines.append(current + line)
            current = ""
    return lines + ([current] if current else [])


def dsf_args(line: str) -> list[str] | None:
    """The arguments after `dsf` when `line` runs dsf, else None.

    >>> dsf_args("$ dsf plan --model m  # a comment")
    ['plan', '--model', 'm']
    >>> dsf_args("deepspeed --num_gpus 4 $(which dsf) train run.yaml --resume")
    ['train', 'run.yaml', '--resume']
    >>> dsf_args("dsf: error: train.stpes: unknown key") is None
    True
    """
    line = line.strip().removeprefix("$ ").replace("$(which dsf)", "dsf")
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # not shell (an output line with an odd quote)
        return None
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] == "sudo"):
        words = words[1:]  # KEY=VALUE before the command
    if words and words[0] == "deepspeed":
        words = words[words.index("dsf"):] if "dsf" in words else []
    if not words or not (words[0] == "dsf" or words[0].endswith("/dsf")):
        return None
    return words[1:]


def parse_problem(args: list[str]) -> str | None:
    """Why `dsf ARGS` would not parse (an unknown subcommand, flag or value); None when it does.
    Nothing runs: click builds the subcommand's context from the arguments and stops there."""
    if not args or args[0].startswith("-"):
        try:
            cli.make_context("dsf", list(args), resilient_parsing=True)
        except click.ClickException as err:
            return err.format_message()
        return None
    name, rest = args[0], args[1:]
    command = cli.get_command(click.Context(cli), name)
    if command is None:
        return f"no subcommand {name!r} (dsf has {', '.join(sorted(cli.commands))})"
    try:
        command.make_context(f"dsf {name}", list(rest))
    except click.exceptions.Exit:  # --help
        return None
    except click.ClickException as err:
        return err.format_message()
    return None


def _cases(kind: str):
    for page in PAGES:
        items = relative_links(page) if kind == "links" else dsf_commands(page)
        for item in items:
            label = item if kind == "links" else " ".join(["dsf", *item])
            yield pytest.param(page, item, id=f"{page.relative_to(ROOT)}:{label}"[:120])


def test_the_guide_has_its_pages():
    names = {p.name for p in PAGES}
    assert {"README.md", "architecture.md", "run-config.md", "parallel-layouts.md", "planner.md", "launching.md",
            "fine-tuning.md", "checkpoints.md", "observability.md", "benchmarks.md"} <= names
    linked = {Path(t.partition("#")[0]).name for t in relative_links(ROOT / "README.md")}
    assert {p.name for p in PAGES if p.parent == ROOT / "docs"} <= linked, "a docs page the README does not link"


@pytest.mark.parametrize("page, target", list(_cases("links")))
def test_every_link_resolves(page, target):
    assert link_problem(page, target) is None, f"{page.relative_to(ROOT)}: {link_problem(page, target)}"


@pytest.mark.parametrize("page, args", list(_cases("commands")))
def test_every_dsf_command_parses(page, args):
    problem = parse_problem(args)
    assert problem is None, f"{page.relative_to(ROOT)}: dsf {shlex.join(args)}: {problem}"


def test_the_checks_catch_a_broken_link_and_an_unknown_flag(tmp_path):
    """The checkers themselves: what a mistake in the docs would look like is found."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## `dsf plan`: which layout, and why\n\n[ok](#dsf-plan-which-layout-and-why) "
                    "[gone](missing.md) [bad anchor](#no-such-heading)\n\n```bash\ndsf plan --modle x\n```\n")
    assert link_problem(page, "#dsf-plan-which-layout-and-why") is None
    assert "no file" in link_problem(page, "missing.md")
    assert "no heading" in link_problem(page, "#no-such-heading")
    assert relative_links(page) == ["#dsf-plan-which-layout-and-why", "missing.md", "#no-such-heading"]
    assert dsf_commands(page) == [["plan", "--modle", "x"]]
    assert "--modle" in parse_problem(["plan", "--modle", "x"])
    assert "no subcommand" in parse_problem(["trian", "run.yaml"])
    assert "launcher" in parse_problem(["launch", "run.yaml", "--launcher", "carrier-pigeon"])
    assert parse_problem(["launch", "RUN.yaml", "--hostfile", "H", "--dry-run"]) is None
