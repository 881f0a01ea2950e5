"""The walkthrough of docs/adding-an-op-family.md, executed.

The page adds the ``scale`` family (``ScaleFwdOp``) and shows every file of it whole, each
block labelled ``<!-- file: PATH -->`` (read as tests/test_docs.py reads every page). Here the
source of tileops-core, tileops-ops and tileops-kernels-cuda and the manifest are copied into a
temporary folder, the page's files are written into the copy, and every command the page shows
(an ```sh block of one command) runs there with the copy's source folders on ``PYTHONPATH``,
in a fresh interpreter; where a bare block follows, the command must print it (a line ``...``
stands for any lines, ``...`` within a line for any text). The op is called on the CPU, the
family's own test runs (the conformance kit), and no file outside the family's three folders
may differ from the original. The compile tier compiles the page's TileLang program for sm_90.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_python
from test_docs import parse

PAGE = ROOT / "docs" / "adding-an-op-family.md"
#: What is copied: the three packages' source folders and the manifest.
COPIED = ("packages/tileops-core/src", "packages/tileops-ops/src", "packages/tileops-kernels-cuda/src", "manifest")
SOURCE_FOLDERS = COPIED[:3]
#: The link through which tileops-ops ships the manifest; in the copy it points at the copy's.
MANIFEST_LINK = "packages/tileops-ops/src/tileops/ops/manifest"
#: The three folders a family lives in, and tests/ for its test.
FAMILY_FOLDERS = (
    "manifest/",
    "packages/tileops-ops/src/tileops/ops/scale/",
    "packages/tileops-kernels-cuda/src/tileops/kernels/cuda/scale/",
)
TESTS = "tests/"
#: How the page's commands are run: the installed console scripts, as modules of the copy.
PROGRAMS = {
    "tileops": ["-m", "tileops.cli"],
    "pytest": ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", "."],
}


@dataclasses.dataclass(frozen=True)
class Command:
    line: int  # of the page, for the test's id
    argv: tuple[str, ...]
    prints: str | None  # what the page shows it printing, or None where it shows nothing


def page_files() -> dict[str, str]:
    """Every file the page shows, by its path in the repository."""
    files: dict[str, str] = {}
    for block in parse(PAGE):
        if block.directive == "file":
            assert block.argument not in files, f"{block.where}: {block.argument} is shown twice"
            files[block.argument] = block.text
    return files


def page_commands() -> list[Command]:
    """Every command the page shows (one per ```sh block), with the bare block after it, if any."""
    blocks = parse(PAGE)
    commands = []
    for i, block in enumerate(blocks):
        if block.language == "":
            assert i and blocks[i - 1].language == "sh", f"{block.where}: a bare block follows no command"
        if block.language != "sh":
            continue
        lines = block.text.splitlines()
        assert len(lines) == 1, f"{block.where}: an ```sh block shows one command, got {lines}"
        argv = tuple(shlex.split(lines[0]))
        assert argv[0] in PROGRAMS, f"{block.where}: {argv[0]} is none of the programs the test runs ({sorted(PROGRAMS)})"
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        prints = following.text if following is not None and following.language == "" else None
        commands.append(Command(block.line, argv, prints))
    return commands


def output_pattern(shown: str) -> re.Pattern:
    """``shown`` as a regular expression: a line ``...`` matches any lines (none too), ``...``
    within a line any text of that line."""
    lines = [None if line == "..." else ".*?".join(map(re.escape, line.split("..."))) for line in shown.rstrip("\n").split("\n")]
    pattern = ""
    for i, line in enumerate(lines):
        if line is None:
            continue
        if i == 1 and lines[0] is None:
            pattern += r"(?:.*\n)*?"  # any lines before the first one shown
        elif i > 0:
            pattern += r"\n(?:.*\n)*?" if lines[i - 1] is None else r"\n"
        pattern += line
    if lines[-1] is None:
        pattern += r"(?:\n.*)*"  # any lines after the last one shown
    return re.compile(pattern)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Copy:
    root: Path
    originals: dict[str, str]  # path -> digest of every file copied, before the family was written
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """``python -P *args`` in the copy's root, importing TileOPs from the copy."""
        return subprocess.run(
            [sys.executable, "-P", *args], cwd=self.root, env=self.env, capture_output=True, text=True, timeout=600
        )


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Copy:
    root = tmp_path_factory.mktemp("family")
    for folder in COPIED:
        shutil.copytree(ROOT / folder, root / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    link = root / MANIFEST_LINK
    link.unlink()
    link.symlink_to(os.path.relpath(root / "manifest", link.parent))
    originals = {
        str(path.relative_to(root)): _digest(path) for path in sorted(root.rglob("*")) if path.is_file() and not path.is_symlink()
    }
    for path, text in page_files().items():
        target = root / path
        assert not target.exists(), f"the page's {path} exists already: a new family adds files, it changes none"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(root / folder) for folder in SOURCE_FOLDERS),
        "PYTHONSAFEPATH": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # the copy is compared file by file afterwards
    }
    return Copy(root, originals, env)


def test_the_family_lives_in_its_three_folders():
    paths = list(page_files())
    outside = [path for path in paths if not path.startswith((*FAMILY_FOLDERS, TESTS))]
    assert not outside, f"the page writes files outside the family's folders and tests/: {outside}"
    for folder in FAMILY_FOLDERS:
        assert any(path.startswith(folder) for path in paths), f"the page shows no file in {folder}"


def test_the_page_states_what_the_family_took():
    files = page_files()
    family = {path: text for path, text in files.items() if not path.startswith(TESTS)}
    tests = {path: text for path, text in files.items() if path.startswith(TESTS)}
    lines = sum(len(text.splitlines()) for text in family.values())
    test_lines = sum(len(text.splitlines()) for text in tests.values())
    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    stated = f"**{len(family)} files of {lines} lines** in its three folders"
    assert stated in text, f"the page must say {stated!r}: that is what the files it shows count"
    stated_test = f"its test **{len(tests)} file of {test_lines} lines**"
    assert stated_test in text, f"the page must say {stated_test!r}: that is what the test it shows counts"


def test_the_output_pattern_reads_the_page_as_it_says():
    shown = "...\nOK    Op (...)\n...\n... files: all OK"
    assert output_pattern(shown).fullmatch("OK    Other (a)\nOK    Op (b.yaml)\nOK    More (c)\n2 files: all OK")
    assert output_pattern(shown).fullmatch("OK    Op (b.yaml)\n1 files: all OK")
    assert not output_pattern(shown).fullmatch("OK    Other (a)\n2 files: all OK")
    assert output_pattern("a\nb\n...").fullmatch("a\nb")
    assert not output_pattern("a\nb").fullmatch("a\nb\nc")


def test_the_family_passes_the_linter(copy):
    # CI lints the repository; the family lives on the page, so it is linted here.
    pytest.importorskip("ruff", reason="the linter is in the workspace's lint group")
    python_files = [path for path in page_files() if path.endswith(".py")]
    result = copy.run("-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), *python_files)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", page_commands(), ids=lambda c: f"line{c.line}-{' '.join(c.argv[:2])}")
def test_each_command_of_the_page_runs_and_prints_what_it_shows(copy, command):
    program, *args = command.argv
    result = copy.run(*PROGRAMS[program], *args)
    printed = result.stdout.rstrip("\n")
    assert result.returncode == 0, f"{' '.join(command.argv)} exited {result.returncode}:\n{printed}\n{result.stderr[-3000:]}"
    if command.prints is not None:
        assert output_pattern(command.prints).fullmatch(printed), (
            f"docs/{PAGE.name}:{command.line}: {' '.join(command.argv)} printed\n{printed}\n"
            f"--- the page shows\n{command.prints}"
        )


CPU_CALLS = """
import json, sys, torch
import tileops.cli, tileops.core, tileops.kernels.cuda.scale, tileops.ops, tileops.testing
from tileops.ops import FAMILIES, ScaleFwdOp

modules = {name: module.__file__ for name, module in sys.modules.items()
           if name.startswith("tileops.") and getattr(module, "__file__", None)}  # namespace packages have none
op = ScaleFwdOp(-1.5)
calls = [torch.randn(3, 5, 7, dtype=torch.bfloat16), torch.randn(8, 6).t(), torch.tensor(2.0), torch.randn(4096)]
for x in calls:
    y = op(x)
    reference = (x.float() * -1.5).to(x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(y, reference), (x.shape, y, reference)
print(json.dumps({"modules": modules, "served": sorted({key for key, _ in op.built_kernels()}),
                  "families": {family: [op.__name__ for op in ops] for family, ops in FAMILIES.items()}}))
"""


def test_the_op_runs_on_the_cpu_from_the_copy(copy):
    result = copy.run("-c", CPU_CALLS)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    elsewhere = {name: path for name, path in report["modules"].items() if not Path(path).resolve().is_relative_to(copy.root.resolve())}
    assert not elsewhere, f"modules imported from outside the copy: {elsewhere}"
    assert report["served"] == ["torch_cpu"]
    assert report["families"]["scale"] == ["ScaleFwdOp"]


def test_nothing_outside_the_family_changed(copy):
    # Runs after the commands above (tests run in file order), so it sees what they left.
    family = set(page_files())
    now = {str(path.relative_to(copy.root)) for path in copy.root.rglob("*") if path.is_file() and not path.is_symlink()}
    assert now - family == set(copy.originals), (
        f"files added outside the family: {sorted(now - family - set(copy.originals))}; "
        f"removed: {sorted(set(copy.originals) - now)}"
    )
    changed = [path for path, digest in copy.originals.items() if _digest(copy.root / path) != digest]
    assert not changed, f"files outside the family's folders changed: {changed}"
    link = copy.root / MANIFEST_LINK
    assert link.is_symlink() and link.resolve() == (copy.root / "manifest").resolve()


COMPILE = """
import torch
from tileops.kernels.cuda.scale import programs

kernel = programs.compile_program(torch.bfloat16, 2.0, {"kind": "cuda", "arch": "sm_90"}, threads=256, per_thread=4)
source = kernel.get_kernel_source()
assert "__global__" in source and "bfloat16_t" in source and "__launch_bounds__(256" in source, source
assert "0x1p+1f" in source, source  # the factor, 2.0, compiled in as a float32 constant
print("compiled", programs.__file__)
"""


@pytest.mark.compile
def test_the_pages_tilelang_program_compiles_for_sm90(copy, tmp_path):
    result = run_python(COMPILE, env={**copy.env, "TILELANG_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]
    compiled_from = Path(result.stdout.splitlines()[-1].removeprefix("compiled "))
    assert compiled_from.resolve().is_relative_to(copy.root.resolve()), compiled_from
