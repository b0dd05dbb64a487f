"""Doing less work under pressure: response cache, idempotency keys, the fallback model,
refusal pacing, refusing while the event loop itself runs late, and the capacity signal
that tells operators how many processes the load wants."""
