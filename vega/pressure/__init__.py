"""Doing less work under pressure: response cache, idempotency keys, refusal pacing and the
capacity signal that tells operators how many processes the load wants."""
