"""A fleet: the instances kvscope watches together, named by repeated ``--attach`` flags or by a fleet file.

A fleet file is JSON or TOML: a list of ``instances``, each a table of the keys below, and an optional
``defaults`` table whose keys apply to every instance that does not set them::

    [defaults]
    block_size = 32
    bytes_per_block = 1179648       # the model's KV bytes per block: duplicated blocks are also given in bytes
    hash_algo = "sha256_cbor"       # the instances' --prefix-caching-hash-algo ("auto": found from their blocks)
    hash_seed = "0"                 # their PYTHONHASHSEED (unset: vLLM's default seed)

    [[instances]]
    name = "a"
    endpoint = "tcp://10.0.0.5:5557"
    replay_endpoint = "tcp://10.0.0.5:5558"
    metrics = "http://10.0.0.5:8000/metrics"   # its usage and load, scraped every 2 s

Every mistake (no such file, not JSON or TOML, an unknown key, a wrong type, two instances with one name or one
address, an address kvscope cannot connect to) is refused with one line naming the file, the instance and the
key (``FleetError``), before any socket opens. No sockets here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

from engine.core.vllm_hashing import VLLM_HASH_ALGOS
from engine.messages import one_line
from kvscope.sources.endpoints import offset_endpoint

HASH_ALGO_CHOICES = ("auto",) + VLLM_HASH_ALGOS
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\s\[\]]+):(?P<port>\d+)$")
_HTTP = re.compile(r"^https?://[^/\s:]+(:\d+)?(/\S*)?$")
_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,48}$")


class FleetError(ValueError):
    """A fleet that cannot be watched; the message is one line."""


@dataclass(frozen=True)
class InstanceSpec:
    """One instance of the fleet: where its KV events are published, and what kvscope needs to read them."""

    name: str
    endpoint: str  # its KV-event PUB address (rank 0's), e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # its replay ROUTER, to repair gaps
    topic: str = ""
    dp_size: int = 1  # data-parallel ranks, on consecutive ports
    block_size: int | None = None  # expected; None: whatever its events say
    bytes_per_block: int | None = None  # the model's KV bytes per block: duplication in bytes
    hash_algo: str = "auto"  # its vLLM --prefix-caching-hash-algo; auto: found from its first blocks
    hash_seed: str | None = None  # its PYTHONHASHSEED; None: unset (vLLM's default seed)
    metrics: str | None = None  # its Prometheus /metrics URL: usage, running and waiting requests

    def rank_endpoints(self) -> list[str]:
        return [offset_endpoint(self.endpoint, r) for r in range(self.dp_size)]

    def rank_replay_endpoints(self) -> list[str]:
        return [offset_endpoint(self.replay_endpoint, r) for r in range(self.dp_size)] if self.replay_endpoint else []


@dataclass(frozen=True)
class FleetSpec:
    instances: tuple[InstanceSpec, ...]
    origin: str  # where it was read from, for messages: "fleet file f.toml" or "--attach"


KEYS = {f.name: f for f in fields(InstanceSpec)}
PER_INSTANCE = ("name", "endpoint", "replay_endpoint", "metrics")  # never in [defaults]
DEFAULT_KEYS = tuple(k for k in KEYS if k not in PER_INSTANCE)
_INT_KEYS = ("dp_size", "block_size", "bytes_per_block")


def check_zmq_address(addr: object, what: str) -> str:
    """A ZeroMQ address kvscope can connect to, or a ``FleetError`` naming ``what``."""
    if not isinstance(addr, str) or not addr:
        raise FleetError(f"{what} must be a ZeroMQ address such as tcp://10.0.0.5:5557")
    if addr.startswith(("ipc://", "inproc://")) and len(addr.split("://", 1)[1]) > 0:
        return addr
    m = _TCP.match(addr)
    if not m:
        raise FleetError(f"{what} {addr!r} is not a ZeroMQ address such as tcp://10.0.0.5:5557")
    if m["host"] in ("*", "0.0.0.0", "[::]"):
        raise FleetError(
            f"{what} {addr}: that is where an engine binds; give the address to connect to, "
            f"e.g. tcp://127.0.0.1:{m['port']}"
        )
    if not 0 < int(m["port"]) < 65536:
        raise FleetError(f"{what} {addr}: port {m['port']} is not between 1 and 65535")
    return addr


def _instance(raw: object, defaults: dict, where: str) -> InstanceSpec:
    if not isinstance(raw, dict):
        raise FleetError(f"{where} must be a table of keys (name, endpoint, ...), not {type(raw).__name__}")
    label = f"{where} ({raw['name']!r})" if isinstance(raw.get("name"), str) else where
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise FleetError(f"{label}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    for key in ("name", "endpoint"):
        if key not in raw:
            raise FleetError(f"{label}: no {key!r}")
    values = {**defaults, **raw}
    _check_values(values, label)
    if not _NAME.match(values["name"]):
        raise FleetError(f"{label}: name must be 1-48 letters, digits or . _ - : @ / +")
    check_zmq_address(values["endpoint"], f"{label}: endpoint")
    if values.get("replay_endpoint") is not None:
        check_zmq_address(values["replay_endpoint"], f"{label}: replay_endpoint")
    if values.get("metrics") is not None and not _HTTP.match(values["metrics"]):
        raise FleetError(
            f"{label}: metrics {values['metrics']!r} is not an http:// URL such as http://10.0.0.5:8000/metrics"
        )
    seed = values.get("hash_seed")
    if seed is not None:
        values["hash_seed"] = str(seed)
    return InstanceSpec(**values)


def _check_values(values: dict, label: str) -> None:
    """Types and ranges of every key given (the instance's own or its defaults)."""
    for key, v in values.items():
        if key in _INT_KEYS:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FleetError(f"{label}: {key} must be a whole number >= 1, not {v!r}")
        elif key == "hash_seed":
            if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, int) and v < 0):
                raise FleetError(
                    f"{label}: hash_seed must be the instances' PYTHONHASHSEED (a string or a whole number), not {v!r}"
                )
        elif key == "hash_algo":
            if v not in HASH_ALGO_CHOICES:
                raise FleetError(f"{label}: hash_algo {v!r} is not one of {', '.join(HASH_ALGO_CHOICES)}")
        elif not isinstance(v, str) and not (v is None and key in ("replay_endpoint", "metrics")):
            raise FleetError(f"{label}: {key} must be a string, not {v!r}")


def check_fleet(spec: FleetSpec) -> FleetSpec:
    """Names and addresses unique across the fleet (every rank's ports and replay ports counted)."""
    if not spec.instances:
        raise FleetError(f"{spec.origin}: no instances")
    names: dict[str, int] = {}
    addrs: dict[str, str] = {}
    for i, inst in enumerate(spec.instances):
        if inst.name in names:
            raise FleetError(f"{spec.origin}: two instances are named {inst.name!r}")
        names[inst.name] = i
        for what, addr in [("endpoint", a) for a in inst.rank_endpoints()] + [
            ("replay_endpoint", a) for a in inst.rank_replay_endpoints()
        ]:
            other = addrs.get(addr)
            if other is not None:
                raise FleetError(f"{spec.origin}: {addr} is both {other} and {inst.name!r}'s {what}")
            addrs[addr] = f"{inst.name!r}'s {what}"
    return spec


def read_fleet_file(path: str) -> FleetSpec:
    """A fleet file (``.json`` or ``.toml``), checked; raises ``FleetError`` with one line."""
    origin = f"fleet file {path}"
    p = Path(path)
    if not p.exists():
        raise FleetError(f"{origin}: no such file")
    if p.is_dir():
        raise FleetError(f"{origin} is a directory")
    suffix = p.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise FleetError(f"{origin}: give a .json or .toml file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FleetError(f"{origin} is not UTF-8 text") from None
    except OSError as e:
        raise FleetError(f"{origin} cannot be read: {e.strerror or e}") from None
    data = _parse(text, suffix, origin)
    if not isinstance(data, dict):
        raise FleetError(f"{origin}: the top level must be a table with 'instances', not {type(data).__name__}")
    unknown = sorted(set(data) - {"instances", "defaults"})
    if unknown:
        raise FleetError(f"{origin}: unknown key {unknown[0]!r} at the top level (known: instances, defaults)")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise FleetError(f"{origin}: defaults must be a table of keys")
    bad = sorted(set(defaults) - set(DEFAULT_KEYS))
    if bad:
        raise FleetError(f"{origin}: defaults: {bad[0]!r} cannot be a default (defaults: {', '.join(DEFAULT_KEYS)})")
    _check_values(defaults, f"{origin}: defaults")
    raw = data.get("instances")
    if not isinstance(raw, list) or not raw:
        raise FleetError(f"{origin}: 'instances' must be a non-empty list of instances")
    instances = tuple(_instance(r, defaults, f"{origin}: instance {i + 1}") for i, r in enumerate(raw))
    return check_fleet(FleetSpec(instances, origin))


def _parse(text: str, suffix: str, origin: str) -> object:
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise FleetError(f"{origin} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise FleetError(f"{origin}: reading TOML needs Python 3.11 or later; give a .json file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FleetError(f"{origin} is not valid TOML: {one_line(e)}") from None
