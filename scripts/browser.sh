#!/usr/bin/env bash
# The browser of the web console's end-to-end tests (tests/console): Debian's Chromium
# and its ChromeDriver, driven by selenium. Nothing is downloaded by a test tool (no
# Selenium Manager, no browser bundles): the two binaries come from Debian's packages.
#
#   scripts/browser.sh install   install the packages chromium and chromium-driver if either
#                                binary is missing; print the two paths (chromium, then
#                                chromedriver), one a line, on stdout
#   scripts/browser.sh status    the two paths and versions; exit 3 if one is missing
#
# `install` is cheap when both are there (no apt call at all), so the tests run it first.
# When a binary is missing it runs apt-get as root, `sudo -n apt-get` as another user
# when sudo needs no password, and otherwise fails with a line naming the packages.
# `apt-get update` runs only when the install fails without it (stale package lists).
#
# Environment:
#   KAFKA_IDEM_CHROMIUM       the Chromium binary to use (default: `chromium` on PATH);
#   KAFKA_IDEM_CHROMEDRIVER   the ChromeDriver binary (default: `chromedriver` on PATH);
#                             set both where they live elsewhere; a binary named here is
#                             never installed, only checked
#   KAFKA_IDEM_LOCAL_DIR      where .local lives (default <repo>/.local); the install lock
#                             is $KAFKA_IDEM_LOCAL_DIR/browser/.lock
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

LOCAL_DIR="${KAFKA_IDEM_LOCAL_DIR:-$REPO_ROOT/.local}"
HOME_DIR="$LOCAL_DIR/browser"
LOCK_FILE="$HOME_DIR/.lock"
PACKAGES=(chromium chromium-driver)
HINT="install the Debian packages ${PACKAGES[*]} (sudo apt-get install ${PACKAGES[*]}), or set KAFKA_IDEM_CHROMIUM and KAFKA_IDEM_CHROMEDRIVER"

log() { echo "browser.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# The path of a binary: the override variable's value if set (it must be executable),
# else the command found on PATH. Prints nothing and fails when there is none.
resolve() {
  local override="$1" cmd="$2" found
  if [[ -n "$override" ]]; then
    [[ -f "$override" && -x "$override" ]] || return 1
    echo "$override"
    return 0
  fi
  found="$(command -v "$cmd" 2>/dev/null)" || return 1
  [[ -x "$found" ]] || return 1
  echo "$found"
}

chromium_path() { resolve "${KAFKA_IDEM_CHROMIUM:-}" chromium; }
chromedriver_path() { resolve "${KAFKA_IDEM_CHROMEDRIVER:-}" chromedriver; }

both_present() { chromium_path >/dev/null && chromedriver_path >/dev/null; }

print_paths() {
  chromium_path
  chromedriver_path
}

# A binary the user named that is not there is a mistake to report, not a reason to install
# Debian's packages (they would not put it there).
check_overrides() {
  local var path
  for var in KAFKA_IDEM_CHROMIUM KAFKA_IDEM_CHROMEDRIVER; do
    path="${!var:-}"
    if [[ -n "$path" && ! (-f "$path" && -x "$path") ]]; then
      die "$var=$path is not an executable file"
    fi
  done
  return 0
}

# How to run apt-get here: as root directly, else through sudo if it asks no password.
apt_runner() {
  command -v apt-get >/dev/null 2>&1 || die "chromium or chromedriver not found and apt-get is unavailable; $HINT"
  if [[ "$(id -u)" == 0 ]]; then
    echo ""
  elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    echo "sudo -n"
  else
    die "chromium or chromedriver not found, and installing needs root or a sudo that asks no password; $HINT"
  fi
}

apt_install() {
  local -a runner=()
  local how
  how="$(apt_runner)"
  [[ -n "$how" ]] && read -r -a runner <<<"$how"
  # DPkg::Lock::Timeout: wait for another apt (another checkout's install) instead of
  # failing at once on the dpkg lock.
  local -a install=("${runner[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq
    --no-install-recommends -o DPkg::Lock::Timeout=300 "${PACKAGES[@]}")
  log "installing Debian packages ${PACKAGES[*]}"
  if "${install[@]}" >&2; then
    return 0
  fi
  # Most often the package lists are missing (a fresh image) or stale (a version that
  # is gone from the mirror): refresh them once and retry.
  log "apt-get install failed; running apt-get update and retrying"
  "${runner[@]}" apt-get update -qq >&2 || die "apt-get update failed; $HINT"
  "${install[@]}" >&2 || die "apt-get install ${PACKAGES[*]} failed (see above)"
}

cmd_install() {
  check_overrides
  # Fast path: both there, no lock, no apt.
  if both_present; then
    print_paths
    return 0
  fi
  mkdir -p "$HOME_DIR"
  # Serialise installs: parallel test runs must not start two apt-gets (the second would
  # fail on dpkg's lock). Whoever waited finds the binaries installed.
  exec 9>"$LOCK_FILE"
  flock -w 900 9 || die "could not lock $LOCK_FILE"
  if ! both_present; then
    apt_install
    both_present || die "installed ${PACKAGES[*]}, but chromium or chromedriver is still not found (PATH=$PATH)"
    log "installed: $(chromium_path), $(chromedriver_path)"
  fi
  print_paths
}

version_of() {
  # The Debian chromium launcher is a shell script that may print noise on stderr.
  "$1" --version 2>/dev/null | head -n 1 || true
}

cmd_status() {
  local rc=0 path
  if path="$(chromium_path)"; then
    echo "chromium: $path ($(version_of "$path"))"
  else
    echo "chromium: not found${KAFKA_IDEM_CHROMIUM:+ (KAFKA_IDEM_CHROMIUM=$KAFKA_IDEM_CHROMIUM)}"
    rc=3
  fi
  if path="$(chromedriver_path)"; then
    echo "chromedriver: $path ($(version_of "$path"))"
  else
    echo "chromedriver: not found${KAFKA_IDEM_CHROMEDRIVER:+ (KAFKA_IDEM_CHROMEDRIVER=$KAFKA_IDEM_CHROMEDRIVER)}"
    rc=3
  fi
  return "$rc"
}

main() {
  local cmd="${1:-}"
  case "$cmd" in
    install) cmd_install ;;
    status) cmd_status ;;
    *)
      echo "usage: $0 {install|status}" >&2
      exit 2
      ;;
  esac
}

main "$@"
