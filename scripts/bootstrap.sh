# shellcheck shell=bash
# Idempotent development environment set-up for kafka_idem.
#
# Usage
#   From another bash script (this is what ./dev does):
#       source scripts/bootstrap.sh || exit 1
#   From an interactive bash session, to get the variables in your shell:
#       source scripts/bootstrap.sh
#   From anything else:
#       eval "$(bash scripts/bootstrap.sh)"     # prints `export ...` lines
#
# What it does (each step is skipped when already done, so it is cheap to run
# before every command):
#   1. creates .venv with `python3 -m venv` if missing;
#   2. runs `pip install -e '.[dev]'` when pyproject.toml differs from the one
#      last installed (its SHA-256, kept in the stamp .venv/.installed; a missing
#      stamp or a changed file, whatever its mtime, means install);
#   3. unless KAFKA_IDEM_BOOTSTRAP_SERVERS is already set, starts the local
#      Kafka (scripts/kafka.sh) and exports
#        KAFKA_IDEM_BOOTSTRAP_SERVERS=127.0.0.1:39092
#   4. unless KAFKA_IDEM_DATABASE_URL is already set, starts the local
#      PostgreSQL (scripts/postgres.sh) and exports
#        KAFKA_IDEM_DATABASE_URL=postgresql://kafka_idem@127.0.0.1:55432/kafka_idem
#   It also exports KAFKA_IDEM_ROOT (the repo root) and KAFKA_IDEM_VENV.
#
# When sourced it never calls `exit` and changes no shell options: on failure
# it prints why and returns non-zero. Progress goes to stderr.
# Ports can be moved with KAFKA_IDEM_KAFKA_PORT / KAFKA_IDEM_PG_PORT, and the
# .local state folder with KAFKA_IDEM_LOCAL_DIR (see the two service scripts).

kafka_idem_bootstrap() {
  local root venv stamp local_dir out wanted
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  venv="$root/.venv"
  stamp="$venv/.installed"
  local_dir="${KAFKA_IDEM_LOCAL_DIR:-$root/.local}"

  mkdir -p "$local_dir" || return 1

  # 1+2: virtualenv and editable install, under a lock so that parallel runs
  # (e.g. two ./dev test at once) don't pip-install over each other.
  (
    flock -w 600 8 || { echo "bootstrap: could not lock $local_dir/bootstrap.lock" >&2; exit 1; }
    if [[ ! -x "$venv/bin/python" ]]; then
      echo "bootstrap: creating virtualenv $venv" >&2
      python3 -m venv "$venv" >&2 || exit 1
      rm -f "$stamp"
    fi
    if [[ ! -f "$root/pyproject.toml" ]]; then
      echo "bootstrap: no pyproject.toml yet, skipping pip install" >&2
    else
      # The stamp holds the installed pyproject.toml's hash: a pull, a checkout or a copy
      # that changes it (new requirements, a new version) reinstalls, whatever the mtimes.
      wanted="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)" || exit 1
      if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
        echo "bootstrap: pip install -e '.[dev]' (pyproject.toml changed or first run)" >&2
        (cd "$root" && "$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[dev]') >&2 || {
          echo "bootstrap: pip install failed" >&2
          exit 1
        }
        echo "$wanted" >"$stamp"
      fi
    fi
  ) 8>"$local_dir/bootstrap.lock" || return 1

  export KAFKA_IDEM_ROOT="$root"
  export KAFKA_IDEM_VENV="$venv"

  # 3+4: services. The scripts print the address on stdout, progress on
  # stderr; a variable that is already set means "use that one, start nothing".
  if [[ -z "${KAFKA_IDEM_BOOTSTRAP_SERVERS:-}" ]]; then
    out="$(bash "$root/scripts/kafka.sh" start)" || {
      echo "bootstrap: Kafka did not start (see above)" >&2
      return 1
    }
    export KAFKA_IDEM_BOOTSTRAP_SERVERS="$out"
  else
    echo "bootstrap: using KAFKA_IDEM_BOOTSTRAP_SERVERS from the environment" >&2
  fi
  if [[ -z "${KAFKA_IDEM_DATABASE_URL:-}" ]]; then
    out="$(bash "$root/scripts/postgres.sh" start)" || {
      echo "bootstrap: PostgreSQL did not start (see above)" >&2
      return 1
    }
    export KAFKA_IDEM_DATABASE_URL="$out"
  else
    echo "bootstrap: using KAFKA_IDEM_DATABASE_URL from the environment" >&2
  fi

  echo "bootstrap: KAFKA_IDEM_BOOTSTRAP_SERVERS=$KAFKA_IDEM_BOOTSTRAP_SERVERS" >&2
  echo "bootstrap: KAFKA_IDEM_DATABASE_URL=$KAFKA_IDEM_DATABASE_URL" >&2
  return 0
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  # Sourced: set up and leave the variables in the caller's shell.
  kafka_idem_bootstrap
else
  # Executed: set up, then print exports for `eval "$(...)"`.
  set -euo pipefail
  kafka_idem_bootstrap
  printf 'export KAFKA_IDEM_BOOTSTRAP_SERVERS=%q\n' "$KAFKA_IDEM_BOOTSTRAP_SERVERS"
  printf 'export KAFKA_IDEM_DATABASE_URL=%q\n' "$KAFKA_IDEM_DATABASE_URL"
fi
