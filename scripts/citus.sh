#!/usr/bin/env bash
# Local Citus cluster for the tests of the distributed store: a coordinator and two workers,
# three PostgreSQL data directories on one machine (each started by scripts/postgres.sh with
# Citus's settings), the extension created in the database kafka_idem of every node, the
# workers registered with the coordinator.
#
#   scripts/citus.sh start     install the extension if missing (root), start the three nodes, join them
#   scripts/citus.sh stop      stop the three nodes
#   scripts/citus.sh status    running / not running, node by node
#   scripts/citus.sh restart   stop + start (data is kept)
#   scripts/citus.sh restart-worker N   stop and start worker N (1 or 2): the chaos run's fault
#
# After start this URL (the coordinator's; printed last) works:
#   postgresql://kafka_idem@127.0.0.1:23532/kafka_idem
#
# Environment:
#   KAFKA_IDEM_CITUS_PORT       the coordinator's port (default 23532, below Linux's ephemeral
#                               ports); the workers take the next two
#   KAFKA_IDEM_LOCAL_DIR        where .local lives (default <repo>/.local): the nodes live in
#                               .local/citus/{coordinator,worker1,worker2}
#   KAFKA_IDEM_CITUS_DIR        the nodes' folder instead of .local/citus (a second cluster
#                               beside the first: another folder and another port)
#   KAFKA_IDEM_CITUS_INSTALLER  an install script for the extension (run when `citus` is not
#                               installed). Without it, a `citus/install.sh` in a folder beside the
#                               checkout (or beside its parent) is used: that is where the machines
#                               that run this project's CI keep Citus, which Debian does not package.
#
# Anyone with a cluster of their own points the tests at it instead: KAFKA_IDEM_TEST_CITUS_URL
# (the coordinator's URL, a superuser; the tests create schemas of their own in it).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
LOCAL_DIR="${KAFKA_IDEM_LOCAL_DIR:-$REPO_ROOT/.local}"
CITUS_DIR="${KAFKA_IDEM_CITUS_DIR:-$LOCAL_DIR/citus}"
BASE="${KAFKA_IDEM_CITUS_PORT:-23532}"
HOST=127.0.0.1
NODES=(coordinator worker1 worker2)

log() { echo "citus.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

port_of() { echo $((BASE + $1)); }

# Citus's settings for every node: the library preloaded, two-phase commit possible (a
# transaction across workers), node-to-node connections over loopback without TLS, and
# Citus's statistics on (citus_stat_statements: which statements ran on one shard, with
# which distribution value; citus_stat_counters: single- and multi-shard executions).
EXTRA_CONF="shared_preload_libraries = 'citus,pg_stat_statements'
max_prepared_transactions = 100
citus.node_conninfo = 'sslmode=disable'
citus.stat_statements_track = 'all'
citus.enable_stat_counters = on
max_connections = 300"

installed() {
  local pg_share
  pg_share="$(printf '%s\n' /usr/share/postgresql/*/extension/citus.control | grep -v '\*' | head -n 1 || true)"
  [[ -n "$pg_share" ]]
}

install_extension() {
  installed && return 0
  local installer="${KAFKA_IDEM_CITUS_INSTALLER:-}" candidate
  if [[ -z "$installer" ]]; then
    for candidate in "$REPO_ROOT"/../*/citus/install.sh "$REPO_ROOT"/../../*/citus/install.sh; do
      if [[ -x "$candidate" ]]; then installer="$candidate"; break; fi
    done
  fi
  [[ -n "$installer" ]] || die "the Citus extension is not installed and no installer was found: \
install Citus for PostgreSQL (https://docs.citusdata.com), or set KAFKA_IDEM_CITUS_INSTALLER, \
or point the tests at a cluster of your own with KAFKA_IDEM_TEST_CITUS_URL"
  log "installing the Citus extension with $installer"
  bash "$installer" >&2 || die "the Citus installer failed ($installer)"
  installed || die "the Citus installer ran, but the extension is still missing"
}

node() {
  # node INDEX ACTION: scripts/postgres.sh for one node, its own port and folder
  local i="$1" action="$2"
  KAFKA_IDEM_PG_PORT="$(port_of "$i")" KAFKA_IDEM_LOCAL_DIR="$CITUS_DIR/${NODES[$i]}" \
    KAFKA_IDEM_PG_EXTRA_CONF="$EXTRA_CONF" bash "$SCRIPT_DIR/postgres.sh" "$action"
}

psql_node() {
  # psql_node INDEX SQL: one statement as the kafka_idem role, in the kafka_idem database
  psql -X -q -v ON_ERROR_STOP=1 -tA "postgresql://kafka_idem@$HOST:$(port_of "$1")/kafka_idem" -c "$2"
}

join_cluster() {
  local i port
  for i in 0 1 2; do psql_node "$i" "CREATE EXTENSION IF NOT EXISTS citus" >/dev/null; done
  # workers registered on other ports (KAFKA_IDEM_CITUS_PORT changed since): its metadata
  # names nodes that no longer answer; the cluster holds test data only
  stale="$(psql_node 0 "SELECT string_agg(nodeport::text, ', ') FROM pg_dist_node WHERE
    groupid <> 0 AND nodeport NOT IN ($(port_of 1), $(port_of 2))")"
  [[ -z "$stale" ]] || die "the cluster in $CITUS_DIR has workers registered on ports $stale, \
not $(port_of 1) and $(port_of 2): stop it and delete $CITUS_DIR for a new one (test data only)"
  psql_node 0 "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
  psql_node 0 "SELECT citus_set_coordinator_host('$HOST', $(port_of 0))" >/dev/null
  for i in 1 2; do
    port="$(port_of "$i")"
    if [[ -z "$(psql_node 0 "SELECT 1 FROM pg_dist_node WHERE nodename = '$HOST' AND nodeport = $port")" ]]; then
      log "adding worker ${NODES[$i]} ($HOST:$port)"
      psql_node 0 "SELECT citus_add_node('$HOST', $port)" >/dev/null
    fi
  done
  # a worker restarted by the chaos run is marked active again by the coordinator's own checks;
  # a node left inactive by an earlier crash is activated here
  psql_node 0 "SELECT citus_activate_node(nodename, nodeport) FROM pg_dist_node WHERE NOT isactive" >/dev/null
}

cmd_start() {
  install_extension
  local i
  for i in 0 1 2; do node "$i" start >/dev/null; done
  join_cluster
  log "ready: a coordinator on $(port_of 0), workers on $(port_of 1) and $(port_of 2)"
  echo "postgresql://kafka_idem@$HOST:$(port_of 0)/kafka_idem"
}

cmd_stop() {
  local i rc=0
  for i in 2 1 0; do node "$i" stop || rc=1; done
  return "$rc"
}

cmd_status() {
  local i rc=0 line
  for i in 0 1 2; do
    line="$(node "$i" status)" || rc=3
    echo "citus ${NODES[$i]}: ${line#postgres: }"
  done
  return "$rc"
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  restart) cmd_stop; cmd_start ;;
  restart-worker)
    case "${2:-}" in 1 | 2) ;; *) die "restart-worker takes 1 or 2" ;; esac
    node "$2" restart >/dev/null
    ;;
  *)
    echo "usage: $0 {start|stop|status|restart|restart-worker N}" >&2
    exit 2
    ;;
esac
