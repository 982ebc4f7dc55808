"""A batch of ORM handlers that each load a few hundred objects: every scenario passes,
and the process lives. On CPython 3.11 closing each handler's session right after its
flush (``Session.close()``, detaching its objects) crashed the process in the garbage
collector on the batch path (a segfault; not on 3.12), so the check runs in a process
of its own: a crash fails this test instead of the whole run."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import DB

CHECK = """
from kafka_idem.testing import Harness
from tests.apps.orm_subscriptions import TOPIC, app, many_subscriptions

batch = [{"sub_ref": f"s-{i}", "customer": f"c-{i % 7}", "seats": 1 + i % 3}
         for i in range(40)]
with Harness(app, setup=many_subscriptions) as harness:
    report = harness.check(TOPIC, batch[0], batch=batch, scenarios=["once", "batch"])
print("PASSED" if report.passed else report)
"""


def test_a_batch_of_handlers_loading_hundreds_of_objects_passes_and_the_process_lives(
    db: DB,
) -> None:
    env = {**os.environ, "KAFKA_IDEM_DATABASE_URL": db.dsn}
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                         text=True, timeout=300, cwd=os.getcwd())
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    assert run.stdout.strip().endswith("PASSED"), run.stdout[-3000:]
