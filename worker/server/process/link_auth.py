"""CurveZMQ on the worker port: the worker is the CURVE server under the cluster key pair, and its ZAP
handler admits only clients that present the cluster's public key, so only holders of the cluster secret
(the gateways) can submit work or receive frames.
"""

from __future__ import annotations

import hmac
import logging
import re

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

KEY_ENV = "SWITCHYARD_CLUSTER_SECRET_KEY"
_LOCAL_HOSTS = re.compile(r"^tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\]):")


class InsecureBind(ValueError):
    """A worker port reachable from other hosts with no cluster key configured."""


def public_key(secret_z85: str) -> bytes:
    """The z85 public key of a z85 CURVE secret key (ValueError when it is not one)."""
    try:
        return zmq.curve_public(secret_z85.encode())
    except (zmq.ZMQError, ValueError) as exc:
        raise ValueError("the cluster key is not a z85-encoded CURVE secret key (40 characters)") from exc


def is_local(endpoint: str) -> bool:
    """Only processes on this host can reach `endpoint` (loopback TCP, ipc, inproc)."""
    return endpoint.startswith(("ipc://", "inproc://")) or bool(_LOCAL_HOSTS.match(endpoint))


class _ClusterMembers:
    def __init__(self, cluster_public: bytes) -> None:
        self._public = cluster_public

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return hmac.compare_digest(z85_key, self._public)


class LinkAuth:
    """Secures one ROUTER socket before it binds; `close()` stops the ZAP handler thread."""

    def __init__(self, ctx: zmq.Context, secret_z85: str | None, bind: str) -> None:
        self._auth: ThreadAuthenticator | None = None
        self.check(secret_z85, bind)
        if secret_z85 is None:
            log.warning("worker port %s is NOT authenticated (no cluster key): any local process can submit "
                        "work; set %s outside development", bind, KEY_ENV)
            return
        self._public = public_key(secret_z85)
        self._secret = secret_z85.encode()
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("worker.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_ClusterMembers(self._public))

    @staticmethod
    def check(secret_z85: str | None, bind: str) -> None:
        """Raise InsecureBind for a port other hosts can reach when no cluster key is set."""
        if secret_z85 is None and not is_local(bind):
            raise InsecureBind(f"refusing to bind {bind} without a cluster key: any host could submit work. "
                               f"Set {KEY_ENV} (or cluster_secret_key in the config file) on workers and "
                               "gateways, or bind a loopback address for development")

    def secure(self, sock: zmq.Socket) -> None:
        if self._auth is not None:
            sock.curve_secretkey = self._secret
            sock.curve_publickey = self._public
            sock.curve_server = True

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
