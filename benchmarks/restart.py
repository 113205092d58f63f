"""How long a dead engine takes to come back: a server's worker rank 0 killed (SIGKILL) again
and again, with requests in flight.

    python benchmarks/restart.py [--kills 5] [--gap-s 2]

For each kill: the time from the kill until every request in flight has its answer (a 503, or
a stream's error event of code 503: goal <= 2 s), until ``/health`` says 200 again, and until
a request is served again (goal <= 60 s); and whether anything of the dead engine is left (its
processes, its shared-memory segment, its ipc socket files). The crash-loop limit is raised
for the run (``GUIDESPEC_CRASH_LOOP_DEATHS``), so every kill is restarted.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.entrypoints.serving import (
    AUTH,
    alive,
    engine_processes,
    healthy,
    shared_files,
    start_server,  # noqa: E402
    stop_server,
)

ASK = [{"role": "user", "content": "Tell me a long story."}]


def _inflight(url: str, answers: list[tuple[float, int]]) -> None:
    body = {"messages": ASK, "max_tokens": 1500, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    answers.append((time.monotonic(), response.status_code))


def kill_once(url: str, server_pid: int, num_inflight: int) -> dict[str, float]:
    before, files = engine_processes(server_pid), shared_files()
    answers: list[tuple[float, int]] = []
    threads = [threading.Thread(target=_inflight, args=(url, answers)) for _ in range(num_inflight)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    worker = next(pid for pid, name in before.items() if name == "gs-worker0")
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)
    answered = max(t for t, _ in answers) - killed
    while not healthy(url):
        time.sleep(0.05)
    health = time.monotonic() - killed
    served = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, headers=AUTH, timeout=60
    ).status_code
    serving = time.monotonic() - killed
    left = [pid for pid in before if alive(pid)]
    now = shared_files()
    return {
        "answered_s": answered,
        "healthy_s": health,
        "serving_s": serving,
        "all_503": float(all(code == 503 for _, code in answers)),
        "served": float(served == 200),
        "left_processes": float(len(left)),
        # the dead engine's ring, mask arena and three ipc sockets gone, the fresh one's five there
        "files_replaced": float(len(files - now) == len(now - files) == 5),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight at each kill")
    parser.add_argument("--gap-s", type=float, default=2.0, help="pause after each restart")
    args = parser.parse_args()
    os.environ["GUIDESPEC_CRASH_LOOP_DEATHS"] = str(args.kills + 1)
    server = start_server("--max-batch-size", "8")
    rows = []
    try:
        for i in range(args.kills):
            row = kill_once(server.url, server.process.pid, args.inflight)
            rows.append(row)
            print(
                f"kill {i + 1}: in-flight answered in {row['answered_s']:.2f} s (all 503: {bool(row['all_503'])}), "
                f"/health 200 after {row['healthy_s']:.2f} s, served after {row['serving_s']:.2f} s, "
                f"processes left {row['left_processes']:.0f}, files replaced {bool(row['files_replaced'])}",
                flush=True,
            )
            time.sleep(args.gap_s)
    finally:
        stop_server(server)
    for key in ("answered_s", "healthy_s", "serving_s"):
        values = [r[key] for r in rows]
        print(f"{key}: median {statistics.median(values):.2f}, min {min(values):.2f}, max {max(values):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
