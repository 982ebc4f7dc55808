#!/usr/bin/env bash
# Local Confluent-compatible Schema Registry for the tests: Apicurio Registry 2.4.2.Final
# (Confluent's REST API under /apis/ccompat/v7; Avro, JSON Schema, Protobuf), in-memory
# storage, built once from Maven Central jars as a Quarkus application
# (scripts/registry/pom.xml says what had to be replaced). No Docker.
#
#   scripts/registry.sh start     build if needed (first time: a few minutes), start, wait until ready
#   scripts/registry.sh stop      TERM the registry we started (KILL after 30 s)
#   scripts/registry.sh status    running / not running
#   scripts/registry.sh restart   stop + start (the registry is empty again)
#   scripts/registry.sh url       the URL a client uses (printed by start too)
#
# Environment:
#   KAFKA_IDEM_REGISTRY_PORT   HTTP port (default 18081, below Linux's ephemeral range)
#   KAFKA_IDEM_LOCAL_DIR       where .local lives (default <repo>/.local)
#   KAFKA_IDEM_REGISTRY_START_TIMEOUT  seconds to wait for readiness (default 180)
#
# Everything lives in $KAFKA_IDEM_LOCAL_DIR/registry/{build,app,logs}; delete app/ to
# rebuild. Storage is in memory: every start is an empty registry.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

HOST=127.0.0.1
PORT="${KAFKA_IDEM_REGISTRY_PORT:-18081}"
START_TIMEOUT="${KAFKA_IDEM_REGISTRY_START_TIMEOUT:-180}"
API=/apis/ccompat/v7

LOCAL_DIR="${KAFKA_IDEM_LOCAL_DIR:-$REPO_ROOT/.local}"
HOME_DIR="$LOCAL_DIR/registry"
BUILD_DIR="$HOME_DIR/build"
APP_DIR="$HOME_DIR/app"
LOG_DIR="$HOME_DIR/logs"
PID_FILE="$HOME_DIR/registry.pid"
PORT_FILE="$HOME_DIR/registry.port"
LOCK_FILE="$HOME_DIR/.lock"
SOURCES="$SCRIPT_DIR/registry"
RUNNER=kafka-idem-test-registry-1-runner.jar

log() { echo "registry.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# As in kafka.sh: a daemon we launch must hold no pipe or lock of our caller.
close_inherited_fds() {
  local fd
  for fd in "/proc/$BASHPID/fd"/*; do
    fd="${fd##*/}"
    if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
  done
}

url() { echo "http://$HOST:$1$API"; }

# Ready = the Confluent API answers a listing of subjects (the HTTP port alone opens
# before the storage is initialised).
probe() {
  python3 - "$(url "$1")/subjects" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

port_in_use() {
  python3 - "$HOST" "$1" <<'PY'
import socket, sys
s = socket.socket()
s.settimeout(1)
sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
PY
}

our_pid() {
  [[ -f "$PID_FILE" ]] || return 1
  local pid
  pid="$(cat "$PID_FILE" 2>/dev/null || true)"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r "/proc/$pid/cmdline" ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "-jar $APP_DIR/$RUNNER" || return 1
  echo "$pid"
}

ensure_tool() {
  local cmd="$1" pkg="$2"
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "$cmd not found; installing Debian package $pkg"
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >&2
  else
    die "$cmd not found; install $pkg (e.g. sudo apt-get install $pkg)"
  fi
}

# --- build -------------------------------------------------------------------------
# The stamp is the checksum of scripts/registry/: an edit rebuilds, nothing else does.
sources_sum() {
  (cd "$SOURCES" && find . -type f | LC_ALL=C sort | xargs sha256sum) | sha256sum | cut -d' ' -f1
}

build() {
  local want have=""
  want="$(sources_sum)"
  [[ -f "$APP_DIR/.stamp" ]] && have="$(cat "$APP_DIR/.stamp")"
  [[ "$want" == "$have" && -f "$APP_DIR/$RUNNER" ]] && return 0

  ensure_tool mvn maven
  log "building the registry with Maven into $APP_DIR (first time only: a few minutes)"
  rm -rf "$BUILD_DIR"
  mkdir -p "$BUILD_DIR"
  cp -r "$SOURCES/." "$BUILD_DIR/"
  # Apicurio's POMs name extra repositories (Confluent's, jitpack, JBoss) for artifacts
  # the registry does not need at run time; point them at nothing, so every lookup goes
  # to Maven Central (or the user's mirror) and a miss fails at once, not after timeouts.
  cat >"$BUILD_DIR/settings.xml" <<'EOF'
<settings>
  <mirrors>
    <mirror><id>kafka-idem-no-extra-repos</id><mirrorOf>*,!central</mirrorOf>
      <url>file:///nonexistent/kafka-idem-no-extra-repos</url></mirror>
  </mirrors>
</settings>
EOF
  # The Quarkus build must index the registry's jar: its beans are not in our sources.
  if ! (cd "$BUILD_DIR" && mvn -q -B -gs settings.xml -DskipTests \
      -Dquarkus.index-dependency.registry.group-id=io.apicurio \
      -Dquarkus.index-dependency.registry.artifact-id=apicurio-registry-app \
      package 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | { grep -v -E '^(SLF4J|WARNING: )' || true; } >&2); then
    die "Maven could not build the registry (see output above)"
  fi
  [[ -f "$BUILD_DIR/target/$RUNNER" ]] || die "the build made no $RUNNER"
  local tmp="$HOME_DIR/app.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  mv "$BUILD_DIR/target/$RUNNER" "$BUILD_DIR/target/lib" "$tmp/"
  echo "$want" >"$tmp/.stamp"
  rm -rf "$APP_DIR" "$BUILD_DIR"
  mv "$tmp" "$APP_DIR"
}

wait_ready() {
  local pid="$1" deadline=$((SECONDS + START_TIMEOUT))
  while ((SECONDS < deadline)); do
    if probe "$PORT"; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "registry process $pid exited during start-up"
      return 1
    fi
    sleep 1
  done
  log "registry did not become ready within ${START_TIMEOUT}s"
  return 1
}

show_log_tail() {
  [[ -f "$LOG_DIR/registry.out" ]] || return 0
  echo "----- last lines of $LOG_DIR/registry.out -----" >&2
  tail -n 40 "$LOG_DIR/registry.out" >&2
}

# --- commands ----------------------------------------------------------------------
cmd_start() {
  local pid
  if pid="$(our_pid)"; then
    local rport
    rport="$(cat "$PORT_FILE" 2>/dev/null || true)"
    [[ "$rport" == "$PORT" ]] ||
      die "our registry (pid $pid) already runs on port ${rport:-?}, not $PORT; use 'restart'"
    if wait_ready "$pid"; then
      log "already running (pid $pid), reusing it"
      url "$PORT"
      return 0
    fi
    show_log_tail
    die "registry pid $pid is running but not answering on $HOST:$PORT"
  fi
  rm -f "$PID_FILE"
  if port_in_use "$PORT"; then
    # Another checkout's registry (its own .local) may hold the port: tests use subjects
    # of their own, so one registry serves them all.
    if probe "$PORT"; then
      log "a registry we did not start answers on $HOST:$PORT; using it"
      url "$PORT"
      return 0
    fi
    die "port $PORT on $HOST is taken by a process we did not start (set KAFKA_IDEM_REGISTRY_PORT?)"
  fi

  ensure_tool java openjdk-17-jre-headless
  build
  mkdir -p "$LOG_DIR"
  log "starting the registry on $HOST:$PORT (logs in $LOG_DIR)"
  (
    close_inherited_fds
    cd "$HOME_DIR"
    HTTP_PORT="$PORT" exec setsid nohup java -Xms64m -Xmx384m -XX:+UseSerialGC \
      -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
      -Dquarkus.http.host="$HOST" -Dquarkus.http.port="$PORT" \
      -Dquarkus.log.level=WARN -Dquarkus.log.category.\"io.apicurio\".level=WARN \
      -jar "$APP_DIR/$RUNNER" </dev/null >>"$LOG_DIR/registry.out" 2>&1
  ) &
  pid=$!
  echo "$pid" >"$PID_FILE"
  echo "$PORT" >"$PORT_FILE"
  if ! wait_ready "$pid"; then
    show_log_tail
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PID_FILE"
    die "the registry failed to start"
  fi
  log "ready (pid $pid, ${SECONDS}s)"
  url "$PORT"
}

cmd_stop() {
  local pid
  if ! pid="$(our_pid)"; then
    rm -f "$PID_FILE"
    log "not running"
    return 0
  fi
  log "stopping registry pid $pid"
  kill -TERM "$pid" 2>/dev/null || true
  local i
  for ((i = 0; i < 30; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "still alive after 30 s, sending KILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 1
  fi
  rm -f "$PID_FILE"
  log "stopped"
}

cmd_status() {
  local pid
  if pid="$(our_pid)"; then
    PORT="$(cat "$PORT_FILE" 2>/dev/null || echo "$PORT")"
    if probe "$PORT"; then
      echo "registry: running (pid $pid) at $(url "$PORT")"
    else
      echo "registry: starting or unhealthy (pid $pid) on $HOST:$PORT"
    fi
    return 0
  fi
  echo "registry: not running"
  return 3
}

main() {
  local cmd="${1:-}"
  case "$cmd" in
    start | stop | restart | status | url) ;;
    *)
      echo "usage: $0 {start|stop|status|restart|url}" >&2
      exit 2
      ;;
  esac
  mkdir -p "$HOME_DIR"
  case "$cmd" in
    status) cmd_status; return ;;
    url) url "$PORT"; return ;;
  esac
  # Serialise start/stop: parallel test runs must not build or launch twice.
  exec 9>"$LOCK_FILE"
  flock -w 900 9 || die "could not lock $LOCK_FILE"
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
