"""Machines 1..N-1 of a launch wait for machine 0's rendezvous port before starting."""

from __future__ import annotations


def wait_for_main(host: str, port: int, timeout: float) -> bool:
    """On machines 1..N-1: can the main machine's rendezvous port be reached in time?"""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
