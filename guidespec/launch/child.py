"""Entry point of every engine process: ``run`` takes its role and configuration (JSON) and runs
that process's loop, in a process forked by the client's zygote (``launch/zygote.py``) or in
``python -m guidespec.launch.child``, which reads them on stdin.

Processes are started these ways, not with multiprocessing, so that nothing is pickled and the
user's main module is never re-imported (a script without ``if __name__ == "__main__"``,
a notebook or ``python -c`` all work).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from guidespec.config import SchedulerConfig, WorkerConfig, config_from_dict


def main() -> None:
    job = json.loads(sys.stdin.read())
    run(job, int(job["parent_pid"]))


def run(job: dict[str, Any], parent_pid: int) -> None:
    """Run the loop of ``job``'s role; the process exits with its parent ``parent_pid``."""
    role = job["role"]
    if role == "scheduler":
        from guidespec.scheduler.grammar import fork_compile_process, grammar_settings
        from guidespec.scheduler.scheduler import run_scheduler

        config = config_from_dict(SchedulerConfig, job["config"])
        # forked once the scheduler's imports are done, before any of its threads starts
        compile_process = fork_compile_process(grammar_settings(config))
        run_scheduler(config, parent_pid, compile_process)
    elif role == "worker":
        from guidespec.worker.worker import run_worker

        run_worker(config_from_dict(WorkerConfig, job["config"]), parent_pid)
    else:
        raise SystemExit(f"unknown role {role!r}")


def _exit_now() -> None:
    """Exit without the interpreter's teardown: with torch, xgrammar and transformers imported it
    takes 0.9-1.3 s, the most of an engine's shutdown. The loops have closed what they opened
    (shared memory, sockets, the compile process); what is left is buffered output."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _exit_now()
