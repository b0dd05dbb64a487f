"""Doing less work under pressure: response cache, idempotency keys, refusal pacing,
refusing while the event loop itself runs late, and the capacity signal that tells
operators how many processes the load wants."""
