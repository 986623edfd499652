"""A free TCP port on this host, for a process group formed here (a world of one, `dsf calibrate`'s ranks).

    os.environ.setdefault("MASTER_PORT", str(free_port()))
"""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket holds now (the OS picks it; another process may take it before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
