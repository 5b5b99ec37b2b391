"""The documentation runs: every ```python and ```bash block of README.md and docs/*.md is a test case, named by its
page and line, so an example that stops working fails here instead of misleading a reader.

- Python blocks run in order in one namespace per page (a later block may use what an earlier one defined), in
  this process, with the page's scratch folder as the working directory.
- Shell blocks run in order with bash in the page's scratch folder, which links to the repository's top-level
  files and folders (so `examples/tiny_cpu.yaml` resolves and a run's `runs/` stays out of the repository), with
  this interpreter's environment first on PATH (`grpo-fast`, `python`).
- A comment on the line before a block changes how it runs:
  `<!-- doc-test: skip (why) -->`      not run (a GPU, several nodes, the network, hours, an install); the reason
                                       is required and is the skip's message;
  `<!-- doc-test: run-with ARGS -->`   ARGS appended to each command of the block (e.g. `--max-steps 2`), to keep
                                       a run that is complete as written short here.
Then the links: every relative link of a page leads to a file that exists, and every #anchor to a heading of its
target page (GitHub's anchors: lowercase, punctuation dropped, spaces to hyphens)."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"python": "python", "bash": "shell", "shell": "shell", "sh": "shell"}
DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
SKIP = re.compile(r"^skip\s*\((.+)\)$")
RUN_WITH = re.compile(r"^run-with\s+(.+)$")
SHELL_TIMEOUT_S = 300


@dataclass
class Block:
    page: Path
    line: int                   # 1-based line of the opening fence
    kind: str                   # "python" or "shell"
    code: str
    directive: Optional[str]    # the doc-test comment right before the block, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[tuple[int, str, str, Optional[str]]]:
    """(line, language, code, directive) of every fenced block of a page, in order."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```\s*([\w+-]*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, language, start = opening.group(1), opening.group(2).lower(), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        previous = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.match(previous)
        found.append((start + 1, language, "\n".join(body) + "\n", directive.group(1) if directive else None))
        i += 1
    return found


def run_blocks() -> list[Block]:
    return [Block(page, line, RUN_LANGUAGES[language], code, directive)
            for page in PAGES for line, language, code, directive in fenced_blocks(page)
            if language in RUN_LANGUAGES]


BLOCKS = run_blocks()


def skip_reason(block: Block) -> Optional[str]:
    match = SKIP.match(block.directive or "")
    return match.group(1).strip() if match else None


def with_arguments(code: str, arguments: str) -> str:
    """The shell code with `arguments` appended to each command (continuation lines joined, comments kept apart)."""
    commands = []
    for line in code.replace("\\\n", " ").split("\n"):
        command = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if command:
            commands.append(f"{command} {arguments}")
    return "\n".join(commands) + "\n"


class Page:
    """What a page's blocks share: the Python namespace, the scratch folder, and how far its blocks have run."""

    def __init__(self, page: Path, folder: Path):
        self.folder = folder
        for entry in ROOT.iterdir():
            if entry.name not in {"runs", ".git", ".venv"} and not entry.name.startswith(".venv-"):
                (self.folder / entry.name).symlink_to(entry)
        self.namespace: dict = {"__name__": f"doc_{page.stem}"}
        self.done: dict[int, Optional[str]] = {}       # line -> None (passed) or why it failed


PAGE_STATE: dict[Path, Page] = {}


def run_python(block: Block, page: Page):
    previous = os.getcwd()
    os.chdir(page.folder)
    try:
        exec(compile(block.code, block.name, "exec"), page.namespace)
    finally:
        os.chdir(previous)


def run_shell(block: Block, page: Page):
    run_with = RUN_WITH.match(block.directive or "")
    code = with_arguments(block.code, run_with.group(1)) if run_with else block.code
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=page.folder, env=environment,
                          capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    assert done.returncode == 0, (f"{block.name} exited {done.returncode}:\n{code}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")


def run_in_order(block: Block, scratch):
    """Runs the page's earlier blocks of the same kind first (once), then this one."""
    if block.page not in PAGE_STATE:
        PAGE_STATE[block.page] = Page(block.page, scratch.mktemp(f"doc-{block.page.stem}"))
    page = PAGE_STATE[block.page]
    for earlier in [b for b in BLOCKS if b.page == block.page and b.kind == block.kind and b.line <= block.line]:
        if earlier.line in page.done:
            if page.done[earlier.line] is not None and earlier is not block:
                pytest.fail(f"{earlier.name}, which this block continues, failed: {page.done[earlier.line]}")
            continue
        if skip_reason(earlier) is not None:
            page.done[earlier.line] = None
            continue
        try:
            (run_python if block.kind == "python" else run_shell)(earlier, page)
        except BaseException as error:
            page.done[earlier.line] = f"{type(error).__name__}: {error}"[:500]
            raise
        page.done[earlier.line] = None


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs(block: Block, tmp_path_factory):
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(reason)
    run_in_order(block, tmp_path_factory)


def test_every_directive_is_known_and_every_skip_gives_its_reason():
    for page in PAGES:
        lines = page.read_text().split("\n")
        for number, line in enumerate(lines, 1):
            directive = DIRECTIVE.match(line.strip())
            if directive is None:
                continue
            text = directive.group(1)
            assert SKIP.match(text) or RUN_WITH.match(text), (
                f"{page.relative_to(ROOT)}:{number}: doc-test comment {text!r}: expected 'skip (reason)' or "
                f"'run-with ARGS'")
            following = next((nxt.strip() for nxt in lines[number:] if nxt.strip()), "")
            assert re.match(r"^```\s*(python|bash|shell|sh)\s*$", following), (
                f"{page.relative_to(ROOT)}:{number}: doc-test comment not followed by a python or shell block")
    assert BLOCKS, "no code blocks found"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, counts = set(), {}
    for line in prose(page.read_text()).split("\n"):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = anchor(heading.group(1))
            found.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
            counts[slug] = counts.get(slug, 0) + 1
    return found


def prose(text: str) -> str:
    """The page without its fenced blocks (their lines kept empty, so line numbers hold)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.strip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def test_every_relative_link_and_anchor_exists():
    missing = []
    for page in PAGES:
        for number, line in enumerate(prose(page.read_text()).split("\n"), 1):
            for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z]+:", target):
                    continue
                path, _, fragment = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not file.exists():
                    missing.append(f"{where}: no file {path}")
                elif fragment and (file.suffix != ".md" or fragment not in anchors(file)):
                    missing.append(f"{where}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not missing, "\n".join(missing)


def test_the_readme_is_a_guide_whose_commands_are_ci():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 300, "README.md: at most 300 lines; move details to a page of docs/"
    commands = [code.strip() for _, language, code, _ in fenced_blocks(ROOT / "README.md") if language == "bash"]
    test_command = next(c for c in commands if c.endswith("python -m pytest -n 2"))
    assert test_command in (ROOT / ".ci" / "run").read_text().split("\n"), "the README's test command is what CI runs"
    assert any(c.endswith("&& grpo-fast train") for c in commands), "the README's first command runs the default job"


def test_skipped_blocks_still_parse():
    """A block that is not run is still valid Python or bash, so a typo there fails too."""
    for block in BLOCKS:
        if skip_reason(block) is None:
            continue
        if block.kind == "python":
            compile(block.code, block.name, "exec")
        else:
            done = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
            assert done.returncode == 0, f"{block.name}: {done.stderr}"
