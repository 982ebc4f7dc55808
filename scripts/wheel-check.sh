#!/usr/bin/env bash
# The built wheel, installed alone: a new virtualenv (no system site packages) with only
# the wheel and its dependencies from the package index, then, with that venv's
# `kafka-idem` and outside the repository (nothing of the checkout importable):
#   * `kafka-idem --version` prints the version kafka_idem/_version.py says;
#   * `kafka-idem migrate` creates the whole store in a NEW database on the local
#     PostgreSQL (a unique name, dropped at the end), and a second run is a no-op;
#   * without the console extra, `kafka-idem console` says to install it (exit 2); with
#     it (`pip install 'WHEEL[console]'`), the console of a small app serves its pages,
#     templates and static files from the installed package (needs the local Kafka:
#     KAFKA_IDEM_BOOTSTRAP_SERVERS).
#
# Usage: scripts/wheel-check.sh dist/kafka_idem-X.Y.Z-py3-none-any.whl
# KAFKA_IDEM_DATABASE_URL names the server (and a database the new one is created from),
# as scripts/bootstrap.sh exports it. Run by .ci/run after `python -m build`.
# On success the last line is `wheel-check: ok ...`; any failure exits non-zero.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheel="${1:?usage: scripts/wheel-check.sh WHEEL}"
wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
[[ -f "$wheel" && "$wheel" == *.whl ]] || { echo "wheel-check: no wheel at $wheel" >&2; exit 1; }
: "${KAFKA_IDEM_DATABASE_URL:?wheel-check: set KAFKA_IDEM_DATABASE_URL (source scripts/bootstrap.sh)}"

expected="$(python3 -c 'import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
print(next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
           and any(getattr(t, "id", None) == "__version__" for t in n.targets)))' \
  "$root/kafka_idem/_version.py")"
last_migration="$(basename "$(ls "$root"/kafka_idem/admin/migrations/[0-9]*.sql | sort | tail -n 1)" .sql)"

work="$(mktemp -d)"
venv="$work/venv"
dbname="kafka_idem_wheel_$(date +%s)_$$_${RANDOM}"
new_url=""

say() { echo "wheel-check: $*" >&2; }

# Create or drop the check's database with the venv's own psycopg (a dependency of the
# wheel): no psql client needed.
database() {
  "$venv/bin/python" - "$1" "$dbname" <<'EOF'
import os, sys
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

action, name = sys.argv[1], sys.argv[2]
admin = os.environ["KAFKA_IDEM_DATABASE_URL"]
with psycopg.connect(admin, autocommit=True) as conn:
    if action == "create":
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        print(make_conninfo(admin, dbname=name))
    else:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
EOF
}

cleanup() {
  local code=$?
  if [[ -n "$new_url" ]]; then
    database drop || { say "could not drop database $dbname"; code=1; }
  fi
  rm -rf "$work"
  exit "$code"
}
trap cleanup EXIT

# Outside the repository, with no PYTHONPATH: only the installed wheel can be imported
# (a checkout on PYTHONPATH would also make pip take its kafka_idem.egg-info for an
# installed kafka-idem and skip the wheel).
cd "$work"
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
say "a new venv with only $(basename "$wheel") and its dependencies"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
location="$("$venv/bin/python" -c 'import kafka_idem; print(kafka_idem.__file__)')"
[[ "$location" == "$venv/"* ]] || { say "kafka_idem imported from $location, not the venv"; exit 1; }

version="$("$venv/bin/kafka-idem" --version)"
[[ "$version" == "kafka-idem $expected" ]] || {
  say "kafka-idem --version printed '$version', expected 'kafka-idem $expected'"
  exit 1
}
say "$version"

new_url="$(database create)"
say "kafka-idem migrate on the new database $dbname"
first="$(KAFKA_IDEM_DATABASE_URL="$new_url" "$venv/bin/kafka-idem" migrate)"
echo "$first" >&2
[[ "$first" == "schema kafka_idem: 0001_"*"$last_migration" ]] || {
  say "migrate did not apply 0001 to $last_migration: '$first'"
  exit 1
}
again="$(KAFKA_IDEM_DATABASE_URL="$new_url" "$venv/bin/kafka-idem" migrate)"
[[ "$again" == "schema kafka_idem: nothing to do" ]] || {
  say "a second migrate was not a no-op: '$again'"
  exit 1
}
cat > "$work/wheelapp.py" <<'EOF'
from kafka_idem import App, Context

app = App("wheel-check")


@app.handler(topic="wheel-check.orders", key="{order_id}", hash_fields=("order_id",))
def handle(msg: dict, ctx: Context) -> None:
    return None
EOF
set +e
out="$(cd "$work" && KAFKA_IDEM_DATABASE_URL="$new_url" "$venv/bin/kafka-idem" console wheelapp:app 2>&1)"
code=$?
set -e
[[ $code == 2 && "$out" == *"kafka-idem[console]"* ]] || {
  say "without the console extra, kafka-idem console exited $code: $out"
  exit 1
}
say "pip install '$(basename "$wheel")[console]'"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel[console]"
port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
(cd "$work" && KAFKA_IDEM_DATABASE_URL="$new_url" exec "$venv/bin/kafka-idem" console wheelapp:app \
   --port "$port" >"$work/console.log" 2>&1) &
console_pid=$!
served=""
for _ in $(seq 1 60); do
  if "$venv/bin/python" - "$port" 2>/dev/null <<'EOF'
import sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for path, needle in (("/healthz?ready=1", "ok"), ("/records", "kafka-idem console"),
                     ("/static/console.css", "kafka-idem console")):
    with urllib.request.urlopen(base + path, timeout=5) as r:
        assert needle in r.read().decode(), path
EOF
  then served=yes; break; fi
  sleep 1
done
kill -TERM "$console_pid" 2>/dev/null || true
wait "$console_pid" 2>/dev/null || true
[[ -n "$served" ]] || { say "the console did not serve its pages:"; cat "$work/console.log" >&2; exit 1; }
say "kafka-idem console served its pages, templates and static files"
echo "wheel-check: ok ($version; migrate applied 0001..${last_migration%%_*}, then nothing to do; console served)"
