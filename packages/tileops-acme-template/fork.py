"""Fork this template into a backend of your own: ``python fork.py NAME DEST``.

Copies the template folder to DEST and renames everything that says ``acme``: the distribution
(``tileops-acme-template`` becomes ``tileops-NAME-backend``), the import package (``tileops_acme``
becomes ``tileops_NAME``), the target, the device type and the entry point (``NAME``), class-name
prefixes (``Acme`` becomes ``Name``, ``my_chip`` gives ``MyChip``), file names, and the prose,
with "a"/"an" in front of the new name. README passages between ``<!-- template-only -->`` and
``<!-- /template-only -->`` are about forking and are left out of the fork, as is this script.

Standard library only, so it runs before anything is installed.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent
OLD = "acme"
# A target name, a device type, and the tail of a Python module name all at once.
VALID_NAME = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
# "builtin" names the in-tree implementations; a device type TileOPs serves in-tree would make
# the fork's detector claim those devices.
RESERVED = {"builtin": "names TileOPs' in-tree implementations", "cpu": "is an in-tree device type", "cuda": "is an in-tree device type"}
# Not part of a fork: this script, and what building or testing the template leaves behind.
LEFT_OUT = shutil.ignore_patterns("fork.py", "__pycache__", ".pytest_cache", ".venv", "dist", "build", "*.egg-info")
TEMPLATE_DESCRIPTION = re.compile(r"^description = .*$", re.MULTILINE)
TEMPLATE_ONLY = re.compile(r"<!-- template-only -->.*?<!-- /template-only -->\n?", re.DOTALL)


class ForkError(Exception):
    """A fork that cannot be made; the message is the one line the user sees."""


def check_name(name: str) -> None:
    if not VALID_NAME.fullmatch(name):
        raise ForkError(
            f"NAME must be lowercase letters and digits, starting with a letter, with single underscores between words "
            f"(it names the target, the device type and the module tileops_NAME), e.g. 'zeta' or 'my_chip'; got {name!r}"
        )
    if name == OLD:
        raise ForkError(f"NAME must differ from the template's own name {OLD!r}")
    if name in RESERVED:
        raise ForkError(f"NAME {name!r} {RESERVED[name]}; choose the name of your own device")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def renamer(name: str):
    """The function that turns the template's text (or a file name) into the fork's."""
    capitalised = "".join(part.capitalize() for part in name.split("_"))
    distribution = f"tileops-{name.replace('_', '-')}-backend"

    def with_article(match: re.Match) -> str:
        word = article(name)
        return (word.capitalize() if match.group(1)[0] == "A" else word) + " "

    def rename(text: str) -> str:
        text = text.replace("tileops-acme-template", distribution)
        text = re.sub(r"\b(an?|An?) (?=acme\b|Acme\b|ACME\b)", with_article, text)
        return text.replace("Acme", capitalised).replace("ACME", name.upper()).replace(OLD, name)

    return rename


def fork(name: str, destination: Path) -> Path:
    check_name(name)
    if destination.exists() and any(destination.iterdir()):
        raise ForkError(f"DEST {str(destination)!r} exists and is not empty; name a new folder")
    rename = renamer(name)
    staging = destination.with_name(destination.name + ".partial")
    if staging.exists():
        raise ForkError(f"{str(staging)!r} is in the way (left by an interrupted fork?); remove it first")
    shutil.copytree(TEMPLATE, staging, ignore=LEFT_OUT)
    # Deepest paths first, so that renaming a folder never moves a path still to be visited.
    for path in sorted(staging.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".md":
                text = TEMPLATE_ONLY.sub("", text)
            if path.name == "pyproject.toml":
                text = TEMPLATE_DESCRIPTION.sub(f'description = "The TileOPs backend for {name} devices."', text)
            path.write_text(rename(text), encoding="utf-8")
        if OLD in path.name:
            path.rename(path.with_name(rename(path.name)))
    if destination.exists():
        destination.rmdir()
    staging.rename(destination)
    return destination


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in {"-h", "--help"}:
        print("usage: python fork.py NAME DEST   (e.g. python fork.py zeta ~/tileops-zeta-backend)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    try:
        made = fork(argv[0], Path(argv[1]).resolve())
    except ForkError as error:
        print(f"fork.py: {error}", file=sys.stderr)
        return 2
    print(f"forked the template as {renamer(argv[0])('tileops-acme-template')} into {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
