"""The fenced blocks of the README and docs/, read out of the files, and the commands in them:
a test runs or parses the text a reader copies, never a copy of it kept in a test, so a block
edited into something that does not work fails its test (tests/test_doc_commands.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

from pipeline.settings import ROOT

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
OPERATORS = {"&&", "||", ";", "|", ">", ">>", "<", "&", "(", ")"}


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # README.md, docs/aws.md, ...
    line: int  # the opening fence's, 1-based
    lang: str  # sh, yaml, or "" for an unlabelled block
    heading: str  # the nearest heading above it
    text: str  # dedented to its fence

    def __str__(self) -> str:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        return f"{self.page}:{self.line} ({self.lang or 'unlabelled'}, under {self.heading!r}): {first[:70]}"


def pages() -> list[Path]:
    return [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, an indented one (inside a list item) included."""
    found, heading, lines, i = [], "", page.read_text().splitlines(), 0
    name = str(page.relative_to(ROOT))
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = lines[i].lstrip("#").strip()
        opened = FENCE.match(lines[i])
        if opened:
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            found.append(Block(name, start + 1, opened.group(2), heading, textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def block(page: str, marker: str) -> Block:
    """The one block of `page` that holds `marker`: how a test names the block it runs."""
    named = [b for b in blocks(Path(ROOT) / page) if marker in b.text]
    assert len(named) == 1, f"{page}: {len(named)} fenced blocks hold {marker!r}, not 1"
    return named[0]


def commands(text: str) -> list[str]:
    """The block's commands as a shell reads them: continued lines joined, blank lines and
    comments dropped, a YAML list item's `- ` taken off."""
    joined, out = text.replace("\\\n", " "), []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line.startswith("- "):
            line = line[2:].strip()
        if line:
            out.append(line)
    return out


def pipeline_argvs(command: str) -> list[list[str]]:
    """The argument lists given to `python -m pipeline` (or scripts/cluster_run.py, which hands
    its own to `run`) in one command line, each cut at the shell's first operator after it."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, found = list(lexer), []
    for i, word in enumerate(words):
        rest = _until_operator(words[i + 1:])
        if word.endswith("python") and rest[:2] == ["-m", "pipeline"]:
            found.append(rest[2:])
        elif word.endswith("scripts/cluster_run.py") and len(rest) >= 2:
            found.append(["run", "--date", rest[0], "--input", rest[1], "--deadline-min", "25", *rest[2:]])
    return found


def ray_argvs(command: str) -> list[list[str]]:
    """The argument lists given to Ray's CLI (`ray ...`) in one command line."""
    words = shlex.split(command)
    return [_until_operator(words[i + 1:]) for i, word in enumerate(words) if word == "ray"
            and (i == 0 or "=" in words[i - 1])]  # the command itself, after any VAR=value


def _until_operator(words: list[str]) -> list[str]:
    return words[:next((i for i, w in enumerate(words) if w in OPERATORS), len(words))]


def clean_clone(where: Path) -> Path:
    """The repository as a clone of it is, as scripts/install.sh leaves it: its files (tracked,
    or new and not ignored) copied, and .venv, which install.sh makes, linked. The README's
    commands are then typed as printed, from the clone's root: `.venv/bin/python`, `demo/`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = Path(ROOT) / name
        if source.is_file() and not source.is_symlink() and name != ".venv":  # a file deleted but not staged: gone
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, where / name)
    (where / ".venv").symlink_to(Path(ROOT) / ".venv")
    return where


def a_reader_s_env() -> dict[str, str]:
    """The environment of a shell that has set nothing of the project's (the demo sets what it needs)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_", "CN_", "REDIS_", "SMTP_", "AWS_", "SOFTHSM2_", "P11_")) and k != "PYTHONPATH"}


def typed(lines: list[str], env: dict, cwd: Path | str = ROOT, timeout: float = 900) -> list[tuple[str, int, str]]:
    """Each line typed into one bash in `cwd`, as a reader types them: (line, exit status, output)."""
    script = "".join(f"{line} 2>&1\necho \"@@exit $?@@\"\n" for line in lines)
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    said, out = [], done.stdout
    for line in lines:
        before, _, out = out.partition("@@exit ")
        code, _, out = out.partition("@@")
        said.append((line, int(code) if code.isdigit() else -1, before + (done.stderr if not code else "")))
    return said


def shown(said: list[tuple[str, int, str]]) -> str:
    """What a failed assertion prints: each line, its exit status and the end of its output."""
    return "\n".join(f"{line} -> {code}\n{out[-1500:]}" for line, code, out in said)
