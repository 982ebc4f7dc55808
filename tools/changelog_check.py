"""The changelog check of ``.ci/run``: CHANGELOG.md is well formed and every user-visible
change since it exists is written in it.

Run from the repository root (``python tools/changelog_check.py [--root DIR]``); exit 0
when both hold, 1 with one line per problem otherwise.

**Form** (Keep a Changelog 1.1): the version headings are ``## [Unreleased]`` first,
without a date, then ``## [X.Y.Z] - YYYY-MM-DD`` (a SemVer and a real date), versions
strictly descending, dates never increasing; the sections of a version are ``###``
Added, Changed, Deprecated, Removed, Fixed or Security, each at most once; the top
released version is ``__version__`` of ``kafka_idem/_version.py``.

**History**: a commit whose first parent already had CHANGELOG.md (every commit after
the one that introduced it, and a merge judged as a whole against its first parent)
and that changes user-visible paths (:data:`USER_VISIBLE`, and the ``[project]`` table
of pyproject.toml) must change CHANGELOG.md too, unless its message has a line
``Changelog: none``. In a shallow clone the boundary commits (whose parents are not
there) cannot be judged: they are counted and said, never failed.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import itertools
import re
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CHANGELOG = "CHANGELOG.md"
VERSION_FILE = "kafka_idem/_version.py"
#: Paths whose change a user can see (a folder ends with ``/``); pyproject.toml counts
#: only when its ``[project]`` table changed.
USER_VISIBLE = ("kafka_idem/", "consumers/", "schemas/", "Dockerfile", "docker-compose.yml")
SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
OPT_OUT = re.compile(r"^\s*changelog:\s*none\s*$", re.IGNORECASE | re.MULTILINE)
HEADING = re.compile(r"^## (.*)$", re.MULTILINE)
RELEASED = re.compile(r"\[(?P<version>[^\]]+)\] - (?P<date>\S+)")
SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?")


def semver_key(version: str) -> tuple[int, int, int, int, tuple[tuple[int, int | str], ...]]:
    """Order of SemVer precedence: a pre-release sorts before its release."""
    match = SEMVER.fullmatch(version)
    if match is None:
        raise ValueError(version)
    major, minor, patch, pre = match.groups()
    parts = tuple((0, int(p)) if p.isdigit() else (1, p) for p in (pre or "").split(".") if p)
    return int(major), int(minor), int(patch), 0 if pre else 1, parts


def package_version(root: Path) -> str | None:
    """``__version__`` as ``kafka_idem/_version.py`` writes it (read, not imported)."""
    path = root / VERSION_FILE
    if not path.exists():
        return None
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == "__version__"
                        for t in node.targets)):
            return str(node.value.value)
    return None


def check_form(text: str, version: str | None) -> list[str]:
    """What is wrong with the changelog's shape (nothing: an empty list)."""
    errors: list[str] = []
    headings = [(m.group(1).strip(), m.start()) for m in HEADING.finditer(text)]
    if not headings or headings[0][0] != "[Unreleased]":
        errors.append(f"{CHANGELOG}: the first version heading must be '## [Unreleased]' "
                      f"(found {headings[0][0]!r})" if headings
                      else f"{CHANGELOG}: no '## [Unreleased]' heading")
    released: list[tuple[str, datetime.date]] = []
    for title, _ in headings[1:]:
        match = RELEASED.fullmatch(title)
        if match is None:
            errors.append(f"{CHANGELOG}: '## {title}' is not '## [X.Y.Z] - YYYY-MM-DD'")
            continue
        number, day = match.group("version"), match.group("date")
        if SEMVER.fullmatch(number) is None:
            errors.append(f"{CHANGELOG}: '{number}' is not a semantic version")
            continue
        try:
            released.append((number, datetime.date.fromisoformat(day)))
        except ValueError:
            errors.append(f"{CHANGELOG}: [{number}] has no valid date ({day!r})")
    for (newer, newer_day), (older, older_day) in itertools.pairwise(released):
        if semver_key(newer) <= semver_key(older):
            errors.append(f"{CHANGELOG}: versions must descend: [{newer}] is above [{older}]")
        if newer_day < older_day:
            errors.append(f"{CHANGELOG}: [{newer}] ({newer_day}) is dated before "
                          f"[{older}] ({older_day})")
    errors += check_sections(text, headings)
    if version is None:
        errors.append(f"{VERSION_FILE}: no __version__ to compare with")
    elif not released:
        errors.append(f"{CHANGELOG}: no released version (the package is {version})")
    elif released[0][0] != version:
        errors.append(f"{CHANGELOG}: the top released version is {released[0][0]}, "
                      f"but {VERSION_FILE} says {version}")
    return errors


def check_sections(text: str, headings: list[tuple[str, int]]) -> list[str]:
    """Each version's ``###`` sections are Keep a Changelog's, each at most once."""
    errors = []
    ends = [start for _, start in headings[1:]] + [len(text)]
    for (title, start), end in zip(headings, ends, strict=True):
        seen: set[str] = set()
        for name in re.findall(r"^### (.*)$", text[start:end], re.MULTILINE):
            name = name.strip()
            if name not in SECTIONS:
                errors.append(f"{CHANGELOG}: '{title}' has a section '### {name}' "
                              f"(one of {', '.join(SECTIONS)})")
            elif name in seen:
                errors.append(f"{CHANGELOG}: '{title}' has '### {name}' twice")
            seen.add(name)
    return errors


@dataclass
class History:
    """What the history check found: problems, and what it could not look at."""

    errors: list[str] = field(default_factory=list)
    checked: int = 0
    opted_out: int = 0
    unjudged: list[str] = field(default_factory=list)  # shallow boundary commits


def git(root: Path, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=root, input=stdin, capture_output=True,
                          text=True, check=True)
    return done.stdout


def project_table(root: Path, commit: str) -> object:
    """The ``[project]`` table of pyproject.toml at ``commit`` (None: no such file)."""
    try:
        text = git(root, "show", f"{commit}:pyproject.toml")
    except subprocess.CalledProcessError:
        return None
    return tomllib.loads(text).get("project")


def visible_paths(root: Path, parent: str, commit: str) -> list[str]:
    """The user-visible paths ``commit`` changes against ``parent``."""
    names = git(root, "diff", "--no-renames", "--name-only", parent, commit).splitlines()
    found = [n for n in names
             if any(n == p or (p.endswith("/") and n.startswith(p)) for p in USER_VISIBLE)]
    if "pyproject.toml" in names and project_table(root, parent) != project_table(root, commit):
        found.append("pyproject.toml [project]")
    return found + ([CHANGELOG] if CHANGELOG in names else [])


def check_history(root: Path, head: str = "HEAD") -> History:
    """Every commit reachable from ``head`` whose first parent had CHANGELOG.md."""
    out = History()
    lines = git(root, "rev-list", "--parents", head).splitlines()
    parents = {line.split()[0]: line.split()[1:] for line in lines}
    shallow = git(root, "rev-parse", "--is-shallow-repository").strip() == "true"
    boundary: set[str] = set()
    if shallow:
        shallow_file = Path(git(root, "rev-parse", "--git-path", "shallow").strip())
        shallow_file = shallow_file if shallow_file.is_absolute() else root / shallow_file
        boundary = set(shallow_file.read_text().split()) if shallow_file.exists() else set()
    firsts = sorted({ps[0] for ps in parents.values() if ps})
    answers = git(root, "cat-file", "--batch-check",
                  stdin="".join(f"{c}:{CHANGELOG}\n" for c in firsts)).splitlines()
    has_changelog = {c for c, answer in zip(firsts, answers, strict=True)
                     if not answer.endswith("missing")}
    for commit, ps in parents.items():
        if commit in boundary:
            out.unjudged.append(commit)
            continue
        if not ps or ps[0] not in has_changelog:
            continue
        out.checked += 1
        paths = visible_paths(root, ps[0], commit)
        if not paths or CHANGELOG in paths:
            continue
        message = git(root, "log", "-1", "--format=%B", commit)
        if OPT_OUT.search(message):
            out.opted_out += 1
            continue
        subject = message.splitlines()[0] if message.strip() else ""
        out.errors.append(f"commit {commit[:12]} ({subject[:60]!r}) changes "
                          f"{', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''} "
                          f"without a {CHANGELOG} line (or a 'Changelog: none' line in "
                          f"its message)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    parser.add_argument("--head", default="HEAD", help="the commit whose history to check")
    args = parser.parse_args(argv)
    root: Path = args.root
    path = root / CHANGELOG
    if not path.exists():
        print(f"changelog: {CHANGELOG} is missing", file=sys.stderr)
        return 1
    errors = check_form(path.read_text(), package_version(root))
    history = check_history(root, args.head)
    for line in errors + history.errors:
        print(f"changelog: {line}", file=sys.stderr)
    note = (f"changelog: {history.checked} commit(s) since {CHANGELOG} exists checked, "
            f"{history.opted_out} marked 'Changelog: none'")
    if history.unjudged:
        note += (f"; a shallow clone: {len(history.unjudged)} boundary commit(s) and the "
                 f"history before them not checked")
    print(note)
    return 1 if errors or history.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
