"""One host-wide budget for the host tiers' automatic sizes: the workers of a host claim their shares in a
small locked file, so eight workers on one machine share 1/8 of its memory instead of taking 1/8 each."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

# the claims file (tests); default: in /dev/shm, else the temp directory
CLAIMS_ENV = "SWITCHYARD_HOST_CLAIMS"
HOST_SHARE = 8  # all automatic host tiers of a machine together take at most 1/8 of its memory


def claims_path() -> Path:
    if os.environ.get(CLAIMS_ENV):
        return Path(os.environ[CLAIMS_ENV])
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "switchyard-kv-host-claims.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(want: int, host_total: int) -> int:
    """Claim up to `want` bytes for this process out of 1/HOST_SHARE of `host_total`, less what the other live
    processes of the host hold (a dead process's claim is dropped); returns the grant (0 when nothing is
    left)."""
    path = claims_path()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        claims: dict[str, int] = {}
        with contextlib.suppress(ValueError):
            claims = {k: int(v) for k, v in json.loads(f.read() or "{}").items()}
        me = str(os.getpid())
        claims = {pid: n for pid, n in claims.items() if pid != me and pid.isdigit() and _alive(int(pid))}
        grant = max(0, min(want, host_total // HOST_SHARE - sum(claims.values())))
        claims[me] = grant
        f.seek(0)
        f.truncate()
        f.write(json.dumps(claims))
    return grant
