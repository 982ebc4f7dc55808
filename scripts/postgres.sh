#!/usr/bin/env bash
# Local PostgreSQL for development and tests: a private cluster (not Debian's
# "main" cluster) on 127.0.0.1, trust auth, durable settings (fsync and
# synchronous_commit on: the exactly-once tests rely on commits surviving).
#
#   scripts/postgres.sh start    install server if missing (root), initdb once, start, create role/db
#   scripts/postgres.sh stop     pg_ctl stop -m fast
#   scripts/postgres.sh status   running / not running
#   scripts/postgres.sh restart  stop + start (data is kept)
#
# After start this URL works:  postgresql://kafka_idem@127.0.0.1:55432/kafka_idem
#
# Environment:
#   KAFKA_IDEM_PG_PORT     port (default 55432)
#   KAFKA_IDEM_LOCAL_DIR   where .local lives (default <repo>/.local)
#   KAFKA_IDEM_PG_EXTRA_CONF  extra postgresql.conf lines for this cluster (scripts/citus.sh
#                          starts its three nodes through this script with Citus's settings)
#
# Files: $KAFKA_IDEM_LOCAL_DIR/postgres/{data,run,log}. Delete data/ for an
# empty cluster. PostgreSQL refuses to run as root, so as root the server runs
# as the `postgres` system user; if that user cannot reach the repo (e.g. a
# clone under a 0700 home) the cluster goes to /var/tmp/kafka_idem-pg-<hash>.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

HOST=127.0.0.1
PORT="${KAFKA_IDEM_PG_PORT:-55432}"
ROLE=kafka_idem
DB=kafka_idem
LOCAL_DIR="${KAFKA_IDEM_LOCAL_DIR:-$REPO_ROOT/.local}"

log() { echo "postgres.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Close every fd above stderr in this (sub)shell, so a daemon we launch holds
# no pipe or lock of whoever called us: a caller reading our output (CI, $(...))
# would otherwise wait for EOF until the daemon exits, and our start lock
# would stay held.
close_inherited_fds() {
  local fd
  for fd in "/proc/$BASHPID/fd"/*; do
    fd="${fd##*/}"
    if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
  done
}

IS_ROOT=0
[[ "$(id -u)" == 0 ]] && IS_ROOT=1

# --- server binaries -----------------------------------------------------------
find_pg_bin() {
  # Debian layout: /usr/lib/postgresql/<major>/bin; take the newest major.
  local newest
  newest="$(printf '%s\n' /usr/lib/postgresql/*/bin/postgres | grep -v '\*' | sort -V | tail -n 1 || true)"
  if [[ -n "$newest" ]]; then
    dirname "$newest"
    return 0
  fi
  # Other layouts: server tools on PATH.
  if command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1; then
    dirname "$(command -v pg_ctl)"
    return 0
  fi
  return 1
}

install_pg() {
  if ((!IS_ROOT)); then
    die "PostgreSQL server not found. Install it (e.g. sudo apt-get install postgresql) and re-run."
  fi
  command -v apt-get >/dev/null 2>&1 || die "PostgreSQL server not found and apt-get is unavailable"
  log "PostgreSQL server not found; installing Debian package postgresql"
  # We run our own cluster: tell postgresql-common not to create and start
  # Debian's default "main" cluster on port 5432 during the install.
  mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/kafka_idem.conf
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
}

if ! PG_BIN="$(find_pg_bin)"; then
  case "${1:-}" in
    start | restart) install_pg ;;
    *) ;;
  esac
  PG_BIN="$(find_pg_bin)" || {
    [[ "${1:-}" == status ]] && { echo "postgres: not running (server not installed)"; exit 3; }
    [[ "${1:-}" == stop ]] && { log "not running (server not installed)"; exit 0; }
    die "PostgreSQL server binaries still not found"
  }
fi

# --- which OS user runs the server -----------------------------------------------
if ((IS_ROOT)); then
  if id -u postgres >/dev/null 2>&1; then
    RUN_USER=postgres
  else
    RUN_USER=kafkaidem
    if ! id -u "$RUN_USER" >/dev/null 2>&1; then
      log "creating system user $RUN_USER to run PostgreSQL (it refuses to run as root)"
      useradd --system --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin "$RUN_USER"
    fi
  fi
else
  RUN_USER="$(id -un)"
fi

# Run a command as RUN_USER, from a directory it can enter (the caller's cwd,
# e.g. /root, may not be, and postgres tools complain about that).
as_pg() {
  if ((IS_ROOT)); then
    (cd / && runuser -u "$RUN_USER" -- "$@")
  else
    "$@"
  fi
}

# --- where the cluster lives -------------------------------------------------------
PG_HOME="$LOCAL_DIR/postgres"
if ((IS_ROOT)); then
  # RUN_USER needs search permission on every ancestor of the data dir; a
  # repo under a 0700 home doesn't give it, so use a per-checkout dir in
  # /var/tmp (hash of the .local path keeps clones apart).
  mkdir -p "$LOCAL_DIR"
  if ! runuser -u "$RUN_USER" -- test -x "$LOCAL_DIR" 2>/dev/null; then
    hash="$(printf '%s' "$LOCAL_DIR" | sha256sum | cut -c1-12)"
    PG_HOME="/var/tmp/kafka_idem-pg-$hash"
    log "user $RUN_USER cannot reach $LOCAL_DIR; using $PG_HOME instead"
  fi
fi
DATA_DIR="$PG_HOME/data"
RUN_DIR="$PG_HOME/run"
# Unix socket paths are limited to ~107 bytes; a deep checkout (CI) would make
# the server fail to start, so put the socket in a short per-checkout dir.
if ((${#RUN_DIR} > 80)); then
  RUN_DIR="/tmp/kafka_idem-pg-run-$(printf '%s' "$PG_HOME" | sha256sum | cut -c1-12)"
fi
LOG_DIR="$PG_HOME/log"
LOG_FILE="$LOG_DIR/postgres.log"
LOCK_FILE="$PG_HOME/.lock"

prepare_dirs() {
  mkdir -p "$PG_HOME" "$RUN_DIR" "$LOG_DIR"
  if ((IS_ROOT)); then
    chown "$RUN_USER:" "$PG_HOME" "$RUN_DIR" "$LOG_DIR"
    [[ -d "$DATA_DIR" ]] && chown -R "$RUN_USER:" "$DATA_DIR"
  fi
  # The socket dir is also the lock-file dir: keep it private to the server user.
  chmod 0755 "$PG_HOME" "$RUN_DIR" "$LOG_DIR"
}

# --- helpers ------------------------------------------------------------------------
is_ready() { "$PG_BIN/pg_isready" -q -h "$HOST" -p "$PORT" -t 2 >/dev/null 2>&1; }

# True if *our* cluster's postmaster is running (pg_ctl checks postmaster.pid).
ours_running() {
  [[ -f "$DATA_DIR/PG_VERSION" ]] || return 1
  as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" status >/dev/null 2>&1
}

# Port our running server was started with (kafka_idem.conf is only rewritten
# on start, so it describes the running server).
running_port() {
  sed -n 's/^port = \([0-9]*\)$/\1/p' "$DATA_DIR/kafka_idem.conf" 2>/dev/null
}

psql_admin() {
  # Over the unix socket as the bootstrap superuser; trust auth.
  "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$RUN_DIR" -p "$PORT" -U postgres -d postgres "$@"
}

init_cluster() {
  [[ -f "$DATA_DIR/PG_VERSION" ]] && return 0
  log "initialising cluster in $DATA_DIR"
  # Trust auth: local dev/test only, and we only listen on 127.0.0.1.
  as_pg "$PG_BIN/initdb" -D "$DATA_DIR" -U postgres -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=trust >"$LOG_DIR/initdb.log" 2>&1 || {
    cat "$LOG_DIR/initdb.log" >&2
    die "initdb failed"
  }
  # Our settings live in their own file, rewritten on each start.
  echo "include_if_exists = 'kafka_idem.conf'" >>"$DATA_DIR/postgresql.conf"
}

write_config() {
  # Rewritten every start so a changed port/run dir takes effect.
  local conf="$DATA_DIR/kafka_idem.conf"
  cat >"$conf" <<EOF
# Generated by scripts/postgres.sh - edits are overwritten on start.
listen_addresses = '$HOST'
port = $PORT
unix_socket_directories = '$RUN_DIR'
# Durability on: exactly-once effects depend on committed rows surviving.
fsync = on
synchronous_commit = on
full_page_writes = on
max_connections = 200
shared_buffers = 128MB
# Readable server log for debugging tests.
log_min_messages = warning
log_line_prefix = '%m [%p] %q%u@%d '
${KAFKA_IDEM_PG_EXTRA_CONF:-}
EOF
  ((IS_ROOT)) && chown "$RUN_USER:" "$conf"
  return 0
}

ensure_role_and_db() {
  if [[ -z "$(psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" ]]; then
    log "creating role $ROLE"
    psql_admin -c "CREATE ROLE $ROLE LOGIN SUPERUSER"
  fi
  if [[ -z "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'")" ]]; then
    log "creating database $DB"
    psql_admin -c "CREATE DATABASE $DB OWNER $ROLE"
  fi
}

url() { echo "postgresql://$ROLE@$HOST:$PORT/$DB"; }

# --- commands -------------------------------------------------------------------------
cmd_start() {
  prepare_dirs
  if ours_running; then
    local i rport
    rport="$(running_port)"
    if [[ "$rport" != "$PORT" ]]; then
      die "our server already runs on port ${rport:-?}, not $PORT; use 'restart' to move it"
    fi
    # Already ours: make sure it's accepting connections, then reuse it.
    for ((i = 0; i < 60; i++)); do is_ready && break; sleep 1; done
    is_ready || die "our server is running but not ready on $HOST:$PORT (see $LOG_FILE)"
    ensure_role_and_db
    log "already running, reusing it"
    url
    return 0
  fi
  if is_ready; then
    die "something else already answers on $HOST:$PORT (set KAFKA_IDEM_PG_PORT?)"
  fi

  init_cluster
  write_config
  log "starting PostgreSQL ($(basename "$(dirname "$PG_BIN")")) on $HOST:$PORT, data $DATA_DIR"
  # pg_ctl -w waits until the server accepts connections (bounded by -t).
  if ! (close_inherited_fds && as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" -l "$LOG_FILE" -w -t 60 start </dev/null >/dev/null); then
    tail -n 40 "$LOG_FILE" >&2 || true
    die "PostgreSQL failed to start"
  fi
  ensure_role_and_db
  log "ready"
  url
}

cmd_stop() {
  if ! ours_running; then
    log "not running"
    return 0
  fi
  # -m fast: roll back open transactions and shut down cleanly (no crash recovery).
  as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" -m fast -w -t 60 stop >/dev/null
  log "stopped"
}

cmd_status() {
  if ours_running; then
    PORT="$(running_port)"
    if is_ready; then
      echo "postgres: running on $HOST:$PORT (data $DATA_DIR)"
    else
      echo "postgres: starting or unhealthy on $HOST:$PORT (data $DATA_DIR)"
    fi
    return 0
  fi
  echo "postgres: not running"
  return 3
}

main() {
  local cmd="${1:-}"
  case "$cmd" in
    start | stop | restart | status) ;;
    *)
      echo "usage: $0 {start|stop|status|restart}" >&2
      exit 2
      ;;
  esac
  if [[ "$cmd" == status ]]; then
    cmd_status
    return
  fi
  mkdir -p "$PG_HOME"
  # Serialise start/stop across parallel callers.
  exec 9>"$LOCK_FILE"
  flock -w 120 9 || die "could not lock $LOCK_FILE"
  case "$cmd" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    restart)
      cmd_stop
      cmd_start
      ;;
  esac
}

main "$@"
