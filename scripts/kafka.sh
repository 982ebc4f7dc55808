#!/usr/bin/env bash
# Local single-node Kafka (KRaft, combined broker+controller) for development
# and tests. No Docker, no tarball: the broker jars come from Maven Central via
# scripts/kafka/pom.xml and run straight off the classpath.
#
#   scripts/kafka.sh start     fetch jars if needed, format once, start, wait until ready
#   scripts/kafka.sh stop      TERM the broker we started (KILL after 30 s)
#   scripts/kafka.sh status    running / not running
#   scripts/kafka.sh restart   stop + start (data is kept)
#
# Environment:
#   KAFKA_IDEM_KAFKA_PORT   client port (default 39092); controller uses port+1
#   KAFKA_IDEM_LOCAL_DIR    where .local lives (default <repo>/.local)
#   KAFKA_IDEM_KAFKA_START_TIMEOUT  seconds to wait for readiness (default 90)
#   KAFKA_IDEM_KAFKA_EXTRA_CONFIG   a file of broker properties appended to the generated
#                           ones (a later line wins), e.g. a SASL listener and an
#                           authorizer for the ACL test (tests/acceptance/test_acl_prefix.py)
#
# Everything lives in $KAFKA_IDEM_LOCAL_DIR/kafka/{libs,config,data,logs}; delete
# data/ to get an empty cluster, libs/ to refetch the jars.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"

HOST=127.0.0.1
PORT="${KAFKA_IDEM_KAFKA_PORT:-39092}"
CONTROLLER_PORT=$((PORT + 1))
START_TIMEOUT="${KAFKA_IDEM_KAFKA_START_TIMEOUT:-90}"

LOCAL_DIR="${KAFKA_IDEM_LOCAL_DIR:-$REPO_ROOT/.local}"
KAFKA_HOME="$LOCAL_DIR/kafka"
LIBS_DIR="$KAFKA_HOME/libs"
CONF_DIR="$KAFKA_HOME/config"
DATA_DIR="$KAFKA_HOME/data"
LOG_DIR="$KAFKA_HOME/logs"
PID_FILE="$KAFKA_HOME/kafka.pid"
LOCK_FILE="$KAFKA_HOME/.lock"
POM="$SCRIPT_DIR/kafka/pom.xml"
SERVER_PROPS="$CONF_DIR/server.properties"
LOG4J_PROPS="$CONF_DIR/log4j2.properties"

log() { echo "kafka.sh: $*" >&2; }
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

# --- readiness probe ---------------------------------------------------------
# Speaks the Kafka wire protocol with plain python3 (no client library needed):
# ApiVersions, then a Metadata request that must list at least one broker. A
# bare TCP connect is not enough: the socket accepts before the broker has
# registered with the controller, and clients then fail with "no brokers".
probe() {
  python3 - "$HOST" "$PORT" <<'PY'
import socket, struct, sys

host, port = sys.argv[1], int(sys.argv[2])

def call(sock, api_key, version, corr, body=b""):
    client_id = b"kafka.sh-probe"
    # Request header v1: api_key, api_version, correlation_id, client_id.
    hdr = struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id
    msg = hdr + body
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    def read(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf
    (size,) = struct.unpack(">i", read(4))
    resp = read(size)
    (rcorr,) = struct.unpack(">i", resp[:4])
    if rcorr != corr:
        raise ValueError("correlation mismatch")
    return resp[4:]

try:
    with socket.create_connection((host, port), timeout=3) as s:
        s.settimeout(5)
        # ApiVersions v0: every broker version answers it.
        r = call(s, 18, 0, 1)
        (err, n) = struct.unpack(">hi", r[:6])
        if err != 0:
            sys.exit(1)
        ranges = {}
        for i in range(n):
            k, lo, hi = struct.unpack(">hhh", r[6 + 6 * i: 12 + 6 * i])
            ranges[k] = (lo, hi)
        lo, hi = ranges.get(3, (0, -1))
        # Metadata v4..v8 share one non-flexible layout that we can parse.
        v = max(lo, 4)
        if v > min(hi, 8):
            sys.exit(0)  # can't parse this broker's Metadata; ApiVersions will do
        body = struct.pack(">i", -1) + b"\x00"  # all topics, no auto-create
        r = call(s, 3, v, 2, body)
        (_throttle, nbrokers) = struct.unpack(">ii", r[:8])
        sys.exit(0 if nbrokers > 0 else 1)
except Exception:
    sys.exit(1)
PY
}

# --- pid helpers -------------------------------------------------------------
# Only trust the pid file if that pid is still *our* broker (pids get reused).
our_pid() {
  [[ -f "$PID_FILE" ]] || return 1
  local pid
  pid="$(cat "$PID_FILE" 2>/dev/null || true)"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r "/proc/$pid/cmdline" ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "kafka.Kafka $SERVER_PROPS" || return 1
  echo "$pid"
}

# Port of the broker we last started from this folder (server.properties is
# only rewritten on start, so it describes the running broker).
running_port() {
  sed -n 's/^advertised.listeners=PLAINTEXT:\/\/.*:\([0-9]*\)$/\1/p' "$SERVER_PROPS" 2>/dev/null
}

port_in_use() {
  python3 - "$HOST" "$1" <<'PY'
import socket, sys
s = socket.socket()
s.settimeout(1)
sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)
PY
}

# --- jars ----------------------------------------------------------------------
# The stamp holds the pom's checksum: editing the pom (e.g. a version bump)
# triggers a refetch, an unchanged pom never touches the network.
fetch_libs() {
  local want have=""
  want="$(sha256sum "$POM" | cut -d' ' -f1)"
  [[ -f "$LIBS_DIR/.stamp" ]] && have="$(cat "$LIBS_DIR/.stamp")"
  [[ "$want" == "$have" ]] && return 0

  ensure_tool mvn maven
  log "fetching Kafka jars with Maven into $LIBS_DIR (first time only, ~10-60 s)"
  # Fetch into a temp dir and move into place, so an interrupted fetch never
  # looks like a complete one.
  local tmp="$KAFKA_HOME/libs.tmp.$$"
  rm -rf "$tmp"
  # (sed strips the stray colour codes Debian's Maven 3.8 prints even with -q -B;
  # pipefail keeps Maven's exit status.)
  if ! mvn -q -B -f "$POM" dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$tmp" 2>&1 |
      sed 's/\x1b\[[0-9;]*m//g' >&2; then
    rm -rf "$tmp"
    die "Maven could not fetch the Kafka jars (see output above)"
  fi
  echo "$want" >"$tmp/.stamp"
  rm -rf "$LIBS_DIR"
  mv "$tmp" "$LIBS_DIR"
}

# Install a missing tool from Debian's packages when we can (root), else explain.
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

# --- config ------------------------------------------------------------------
write_config() {
  mkdir -p "$CONF_DIR" "$DATA_DIR" "$LOG_DIR"
  # Rewritten on every start so port overrides and edits here take effect.
  cat >"$SERVER_PROPS" <<EOF
# Generated by scripts/kafka.sh - edits are overwritten on start.
process.roles=broker,controller
node.id=1
# Static quorum of one: simplest KRaft setup, formatted without --standalone.
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT

log.dirs=$DATA_DIR

# Single node: every internal topic must accept replication factor 1, or
# consumer groups / transactions never become available.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
min.insync.replicas=1
default.replication.factor=1
# Fewer internal partitions than the default 50: much faster first use of
# groups and transactions on a fresh cluster.
offsets.topic.num.partitions=8
transaction.state.log.num.partitions=8

# Tests want fast rebalances and explicit topic creation.
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
num.partitions=1

# Small footprint for a 2-core dev box.
num.network.threads=2
num.io.threads=4
log.cleaner.dedupe.buffer.size=16777216
log.segment.bytes=16777216
offsets.topic.segment.bytes=16777216
transaction.state.log.segment.bytes=16777216
log.retention.hours=24
EOF
  if [[ -n "${KAFKA_IDEM_KAFKA_EXTRA_CONFIG:-}" ]]; then
    cat "$KAFKA_IDEM_KAFKA_EXTRA_CONFIG" >>"$SERVER_PROPS"
  fi

  # log4j2 config: broker log to a rolling file, noisy request loggers quiet.
  cat >"$LOG4J_PROPS" <<EOF
status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = $LOG_DIR/server.log
appender.file.filePattern = $LOG_DIR/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
EOF
}

java_cp() { echo "$LIBS_DIR/*"; }

format_once() {
  # meta.properties marks a formatted log dir; formatting again would fail.
  [[ -f "$DATA_DIR/meta.properties" ]] && return 0
  local cluster_id
  cluster_id="$(java -cp "$(java_cp)" -Dlog4j2.configurationFile="$LOG4J_PROPS" \
    kafka.tools.StorageTool random-uuid)"
  log "formatting $DATA_DIR (cluster id $cluster_id)"
  java -cp "$(java_cp)" -Dlog4j2.configurationFile="$LOG4J_PROPS" \
    kafka.tools.StorageTool format -t "$cluster_id" -c "$SERVER_PROPS" >&2
}

wait_ready() {
  local pid="$1" deadline=$((SECONDS + START_TIMEOUT))
  while ((SECONDS < deadline)); do
    if probe; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "broker process $pid exited during start-up"
      return 1
    fi
    sleep 1
  done
  log "broker did not become ready within ${START_TIMEOUT}s"
  return 1
}

show_log_tail() {
  for f in "$LOG_DIR/kafka.out" "$LOG_DIR/server.log"; do
    [[ -f "$f" ]] || continue
    echo "----- last lines of $f -----" >&2
    tail -n 40 "$f" >&2
  done
}

# --- commands ------------------------------------------------------------------
cmd_start() {
  local pid
  if pid="$(our_pid)"; then
    local rport
    rport="$(running_port)"
    if [[ "$rport" != "$PORT" ]]; then
      die "our broker (pid $pid) already runs on port ${rport:-?}, not $PORT; use 'restart' to move it"
    fi
    # Already ours (maybe still starting from a concurrent call): wait for it.
    if wait_ready "$pid"; then
      log "already running (pid $pid), reusing it"
      echo "$HOST:$PORT"
      return 0
    fi
    show_log_tail
    die "broker pid $pid is running but not answering on $HOST:$PORT"
  fi
  rm -f "$PID_FILE"

  if port_in_use "$PORT" || port_in_use "$CONTROLLER_PORT"; then
    die "port $PORT or $CONTROLLER_PORT on $HOST is taken by a process we did not start (set KAFKA_IDEM_KAFKA_PORT?)"
  fi

  ensure_tool java openjdk-17-jre-headless
  fetch_libs
  write_config
  format_once

  local attempt
  for attempt in 1 2 3 4 5; do
    log "starting broker on $HOST:$PORT (logs in $LOG_DIR)"
    launch
    pid="$(cat "$PID_FILE")"
    if wait_ready "$pid"; then
      log "ready (pid $pid, ${SECONDS}s)"
      echo "$HOST:$PORT"
      return 0
    fi
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PID_FILE"
    # The port is in the kernel's ephemeral range: a client reconnecting to it while
    # the broker was down can connect to itself (TCP simultaneous open) and hold it for
    # a moment. The broker then cannot bind; once that client gives up, it can.
    if ((attempt < 5)) && tail -n 200 "$LOG_DIR/server.log" 2>/dev/null \
        | grep -q "failed to bind to $HOST:$PORT: Address already in use"; then
      log "port $PORT held for a moment (a client connected to itself?); trying again"
      sleep 2
      continue
    fi
    break
  done
  show_log_tail
  die "Kafka failed to start"
}

launch() {
  # setsid+nohup: the broker outlives this shell and its terminal; stdin from
  # /dev/null and output to a file, other inherited fds closed.
  (
    close_inherited_fds
    exec setsid nohup java -Xms256m -Xmx768m \
      -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExplicitGCInvokesConcurrent \
      -Djava.awt.headless=true \
      -Dlog4j2.configurationFile="$LOG4J_PROPS" \
      -Dkafka.logs.dir="$LOG_DIR" \
      -cp "$(java_cp)" kafka.Kafka "$SERVER_PROPS" \
      </dev/null >>"$LOG_DIR/kafka.out" 2>&1
  ) &
  echo "$!" >"$PID_FILE"
}

cmd_stop() {
  local pid
  if ! pid="$(our_pid)"; then
    rm -f "$PID_FILE"
    log "not running"
    return 0
  fi
  log "stopping broker pid $pid"
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
    PORT="$(running_port)"
    if probe; then
      echo "kafka: running (pid $pid) on $HOST:$PORT"
    else
      echo "kafka: starting or unhealthy (pid $pid) on $HOST:$PORT"
    fi
    return 0
  fi
  echo "kafka: not running"
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
  mkdir -p "$KAFKA_HOME"
  if [[ "$cmd" == status ]]; then
    cmd_status
    return
  fi
  # Serialise start/stop so parallel callers (e.g. several test runs) don't
  # launch two brokers on the same data dir.
  exec 9>"$LOCK_FILE"
  flock -w 300 9 || die "could not lock $LOCK_FILE"
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
