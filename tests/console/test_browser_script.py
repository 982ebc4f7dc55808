"""``scripts/browser.sh``: the browser of the console's tests is installed when missing and
left alone when present.

The install path runs against a fake system: a PATH of only the tools the script needs,
with a fake ``apt-get`` (which logs its calls and "installs" two stub binaries), a fake
``id`` (root or not) and a fake ``sudo``; the real Chromium is never touched. The present
path runs for real, with an ``apt-get`` tripwire first on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "browser.sh"
BASH = shutil.which("bash") or "/bin/bash"
# What browser.sh and the fakes below run, linked into the fake PATH.
TOOLS = ("bash", "dirname", "mkdir", "flock", "head", "env", "cat", "chmod", "sleep", "touch",
         "true")

FAKE_APT = r"""#!/bin/bash
echo "apt-get $* uid=$(id -u) frontend=${DEBIAN_FRONTEND:-}" >>"$FAKE_LOG"
echo "apt-get chatter on stdout"
case "$1" in
  update) touch "$FAKE_STATE/updated"; exit 0 ;;
  install)
    if [[ "$FAKE_APT" == needs-update && ! -f "$FAKE_STATE/updated" ]]; then
      echo "E: Unable to locate package chromium" >&2; exit 100
    fi
    [[ "$FAKE_APT" == fails ]] && { echo "E: broken" >&2; exit 100; }
    sleep "${FAKE_APT_SLEEP:-0}"
    for b in chromium chromedriver; do
      printf '#!/bin/bash\necho "fake %s 1.0"\n' "$b" >"$FAKE_BIN/$b"
      chmod +x "$FAKE_BIN/$b"
    done
    exit 0 ;;
esac
exit 1
"""

FAKE_ID = r"""#!/bin/bash
[[ "$1" == -u ]] && { echo "$FAKE_UID"; exit 0; }
exit 1
"""

FAKE_SUDO = r"""#!/bin/bash
echo "sudo $*" >>"$FAKE_LOG"
[[ "$FAKE_SUDO" == ok ]] || { echo "sudo: a password is required" >&2; exit 1; }
[[ "$1" == -n ]] && shift
FAKE_UID=0 exec "$@"
"""


@dataclass
class Fake:
    bin: Path
    log: Path
    env: dict[str, str]

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([BASH, str(SCRIPT), *args], env={**self.env, **env},
                              capture_output=True, text=True, timeout=60, check=False)

    def start(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([BASH, str(SCRIPT), *args], env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def installs(self) -> list[str]:
        return [c for c in self.calls() if c.startswith("apt-get install")]

    def paths(self) -> list[str]:
        return [str(self.bin / "chromium"), str(self.bin / "chromedriver")]


def make_fake(tmp_path: Path, *, uid: int = 0, apt: str | None = "ok",
              sudo: str | None = None, **extra: str) -> Fake:
    """A fake system in ``tmp_path``: ``apt`` is ok, needs-update, fails or None (no
    apt-get); ``sudo`` is ok, refuses or None (no sudo)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for tool in TOOLS:
        real = shutil.which(tool)
        assert real, f"{tool} not found on this machine"
        (fake_bin / tool).symlink_to(real)
    scripts = {"id": FAKE_ID}
    if apt is not None:
        scripts["apt-get"] = FAKE_APT
    if sudo is not None:
        scripts["sudo"] = FAKE_SUDO
    for name, text in scripts.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    env = {"PATH": str(fake_bin), "FAKE_BIN": str(fake_bin), "FAKE_LOG": str(tmp_path / "log"),
           "FAKE_STATE": str(state), "FAKE_UID": str(uid), "FAKE_APT": apt or "",
           "FAKE_SUDO": sudo or "", "KAFKA_IDEM_LOCAL_DIR": str(tmp_path / "local"), **extra}
    return Fake(fake_bin, tmp_path / "log", env)


def test_as_root_a_missing_browser_is_installed_once_without_an_update(tmp_path: Path) -> None:
    fake = make_fake(tmp_path)
    done = fake.run("install")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == fake.paths()  # apt's chatter went to stderr
    assert "apt-get chatter" in done.stderr
    [install] = fake.calls()
    assert install.startswith("apt-get install -y")
    assert "chromium chromium-driver" in install and "uid=0" in install
    assert "frontend=noninteractive" in install

    again = fake.run("install")  # now present: no apt at all
    assert again.returncode == 0 and again.stdout.splitlines() == fake.paths()
    assert len(fake.calls()) == 1


def test_apt_get_update_runs_only_when_the_install_fails_without_it(tmp_path: Path) -> None:
    fake = make_fake(tmp_path, apt="needs-update")
    done = fake.run("install")
    assert done.returncode == 0, done.stderr
    assert [c.split()[1] for c in fake.calls()] == ["install", "update", "install"]
    assert done.stdout.splitlines() == fake.paths()


def test_an_install_that_fails_after_the_update_fails_the_script(tmp_path: Path) -> None:
    fake = make_fake(tmp_path, apt="fails")
    done = fake.run("install")
    assert done.returncode == 1 and done.stdout == ""
    assert "chromium chromium-driver failed" in done.stderr


def test_a_missing_driver_alone_is_installed(tmp_path: Path) -> None:
    fake = make_fake(tmp_path)
    (fake.bin / "chromium").write_text("#!/bin/bash\n")
    (fake.bin / "chromium").chmod(0o755)
    done = fake.run("install")
    assert done.returncode == 0, done.stderr
    assert len(fake.installs()) == 1


def test_not_root_installs_through_sudo_when_it_asks_no_password(tmp_path: Path) -> None:
    fake = make_fake(tmp_path, uid=1000, sudo="ok")
    done = fake.run("install")
    assert done.returncode == 0, done.stderr
    assert fake.calls()[0] == "sudo -n true"
    assert fake.calls()[1].startswith("sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install")
    assert "uid=0" in fake.installs()[0]


@pytest.mark.parametrize("sudo", ["refuses", None])
def test_not_root_without_sudo_fails_in_one_line_naming_the_packages(
        tmp_path: Path, sudo: str | None) -> None:
    fake = make_fake(tmp_path, uid=1000, sudo=sudo)
    done = fake.run("install")
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert "chromium chromium-driver" in line and "root" in line, line
    assert fake.installs() == []


def test_without_apt_get_the_script_says_what_to_install(tmp_path: Path) -> None:
    fake = make_fake(tmp_path, apt=None)
    done = fake.run("install")
    assert done.returncode == 1
    assert "apt-get is unavailable" in done.stderr and "chromium-driver" in done.stderr


def test_overrides_name_the_binaries_and_nothing_is_installed(tmp_path: Path) -> None:
    fake = make_fake(tmp_path)
    elsewhere = tmp_path / "opt"
    elsewhere.mkdir()
    for name in ("chrome", "driver"):
        (elsewhere / name).write_text("#!/bin/bash\necho v1\n")
        (elsewhere / name).chmod(0o755)
    env = {"KAFKA_IDEM_CHROMIUM": str(elsewhere / "chrome"),
           "KAFKA_IDEM_CHROMEDRIVER": str(elsewhere / "driver")}
    done = fake.run("install", **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [env["KAFKA_IDEM_CHROMIUM"], env["KAFKA_IDEM_CHROMEDRIVER"]]
    assert fake.calls() == []
    status = fake.run("status", **env)
    assert status.returncode == 0
    assert status.stdout.splitlines() == [f"chromium: {elsewhere / 'chrome'} (v1)",
                                          f"chromedriver: {elsewhere / 'driver'} (v1)"]


def test_an_override_that_is_not_there_fails_and_installs_nothing(tmp_path: Path) -> None:
    fake = make_fake(tmp_path)
    done = fake.run("install", KAFKA_IDEM_CHROMEDRIVER=str(tmp_path / "nope"))
    assert done.returncode == 1
    assert f"KAFKA_IDEM_CHROMEDRIVER={tmp_path / 'nope'} is not an executable file" in done.stderr
    assert fake.calls() == []


def test_parallel_installs_run_apt_once(tmp_path: Path) -> None:
    fake = make_fake(tmp_path, FAKE_APT_SLEEP="1")
    procs = [fake.start("install") for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all(out.splitlines() == fake.paths() for out, _ in outs)
    assert len(fake.installs()) == 1, fake.calls()


def test_status_says_what_is_missing(tmp_path: Path) -> None:
    fake = make_fake(tmp_path)
    done = fake.run("status")
    assert done.returncode == 3
    assert done.stdout.splitlines() == ["chromium: not found", "chromedriver: not found"]
    assert fake.calls() == []


def test_usage(tmp_path: Path) -> None:
    done = make_fake(tmp_path).run("start")
    assert done.returncode == 2 and "usage" in done.stderr


def test_on_this_machine_an_installed_browser_is_found_without_apt(
        tmp_path: Path, browser_install: tuple[str, str]) -> None:
    """For real: ``install`` (the fixture's, before the tests) leaves a browser; another
    ``install`` finds it without calling apt-get (a tripwire first on PATH) or locking."""
    chromium, driver = browser_install
    tripwire = tmp_path / "tripwire"
    tripwire.mkdir()
    for name in ("apt-get", "sudo"):
        (tripwire / name).write_text(f"#!/bin/sh\necho {name} >>{tmp_path / 'called'}\nexit 1\n")
        (tripwire / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tripwire}{os.pathsep}{os.environ['PATH']}",
           "KAFKA_IDEM_LOCAL_DIR": str(tmp_path / "local")}
    again = subprocess.run([BASH, str(SCRIPT), "install"], env=env, capture_output=True,
                           text=True, timeout=60, check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [chromium, driver]
    assert not (tmp_path / "called").exists()
    assert not (tmp_path / "local").exists()  # the fast path takes no lock
    status = subprocess.run([BASH, str(SCRIPT), "status"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stdout
    assert "chromium: " + chromium + " (Chromium " in status.stdout
    assert "chromedriver: " + driver + " (ChromeDriver " in status.stdout
