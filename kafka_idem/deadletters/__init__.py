"""Dead letters as the member writes them: the record and its ``idem.*`` headers
(:mod:`~kafka_idem.deadletters.dead_letter`) and their signature
(:mod:`~kafka_idem.deadletters.signing`). Reading and replaying them:
:mod:`kafka_idem.replay`."""
