"""Soak: a long mixed load through Nginx with periodic faults, then the books.

    scripts/soak [--seconds 120] [--rate 150] [--fault-every-s 10] [--out DIR]

Starts redis-server, Vega processes A and B behind Nginx (least_conn), and a third
process C that only steals from the overflow stream (not behind Nginx). Sends an
open-loop mix of classes, with some inputs that make the model raise, and cycles
through faults: kill -9 of C (holding stolen work) and a restart; redis-server killed
and restarted; Redis frozen (SIGSTOP); SIGTERM (drain) of B and a restart. At the
end it prints the books — sent, answered by status, lost, doubled, items run again
after a fault (a stolen batch whose thief died, or whose reply was cut off with Redis) —
and the peak RSS and descriptors of each process; exit 1 if any promise broke.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson

from tests.books import Books, Planned, offer
from tests.infra import Nginx, RedisServer
from tests.models import FAIL_MARK, ledger, tagged
from tests.servers import VegaProcess

CLASSES = ("sheddable", "sheddable", "normal", "normal", "critical")
ENV = {"VEGA_MODEL": "python:tests.models:echo", "TEST_SLEEP_MS": "20",
       "VEGA_MAX_BATCH_SIZE": "8", "VEGA_LENGTH_BUCKETS": "16", "VEGA_HEARTBEAT_MS": "200",
       "VEGA_CLAIM_IDLE_MS": "1000", "VEGA_QUEUE_CAPACITY": "128"}


def plan(rate: float, seconds: float, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    out, t, i = [], 0.0, 0
    while t < seconds:
        i += 1
        rows = tagged(i)
        if rng.random() < 0.02:
            rows[0][0] = FAIL_MARK  # the model raises on this one's batch
        doc = {"inputs": rows, "priority": rng.choice(CLASSES), "deadline_ms": 2000}
        out.append(Planned(at_s=t, id=i, body=orjson.dumps(doc)))
        t += rng.expovariate(rate)
    return out


def peak(proc: VegaProcess, seen: dict[str, tuple[int, int]], name: str) -> None:
    if proc.proc is None or proc.proc.poll() is not None:
        return
    try:
        status = Path(f"/proc/{proc.proc.pid}/status").read_text()
        rss = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM"))
        fds = len(os.listdir(f"/proc/{proc.proc.pid}/fd"))
    except (OSError, StopIteration):
        return
    old = seen.get(name, (0, 0))
    seen[name] = (max(old[0], rss), max(old[1], fds))


async def faults(every_s: float, seconds: float, redis_server: RedisServer,
                 b: VegaProcess, c: VegaProcess, log: list[str],
                 seen: dict[str, tuple[int, int]]) -> None:
    cycle = 0
    elapsed = 0.0
    while elapsed + every_s < seconds:
        await asyncio.sleep(every_s)
        elapsed += every_s
        for name, proc in (("B", b), ("C", c)):
            peak(proc, seen, name)
        kind = cycle % 4
        cycle += 1
        if kind == 0:
            log.append(f"{elapsed:.0f}s: kill -9 C, restart")
            c.kill()
            await asyncio.to_thread(c.start)
        elif kind == 1:
            log.append(f"{elapsed:.0f}s: redis-server killed, restarted after 2 s")
            redis_server.stop()
            await asyncio.sleep(2)
            await asyncio.to_thread(redis_server.start)
        elif kind == 2:
            log.append(f"{elapsed:.0f}s: Redis frozen 1.5 s (SIGSTOP)")
            await asyncio.to_thread(redis_server.pause, 1.5)
        else:
            log.append(f"{elapsed:.0f}s: SIGTERM B (drain), restart")
            await asyncio.to_thread(b.stop)
            await asyncio.to_thread(b.start)


async def soak(args: argparse.Namespace) -> int:
    work = Path(args.out or tempfile.mkdtemp(prefix="vega-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    ran = work / "ran"
    redis_server = RedisServer(work).start()
    env = {**ENV, "VEGA_REDIS_URL": redis_server.url, "TEST_LEDGER": str(ran)}
    procs = {name: VegaProcess({**env, "VEGA_NODE_ID": name}, log_path=work / f"{name}.log")
             for name in "ABC"}
    nginx_dir = work / "nginx"
    nginx_dir.mkdir(exist_ok=True)
    proxy = Nginx([f"127.0.0.1:{procs[n].port}" for n in "AB"], nginx_dir)
    seen: dict[str, tuple[int, int]] = {}
    events: list[str] = []
    try:
        for proc in procs.values():
            proc.start()
        proxy.start()
        books = Books()
        load = offer(proxy.url, plan(args.rate, args.seconds, args.seed), books,
                     connections=128)
        await asyncio.gather(load, faults(args.fault_every_s, args.seconds, redis_server,
                                          procs["B"], procs["C"], events, seen))
        for name, proc in procs.items():
            peak(proc, seen, name)
    finally:
        proxy.stop()
        for proc in procs.values():
            proc.kill()
        redis_server.stop()
    ran_ids = ledger(str(ran))
    problems = books.problems(ran_ids, reruns_allowed=True)
    print("faults: " + "; ".join(events))
    print("books: " + books.summary())
    tally = books.tally()
    print(f"lost {tally['lost'] + books.unanswered()}, doubled {len(books.doubled)}, "
          f"outside the table {len(books.outside_table)}")
    print(f"items run again after a fault (answered once): {len(books.reruns(ran_ids))}")
    for name, (rss, fds) in sorted(seen.items()):
        print(f"{name}: peak RSS {rss} KiB, peak descriptors {fds}")
    print("OK" if not problems else "BROKEN: " + "; ".join(problems))
    print(f"logs in {work}")
    return 0 if not problems else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=150.0, help="requests per second")
    parser.add_argument("--fault-every-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="")
    return asyncio.run(soak(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
