"""Make the CURVE certificates a probe on the network needs: ``python -m kvscope_vllm_probe.keys DIR [NAME ...]``.

Writes, with pyzmq's ``create_certificates`` (nothing is overwritten):
    DIR/probe.key_secret            the probe's secret certificate: KVSCOPE_PROBE_SECRET_KEY on vLLM's machine
    DIR/probe.key                   its public one: kvscope's --probe-server-key
    DIR/NAME.key_secret             a subscriber's secret certificate: kvscope's --probe-key (NAME: kvscope)
    DIR/authorized/NAME.key         its public one, in the folder KVSCOPE_PROBE_AUTHORIZED_KEYS names
Secret certificates are readable by their owner only. Copy each file to the machine that needs it, and no further.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path


def make_keys(folder: str, names: list[str]) -> list[Path]:
    """The files written (``FileExistsError`` if any is there already)."""
    import zmq.auth

    d = Path(folder)
    authorized = d / "authorized"
    wanted = [d / "probe.key", d / "probe.key_secret"]
    for n in names:
        wanted += [d / f"{n}.key", d / f"{n}.key_secret", authorized / f"{n}.key"]
    there = [str(p) for p in wanted if p.exists()]
    if there:
        raise FileExistsError(f"not overwriting {', '.join(there)}")
    authorized.mkdir(parents=True, exist_ok=True)
    for n in ["probe", *names]:
        public, secret = zmq.auth.create_certificates(d, n)
        os.chmod(secret, 0o600)
        if n != "probe":
            shutil.copy(public, authorized / f"{n}.key")
    return wanted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvscope_vllm_probe.keys", description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("names", nargs="*", default=["kvscope"], help="one subscriber each (default: kvscope)")
    args = ap.parse_args(argv)
    try:
        written = make_keys(args.folder, args.names)
    except (OSError, ValueError) as e:
        print(f"kvscope_vllm_probe.keys: {e}", file=sys.stderr)
        return 2
    d = Path(args.folder)
    print("\n".join(str(p) for p in written))
    print(
        f"vLLM:    KVSCOPE_PROBE_SECRET_KEY={d / 'probe.key_secret'} KVSCOPE_PROBE_AUTHORIZED_KEYS={d / 'authorized'}\n"
        f"kvscope: --probe-key {d / (args.names[0] + '.key_secret')} --probe-server-key {d / 'probe.key'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
