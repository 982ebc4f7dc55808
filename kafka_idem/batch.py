"""Where the batch path used to live; it is :mod:`kafka_idem.consume.batch` now.

Kept so that ``from kafka_idem.batch import READ_FIRST_AT, Fallback, claim_order,
run_batch`` goes on working.
"""

from kafka_idem.consume.batch import (
    READ_FIRST_AT,
    BatchPath,
    ClaimOrder,
    Fallback,
    claim_order,
    run_batch,
)

__all__ = ["READ_FIRST_AT", "BatchPath", "ClaimOrder", "Fallback", "claim_order", "run_batch"]
