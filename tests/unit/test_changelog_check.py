"""tools/changelog_check.py on throwaway git repositories made with real git commands:
the changelog's form, and the rule that a user-visible change after CHANGELOG.md exists
comes with a changelog line or a ``Changelog: none`` line in its message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tools.changelog_check import check_form, check_history, main, package_version

GOOD = """# Changelog

## [Unreleased]

### Added

- Something new.

## [0.2.0] - 2026-12-05

### Changed

- Something changed.

### Deprecated

- Something going away in 0.3.0.

## [0.1.0] - 2026-11-30

### Added

- Everything.
"""

ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
       "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=ENV, check=True,
                          capture_output=True, text=True).stdout


def commit(repo: Path, message: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


PYPROJECT = ('[project]\nname = "kafka-idem"\ndynamic = ["version"]\n\n'
             '[tool.ruff]\nline-length = 100\n')


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose history begins before its CHANGELOG.md."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "first", {"kafka_idem/__init__.py": "", "pyproject.toml": PYPROJECT,
                           "kafka_idem/_version.py": '__version__ = "0.2.0"\n'})
    commit(repo, "before the changelog: not checked", {"kafka_idem/app.py": "x = 1\n"})
    commit(repo, "the changelog", {"CHANGELOG.md": GOOD})
    return repo


def errors_of(repo: Path) -> list[str]:
    return check_history(repo).errors


# --- form ---------------------------------------------------------------------------------


def test_a_well_formed_changelog_passes() -> None:
    assert check_form(GOOD, "0.2.0") == []


def test_this_repositorys_changelog_is_well_formed_and_names_the_package_version() -> None:
    version = package_version(ROOT)
    assert version is not None
    assert check_form((ROOT / "CHANGELOG.md").read_text(), version) == []


@pytest.mark.parametrize(("text", "version", "says"), [
    (GOOD, "0.3.0", "the top released version is 0.2.0, but kafka_idem/_version.py says 0.3.0"),
    (GOOD.replace("## [Unreleased]\n", ""), "0.2.0", "the first version heading"),
    (GOOD.replace("## [Unreleased]", "## [Unreleased] - 2026-12-06"), "0.2.0",
     "the first version heading"),
    (GOOD.replace("[0.1.0] - 2026-11-30", "[0.3.0] - 2026-11-30"), "0.2.0",
     "versions must descend: [0.2.0] is above [0.3.0]"),
    (GOOD.replace("[0.1.0] - 2026-11-30", "[0.2.0] - 2026-11-30"), "0.2.0",
     "versions must descend"),
    (GOOD.replace("[0.1.0] - 2026-11-30", "[0.1.0] - 2026-12-24"), "0.2.0",
     "is dated before"),
    (GOOD.replace("[0.1.0] - 2026-11-30", "[0.1] - 2026-11-30"), "0.2.0",
     "'0.1' is not a semantic version"),
    (GOOD.replace("[0.1.0] - 2026-11-30", "[0.1.0]"), "0.2.0",
     "'## [0.1.0]' is not '## [X.Y.Z] - YYYY-MM-DD'"),
    (GOOD.replace("2026-11-30", "2026-11-31"), "0.2.0", "has no valid date"),
    (GOOD.replace("### Deprecated", "### Improved"), "0.2.0", "a section '### Improved'"),
    (GOOD.replace("### Deprecated", "### Changed"), "0.2.0", "'### Changed' twice"),
    (GOOD, None, "no __version__"),
])
def test_a_malformed_changelog_fails_saying_why(text: str, version: str | None,
                                                says: str) -> None:
    errors = check_form(text, version)
    assert any(says in e for e in errors), errors


def test_pre_releases_sort_below_their_release() -> None:
    text = GOOD.replace("## [0.2.0] - 2026-12-05", "## [0.2.0] - 2026-12-05\n\n"
                        "## [0.2.0-rc.1] - 2026-12-04")
    assert check_form(text, "0.2.0") == []
    swapped = GOOD.replace("## [0.2.0] - 2026-12-05", "## [0.2.0-rc.1] - 2026-12-05\n\n"
                           "## [0.2.0] - 2026-12-04")
    assert any("versions must descend" in e for e in check_form(swapped, "0.2.0-rc.1"))


# --- history ------------------------------------------------------------------------------


def test_a_user_visible_change_without_a_changelog_line_fails(repo: Path) -> None:
    sha = commit(repo, "change the app", {"kafka_idem/app.py": "x = 2\n"})
    errors = errors_of(repo)
    assert len(errors) == 1
    assert sha[:12] in errors[0] and "kafka_idem/app.py" in errors[0], errors


@pytest.mark.parametrize("path", ["consumers/payments.py", "schemas/a.avsc", "Dockerfile",
                                  "docker-compose.yml", "kafka_idem/store/queries.sql"])
def test_every_user_visible_path_counts(repo: Path, path: str) -> None:
    commit(repo, "change", {path: "changed\n"})
    assert [path in e for e in errors_of(repo)] == [True]


def test_a_change_with_its_changelog_line_passes(repo: Path) -> None:
    commit(repo, "change the app", {"kafka_idem/app.py": "x = 2\n",
                                    "CHANGELOG.md": GOOD.replace("Something new.",
                                                                "Something new. And x.")})
    history = check_history(repo)
    assert (history.errors, history.checked) == ([], 1)


@pytest.mark.parametrize("line", ["Changelog: none", "changelog:none", "  Changelog: None  "])
def test_a_message_saying_changelog_none_passes(repo: Path, line: str) -> None:
    commit(repo, f"refactor the app\n\nNo behaviour change.\n{line}\n",
           {"kafka_idem/app.py": "x = 2\n"})
    history = check_history(repo)
    assert (history.errors, history.opted_out) == ([], 1)


def test_changelog_none_inside_a_sentence_does_not_count(repo: Path) -> None:
    commit(repo, "change the app (no Changelog: none here)", {"kafka_idem/app.py": "x = 2\n"})
    assert len(errors_of(repo)) == 1


def test_other_paths_need_no_changelog_line(repo: Path) -> None:
    commit(repo, "tests and tools", {"tests/test_x.py": "", "tools/t.py": "",
                                     "docs/a.md": "text\n", "kafka_idem_notes.txt": ""})
    history = check_history(repo)
    assert (history.errors, history.checked) == ([], 1)


def test_pyproject_counts_only_for_its_project_table(repo: Path) -> None:
    commit(repo, "ruff setting", {"pyproject.toml": PYPROJECT.replace("100", "110")})
    assert errors_of(repo) == []
    commit(repo, "a new dependency", {"pyproject.toml": PYPROJECT.replace(
        'dynamic = ["version"]', 'dynamic = ["version"]\ndependencies = ["click>=8"]')})
    errors = errors_of(repo)
    assert len(errors) == 1 and "pyproject.toml [project]" in errors[0], errors


def test_a_branch_merged_is_judged_as_a_whole_against_its_first_parent(repo: Path) -> None:
    git(repo, "checkout", "-q", "-b", "feature")
    commit(repo, "feature: code", {"kafka_idem/feature.py": "y = 1\n"})
    git(repo, "checkout", "-q", "main")
    commit(repo, "docs", {"docs/b.md": "b\n"})
    branch_commit_errors = errors_of(repo)  # the feature's commit is not on main yet
    assert branch_commit_errors == []
    git(repo, "merge", "-q", "--no-ff", "-m", "Merge feature", "feature")
    merged = errors_of(repo)  # the feature's own commit and the merge both lack a line
    assert len(merged) == 2 and all("kafka_idem/feature.py" in e for e in merged), merged
    git(repo, "reset", "-q", "--hard", "HEAD~1")
    git(repo, "merge", "-q", "--no-ff", "--no-commit", "feature")
    (repo / "CHANGELOG.md").write_text(GOOD.replace("Something new.", "The feature."))
    git(repo, "add", "CHANGELOG.md")
    git(repo, "commit", "-q", "-m", "Merge feature with its changelog line")
    remaining = errors_of(repo)  # the merge is fine; the feature's commit still is not
    assert len(remaining) == 1 and "feature: code" in remaining[0], remaining


def test_commits_of_a_branch_started_before_the_changelog_are_judged_by_their_merge(
        tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "first", {"kafka_idem/__init__.py": ""})
    git(repo, "checkout", "-q", "-b", "older")
    commit(repo, "older branch: code", {"kafka_idem/old.py": "z = 1\n"})
    git(repo, "checkout", "-q", "main")
    commit(repo, "the changelog", {"CHANGELOG.md": GOOD})
    git(repo, "merge", "-q", "--no-ff", "-m", "Merge older\n\nChangelog: none", "older")
    history = check_history(repo)
    assert (history.errors, history.checked, history.opted_out) == ([], 1, 1)


def test_a_shallow_clone_checks_what_is_there_and_says_so(repo: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          ) -> None:
    commit(repo, "change the app", {"kafka_idem/app.py": "x = 2\n"})
    commit(repo, "a documented change", {"kafka_idem/app.py": "x = 3\n",
                                         "CHANGELOG.md": GOOD + "\n"})
    clone = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "2", f"file://{repo}", str(clone))
    history = check_history(clone)
    # The boundary commit ("change the app") cannot be judged; the one after it is.
    assert (history.errors, history.checked, len(history.unjudged)) == ([], 1, 1)
    assert main(["--root", str(clone)]) == 0
    assert "a shallow clone: 1 boundary commit(s)" in capsys.readouterr().out
    deeper = tmp_path / "deeper"
    git(tmp_path, "clone", "-q", "--depth", "3", f"file://{repo}", str(deeper))
    assert len(check_history(deeper).errors) == 1  # now there, and failed


def test_the_command_exits_1_naming_each_problem(repo: Path) -> None:
    commit(repo, "change the app", {"kafka_idem/app.py": "x = 2\n",
                                    "kafka_idem/_version.py": '__version__ = "0.3.0"\n'})
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "changelog_check.py"),
                           "--root", str(repo)], capture_output=True, text=True, env=ENV,
                          timeout=60)
    assert done.returncode == 1
    problems = done.stderr.splitlines()
    assert len(problems) == 2, problems
    assert "0.3.0" in problems[0] and "kafka_idem/app.py" in problems[1]
    (repo / "CHANGELOG.md").unlink()
    assert main(["--root", str(repo)]) == 1
