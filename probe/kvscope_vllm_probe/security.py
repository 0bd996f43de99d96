"""Who may do what through the probe's socket, read once from vLLM's environment when the probe starts.

- **Watching** (the pool, each step, every request's token ids, i.e. the users' prompts and outputs) is for
  authenticated subscribers only: a peer that said ``Hello`` and, on an endpoint with keys, got through ZeroMQ's
  CURVE handshake with a public certificate from ``KVSCOPE_PROBE_AUTHORIZED_KEYS`` (every byte then encrypted).
  On a loopback endpoint with no keys, every process of this machine counts as authenticated (loopback is for a
  machine whose users are trusted, as with vLLM's own API on 127.0.0.1); on a machine shared with people you do
  not trust, use ``ipc://`` in a folder only you can open, or keys on loopback too.
- **Pause, Step and Run** are refused unless ``KVSCOPE_PROBE_CONTROL=1``.
- **Faults from a subscriber** are refused unless ``KVSCOPE_PROBE_REMOTE_FAULTS=1`` (tests and teaching only;
  ``KVSCOPE_PROBE_FAULT`` in vLLM's own environment needs no switch: whoever sets it runs vLLM).
- **An endpoint reachable from the network** (anything but loopback or ``ipc://``) needs keys: without them the
  probe refuses in one line in vLLM's log and vLLM runs unprobed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .constants import ENV_AUTHORIZED_KEYS, ENV_CONTROL, ENV_REMOTE_FAULTS, ENV_SECRET_KEY
from .endpoints import is_loopback

KEYS_HELP = "python -m kvscope_vllm_probe.keys DIR makes them"


@dataclass(frozen=True, slots=True)
class Access:
    control: bool = False  # pause, step and run
    remote_faults: bool = False  # SetFault from a subscriber
    secret_key: str = ""  # the probe's own secret certificate ("": no keys)
    authorized_keys: str = ""  # the folder of the public certificates let in

    @property
    def keys(self) -> bool:
        return bool(self.secret_key)


def _switch(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: give 1 (on) or 0 (off)")
    return value == "1"


def access_from_env(endpoint: str, env: Mapping[str, str] = os.environ) -> Access:
    """What vLLM's environment allows at ``endpoint``; ``ValueError`` (one line) when it cannot be allowed."""
    secret = env.get(ENV_SECRET_KEY, "").strip()
    authorized = env.get(ENV_AUTHORIZED_KEYS, "").strip()
    if bool(secret) != bool(authorized):
        raise ValueError(f"give both {ENV_SECRET_KEY} and {ENV_AUTHORIZED_KEYS}, or neither ({KEYS_HELP})")
    if secret:
        public, own = load_certificate(secret)
        if own is None:
            raise ValueError(f"{ENV_SECRET_KEY}={secret}: a public certificate, not the probe's secret one")
        folder = Path(authorized)
        if not folder.is_dir() or not any(folder.glob("*.key")):
            raise ValueError(f"{ENV_AUTHORIZED_KEYS}={authorized}: no folder of public certificates (*.key) there")
    elif not is_loopback(endpoint):
        raise ValueError(
            f"{endpoint} is reachable from the network and the probe has no keys: set {ENV_SECRET_KEY} and "
            f"{ENV_AUTHORIZED_KEYS} ({KEYS_HELP}), or listen on loopback"
        )
    return Access(_switch(env, ENV_CONTROL), _switch(env, ENV_REMOTE_FAULTS), secret, authorized)


def load_certificate(path: str) -> tuple[bytes, bytes | None]:
    """A ZeroMQ certificate file's (public key, secret key or None), or ``ValueError`` in one line."""
    import zmq.auth

    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable ZeroMQ certificate ({e}; {KEYS_HELP})") from None


def client_keys(secret_key: str, server_key: str) -> tuple[bytes, bytes, bytes]:
    """A subscriber's (public, secret, the probe's public) keys from its secret certificate and the probe's public
    one; ``ValueError`` in one line."""
    public, secret = load_certificate(secret_key)
    if secret is None:
        raise ValueError(f"{secret_key}: a public certificate; give your own secret one (.key_secret)")
    server, _ = load_certificate(server_key)
    return public, secret, server


def serve_securely(ctx, socket, access: Access):
    """CURVE on ``socket`` (before it binds) with a ZAP handler on ``ctx`` that lets in the authorized keys only;
    the handler (stop it when the socket closes), or None without keys."""
    if not access.keys:
        return None
    import logging

    from zmq.auth.thread import ThreadAuthenticator

    public, secret = load_certificate(access.secret_key)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvscope_vllm_probe.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=access.authorized_keys)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_server = True
    return auth
