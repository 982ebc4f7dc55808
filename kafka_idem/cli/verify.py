"""``kafka-idem verify``: prove the seven scenarios against your Kafka and PostgreSQL.

    kafka-idem verify                          # all scenarios, local services by default
    kafka-idem --bootstrap-servers b:9092 --database-url postgresql://... verify
    kafka-idem verify --scenario 4 --scenario 5 --json report.json --keep

Exit codes: 0 every scenario passed (or was skipped, with the reason); 1 a scenario
failed; 2 usage or configuration error; 3 Kafka or PostgreSQL unreachable.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from kafka_idem.cli.common import Ctx
from kafka_idem.cli.errors import STATE
from kafka_idem.observe.redact import redact
from kafka_idem.observe.text import cell


@click.command()
@click.option("--scenario", "scenarios", multiple=True, metavar="N[,N...]",
              help="Run only these scenarios (1-7; 5 = 5a and 5b; repeatable or a comma "
                   "list). Default: all. 5b needs the repository's example gateway "
                   "(consumers/gateway.py, run from a checkout); without it, it is SKIPPED.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report to this file (JSON).")
@click.option("--keep", is_flag=True,
              help="Leave each scenario's topics, schemas, group and member logs for "
                   "inspection (their names are printed).")
@click.option("--prefix", help="Put this before every topic and consumer group verify "
              "creates (default: the name_prefix setting, KAFKA_IDEM_NAME_PREFIX), e.g. "
              "'team-a.' on a cluster whose ACLs grant names by prefix.")
@click.pass_obj
def verify(obj: Ctx, scenarios: tuple[str, ...], json_path: Path | None, keep: bool,
           prefix: str | None) -> None:
    """Run the seven exactly-once scenarios (1-7, scenario 5 in two parts, 5a and 5b)
    against the configured Kafka and
    PostgreSQL, with real member processes and real signals, and print what each one
    checked, the durable figures it read and PASS/FAIL.

    Each scenario uses fresh topics and a group ([PREFIX]kafka-idem-verify.<run>.s<N>) and
    fresh schemas
    (verify_<run>_s<N>, verify_<run>_s<N>_biz); your existing tables are never touched.
    The database role needs CREATE on the database; Kafka must allow creating and
    deleting topics and consumer groups."""
    from kafka_idem import verify as verification

    try:
        chosen = verification.select(scenarios)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--scenario") from exc
    if prefix is not None:
        obj.overrides["name_prefix"] = prefix
    settings = obj.settings()
    # The progress lines and the table are the output; the library's INFO logs are noise.
    logging.getLogger("kafka_idem").setLevel(logging.WARNING)
    err = Console(stderr=True)

    def line(text: str) -> Text:  # plain text (never markup), secrets masked
        return cell(redact(text, STATE.secrets))

    report = verification.run(settings, chosen, keep=keep,
                              progress=lambda text: err.print(line(text)))
    report.secrets = tuple(dict.fromkeys(report.secrets + tuple(STATE.secrets)))
    console = Console()
    report.print(console)
    counts = report.to_json()["counts"]
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    console.print(line(f"run {report.run_id}: {summary} in {report.seconds:.1f}s"))
    if keep:
        console.print(line("kept for inspection:"))
        for o in report.outcomes:
            a = o.artefacts
            console.print(line(f"  {o.id}: schemas {', '.join(a.get('schemas', [])) or '-'}; "
                               f"topics {', '.join(a.get('topics', [])) or '-'}; "
                               f"group {', '.join(a.get('groups', [])) or '-'}"))
    if report.logs:
        console.print(line(f"member logs: {report.logs}"))
    if json_path is not None:
        report.write_json(json_path)
        console.print(line(f"report written to {json_path}"))
    sys.exit(0 if report.passed else 1)
