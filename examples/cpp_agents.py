#!/usr/bin/env python3
"""A C++ NIXL rank: two real NIXL agents doing DRAM-to-DRAM UCX transfers, recorded by the C++ plug-in.

The agents are the C++ library (``nixl_cu12``, from the public ``nixl-cu12`` wheel) with its own
``prometheus_mp`` telemetry plug-in, exactly what a C++ rank of a NIXL job runs; Python only drives them.
Every agent writes a store into ``NIXL_TELEMETRY_MULTIPROC_DIR``, and whichever process owns the address
(this one, another rank, a Python rank, or the ``gunicorn`` aggregator) serves all of them on ``/metrics``.

Install (no GPU or torch needed; the wheel runs on CPU)::

    pip install --no-deps nixl-cu12==1.5.1 numpy

Run two ranks and scrape them::

    export NIXL_TELEMETRY_MULTIPROC_DIR=/tmp/nixl_metrics NIXL_TELEMETRY_PROMETHEUS_PORT=9090 \\
           NIXL_TELEMETRY_PROMETHEUS_LOCAL=y
    LOCAL_RANK=0 python examples/cpp_agents.py &
    LOCAL_RANK=1 python examples/cpp_agents.py --size 65536 &
    curl -s 127.0.0.1:9090/metrics | grep agent_tx_bytes_total

Each round (``--interval`` seconds) the first agent WRITEs ``--count`` transfers of ``--size`` bytes into
the second; the script prints one JSON line per round with its running totals (what ``/metrics`` must
show for the sending agent) and stops on SIGINT or SIGTERM. ``NIXL_TELEMETRY_ENABLE=y`` and
``NIXL_TELEMETRY_EXPORTER=prometheus_mp`` are set for it unless the environment says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

DEFAULT_BUFFER_BYTES = 1 << 20
# NIXL stages telemetry events and writes them into the store every NIXL_TELEMETRY_RUN_INTERVAL ms (default 100);
# what is still staged when the process exits is lost. Waiting this long after the last transfer lets the final
# round reach the store, so the last totals printed are the ones /metrics keeps showing.
LAST_WRITE_WAIT_S = 0.25


class AgentPair:
    """Agents ``<prefix>-tx`` and ``<prefix>-rx`` in this process; ``write(size)`` is one WRITE from tx to rx.

    Per transfer the plug-in records, on the tx agent only: ``agent_tx_bytes_total`` += size,
    ``agent_tx_requests_num_total`` += 1, ``agent_tx_last_bytes`` = size, one observation of the
    ``agent_xfer_time_us`` and ``agent_xfer_post_time_us`` histograms (and their ``_total`` and last-value
    series). Registering the buffer adds its size to ``agent_memory_registered_total`` on both agents.
    """

    def __init__(self, prefix: str, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        import numpy as np  # the wheel's own dependency
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self.names = (f"{prefix}-tx", f"{prefix}-rx")
        started = time.monotonic()
        self.tx = nixl_agent(self.names[0], nixl_agent_config(backends=["UCX"]))
        self.rx = nixl_agent(self.names[1], nixl_agent_config(backends=["UCX"]))
        self.create_s = time.monotonic() - started
        self._src = np.frombuffer(os.urandom(buffer_bytes), dtype=np.uint8).copy()
        self._dst = np.zeros(buffer_bytes, dtype=np.uint8)
        self.tx.register_memory([(self._src.ctypes.data, buffer_bytes, 0, "")], "DRAM")
        self.rx.register_memory([(self._dst.ctypes.data, buffer_bytes, 0, "")], "DRAM")
        self.tx.add_remote_agent(self.rx.get_agent_metadata())
        self.registered_bytes = buffer_bytes
        self.transfers = 0
        self.bytes = 0
        self.last_bytes = 0

    def write(self, size: int, timeout_s: float = 10.0) -> None:
        """One WRITE of ``size`` bytes, waited for; raises if it fails or takes longer than ``timeout_s``."""
        if not 0 < size <= self.registered_bytes:
            raise ValueError(f"size={size} must be in 1..{self.registered_bytes} (the registered buffer)")
        src = self.tx.get_xfer_descs([(self._src.ctypes.data, size, 0)], "DRAM")
        dst = self.rx.get_xfer_descs([(self._dst.ctypes.data, size, 0)], "DRAM")
        handle = self.tx.initialize_xfer("WRITE", src, dst, self.names[1])
        try:
            state = self.tx.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise RuntimeError(f"transfer of {size} bytes from {self.names[0]} ended in state {state}")
                state = self.tx.check_xfer_state(handle)
        finally:
            self.tx.release_xfer_handle(handle)
        if self._dst[:size].tobytes() != self._src[:size].tobytes():
            raise RuntimeError(f"transfer of {size} bytes completed but the destination differs")
        self.transfers += 1
        self.bytes += size
        self.last_bytes = size

    def totals(self) -> dict[str, Any]:
        """What this process did so far (the values ``/metrics`` must show for the tx agent)."""
        return {"pid": os.getpid(), "agents": list(self.names), "transfers": self.transfers, "bytes": self.bytes,
                "last_bytes": self.last_bytes, "registered_bytes": self.registered_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=f"rank{os.environ.get('LOCAL_RANK', os.getpid())}",
                        help="agent name prefix: the agents are <name>-tx and <name>-rx (default rank$LOCAL_RANK)")
    parser.add_argument("--size", type=int, default=4096, help="bytes per transfer (default 4096)")
    parser.add_argument("--count", type=int, default=10, help="transfers per round (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between rounds (default 1)")
    parser.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (default 0: never)")
    args = parser.parse_args(argv)
    if not os.environ.get("NIXL_TELEMETRY_MULTIPROC_DIR"):
        parser.error("NIXL_TELEMETRY_MULTIPROC_DIR is required: the directory shared by every rank of the run")
    os.environ.setdefault("NIXL_TELEMETRY_ENABLE", "y")
    os.environ.setdefault("NIXL_TELEMETRY_EXPORTER", "prometheus_mp")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pair = AgentPair(args.name, max(args.size, DEFAULT_BUFFER_BYTES))
    rounds = 0
    while not stop.is_set() and (args.rounds == 0 or rounds < args.rounds):
        for _ in range(args.count):
            pair.write(args.size)
        rounds += 1
        print(json.dumps(pair.totals()), flush=True)
        stop.wait(args.interval)
    time.sleep(LAST_WRITE_WAIT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
