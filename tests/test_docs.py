"""The documentation is tested: every example in docs/*.md runs, and every message it quotes is
the message the code produces.

How a page is written so that this file can check it (one scheme for every page):

* A ```python block is an example. The blocks of one page run in document order in one
  namespace, fresh for each page, as if the page were a script (``__name__ == "__main__"``).
  Registrations an example makes are undone after the page (the ``scoped_registry`` fixture),
  and the process default target is reset.
* A block preceded by the comment ``<!-- gpu -->`` needs CUDA. Pages without such blocks run in
  ``test_page_runs``. A page with GPU blocks also runs in full in ``test_page_runs_on_cuda``
  (the GPU tier), which skips with a reason where CUDA is absent; ``test_page_runs`` then runs
  the page's other blocks alone, so CPU blocks never depend on GPU blocks.
* A quoted message is a ```text block preceded by a directive comment that produces it:

  - ``<!-- error: STATEMENT -->``: STATEMENT runs in the page's namespace at that point of the
    page and must raise; the block reads ``ExceptionName: message``.
  - ``<!-- warning: STATEMENT -->``: STATEMENT must emit a warning; the block reads
    ``WarningName: message``.
  - ``<!-- output: EXPRESSION -->``: the block is ``str(EXPRESSION)``.

  In a quoted block, ``...`` stands for any run of characters (temporary paths, module names,
  object addresses); everything else must match exactly, line breaks included. A ```text block
  without a directive, or a directive without its block, fails ``test_every_quote_is_checked``,
  so no message is quoted without a test producing it. Error text is quoted in ```text blocks
  only, never inline in prose.
* A ```yaml block preceded by ``<!-- yaml: NAME -->`` becomes the string ``NAME`` in the page's
  namespace, for the examples and directives after it; every ```yaml block is named and used.
* A block preceded by ``<!-- file: PATH -->`` is a whole file of a walkthrough, labelled with
  the path it is written to. It is not run here: the page's own test writes it and runs what
  the page says (``adding-an-op-family.md``: ``tests/test_adding_a_family.py``).
* ``docs_harness`` in the namespace (directives only) does what a page cannot do from the
  public API: ``import_backend`` installs a throwaway backend distribution and imports it
  through TileOPs' own entry-point loader, as TileOPs does when the first op is constructed;
  ``registrations_undone()`` is a context manager that undoes the registrations made inside
  it, so that a page can show several broken registrations one after the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from tileops.backend import set_default_target
from tileops.core import discovery
from tileops.core.registry import journal

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE_LANGUAGES = {"python", "text", "yaml", "sh", "toml", ""}

_FENCE = re.compile(r"^```([A-Za-z]*)\s*$")
_COMMENT = re.compile(r"^<!--\s*(gpu|error|warning|output|yaml|file)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclasses.dataclass
class Block:
    """One fenced block of a page, with the directive comment right before it (if any)."""

    page: str
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    directive: str | None = None  # gpu, error, warning, output, yaml or file
    argument: str = ""

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def parse(page: Path) -> list[Block]:
    """Every fenced block of ``page`` in order; a directive is the last non-blank line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"docs/{page.name}:{start + 1}: a fenced block is never closed")
        block = Block(page.name, start + 1, match.group(1), "\n".join(lines[start + 1 : end]) + "\n")
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        comment = _COMMENT.match(lines[before].strip()) if before >= 0 else None
        if comment:
            block.directive, block.argument = comment.group(1), (comment.group(2) or "")
        blocks.append(block)
        i = end + 1
    return blocks


def _pattern(quoted: str) -> re.Pattern:
    """``quoted`` as a regular expression in which ``...`` matches anything."""
    parts = [re.escape(part) for part in quoted.rstrip("\n").split("...")]
    return re.compile(".*?".join(parts), re.DOTALL)


def _assert_quote(block: Block, actual: str) -> None:
    if not _pattern(block.text).fullmatch(actual):
        raise AssertionError(
            f"{block.where}: the quoted text does not match what the code produces.\n"
            f"--- quoted\n{block.text.rstrip()}\n--- produced\n{actual}\n---"
        )


class DocsHarness:
    """What the pages' directives may use beyond the public API."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    @contextlib.contextmanager
    def registrations_undone(self):
        journal.open()
        try:
            yield
        finally:
            journal.close(undo=True)

    def import_backend(self, name: str, module: str, source: str, distribution: str = "example-backend") -> None:
        """Install a distribution whose ``tileops.backends`` entry point ``name = module`` holds
        ``source``, and import it through TileOPs' loader (warnings and all)."""
        root = self.tmp_path / f"site-{name}"
        root.mkdir()
        (root / f"{module}.py").write_text(source)
        info = root / f"{distribution.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[tileops.backends]\n{name} = {module}\n")
        sys.path.insert(0, str(root))
        try:
            (entry_point,) = [
                ep for ep in importlib.metadata.entry_points(group="tileops.backends") if ep.name == name
            ]
            discovery._load_one(entry_point)
        finally:
            sys.path.remove(str(root))
            sys.modules.pop(module, None)


def _run_statement(source: str, namespace: dict, where: str) -> None:
    exec(compile(source, where, "exec"), namespace)  # noqa: S102 - the docs' own examples


def run_page(page: Path, tmp_path: Path, *, with_gpu_blocks: bool) -> None:
    namespace: dict = {"__name__": "__main__", "docs_harness": DocsHarness(tmp_path)}
    failures_before = len(discovery._failures)
    torch._dynamo.reset()
    try:
        for block in parse(page):
            if block.directive == "file":
                continue  # a walkthrough's file: its page's own test writes and runs it
            if block.language == "python":
                if block.directive == "gpu" and not with_gpu_blocks:
                    continue
                _run_statement(block.text, namespace, block.where)
            elif block.language == "yaml":
                namespace[block.argument] = block.text
            elif block.language == "text":
                _check_quote(block, namespace)
    finally:
        set_default_target(None)
        del discovery._failures[failures_before:]
        torch._dynamo.reset()


def _check_quote(block: Block, namespace: dict) -> None:
    if block.directive == "output":
        value = eval(compile(block.argument, block.where, "eval"), namespace)  # noqa: S307
        _assert_quote(block, str(value))
    elif block.directive == "error":
        try:
            _run_statement(block.argument, namespace, block.where)
        except Exception as error:  # noqa: BLE001 - any exception the page says is raised
            _assert_quote(block, f"{type(error).__name__}: {error}")
        else:
            raise AssertionError(f"{block.where}: `{block.argument}` raised nothing")
    elif block.directive == "warning":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run_statement(block.argument, namespace, block.where)
        produced = [f"{w.category.__name__}: {w.message}" for w in caught]
        if not any(_pattern(block.text).fullmatch(text) for text in produced):
            raise AssertionError(
                f"{block.where}: no warning matches the quoted one.\n--- quoted\n{block.text.rstrip()}\n"
                f"--- produced\n" + "\n".join(produced)
            )


def _has_gpu_blocks(page: Path) -> bool:
    return any(b.directive == "gpu" for b in parse(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs(page, scoped_registry, tmp_path):
    run_page(page, tmp_path, with_gpu_blocks=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [p for p in PAGES if _has_gpu_blocks(p)], ids=lambda p: p.name)
def test_page_runs_on_cuda(page, scoped_registry, tmp_path):
    run_page(page, tmp_path, with_gpu_blocks=True)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quote_is_checked(page):
    problems = []
    for block in parse(page):
        if block.language not in FENCE_LANGUAGES:
            problems.append(f"{block.where}: fence language {block.language!r}; use one of {sorted(FENCE_LANGUAGES)}")
        if block.language == "text" and block.directive not in ("error", "warning", "output"):
            problems.append(f"{block.where}: a ```text block quotes a message but no directive produces it")
        if block.directive in ("error", "warning", "output") and block.language != "text":
            problems.append(f"{block.where}: an {block.directive} directive must precede a ```text block")
        if block.directive == "gpu" and block.language != "python":
            problems.append(f"{block.where}: <!-- gpu --> marks ```python blocks only")
        if block.directive == "file" and not block.argument:
            problems.append(f"{block.where}: <!-- file: PATH --> names the file's path")
        if block.language == "yaml" and block.directive != "file" and (
            block.directive != "yaml" or not block.argument.isidentifier()
        ):
            problems.append(f"{block.where}: a ```yaml block needs <!-- yaml: NAME --> before it")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_yaml_example_is_used(page):
    blocks = parse(page)
    unused = []
    for i, block in enumerate(blocks):
        if block.language != "yaml" or block.directive == "file":
            continue
        later = "\n".join(b.text + b.argument for b in blocks[i + 1 :] if b.language in ("python", "text"))
        if not re.search(rf"\b{re.escape(block.argument)}\b", later):
            unused.append(f"{block.where}: yaml example {block.argument!r} is never used by a later example")
    assert not unused, "\n".join(unused)


def _slug(heading: str) -> str:
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{page.name}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_the_index_links_every_page():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES if p.name != "index.md" and f"({p.name}" not in index]
    assert not missing, f"docs/index.md does not link {missing}"


_SELF_CHECK = """\
```python
value = 41 + 1
```

<!-- output: value -->
```text
42
```

<!-- error: raise KeyError("no such key: spam") -->
```text
KeyError: 'no such key: ...'
```

<!-- warning: import warnings; warnings.warn("careful", RuntimeWarning) -->
```text
RuntimeWarning: careful
```
"""


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("42\n", "43\n"),  # a quoted output that differs
        ("KeyError: 'no such", "LookupError: 'no such"),  # another exception class
        ('raise KeyError("no such key: spam")', "pass"),  # nothing raised
        ("RuntimeWarning: careful", "RuntimeWarning: careless"),  # another warning
    ],
)
def test_the_checker_refuses_a_quote_the_code_does_not_produce(tmp_path, old, new):
    page = tmp_path / "page.md"
    page.write_text(_SELF_CHECK)
    run_page(page, tmp_path, with_gpu_blocks=False)  # the page as written passes
    page.write_text(_SELF_CHECK.replace(old, new))
    with pytest.raises(AssertionError):
        run_page(page, tmp_path, with_gpu_blocks=False)
