"""Who a request belongs to: the tenant, from the API key or an allowed header.

    Authorization: Bearer <key> ── key in --api-keys-file? ──▶ that key's tenant
                                   (a key-mapped tenant cannot be overridden by x-tenant)
    x-tenant: <name>  ── only with --allow-tenant-header, else 400 naming the header
    otherwise ─────────▶ "default"

The keys file (YAML or JSON) maps each key to a tenant name, or to {tenant, weight}:

    sk-gold-1: gold                     # YAML
    sk-bronze-1: {tenant: bronze, weight: 0.5}

Weights join the engine's tenant_weights (the scheduler's fair share, fair_queue.py).
Tenant names are short identifiers: they become Prometheus label values and prefix-cache
salts, and ":" is kept for the scheduler's "priority:N" reservation classes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-tenant"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_tenant_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}: tenant name {name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    return name


@dataclass(slots=True)
class ApiKey:
    tenant: str
    weight: float | None = None


def load_api_keys(path: str) -> dict[str, ApiKey]:
    """The keys file -> {key: ApiKey}. A ValueError names the file and the bad entry."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        raw = json.loads(text)
    else:
        import yaml  # a YAML superset of JSON: either spelling works for .yaml/.yml/other

        raw = yaml.safe_load(text)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a mapping of API key -> tenant, got {type(raw).__name__}")
    keys: dict[str, ApiKey] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{path}: API keys must be non-empty strings, got {key!r}")
        if isinstance(value, str):
            keys[key] = ApiKey(check_tenant_name(value, path))
        elif isinstance(value, dict) and set(value) <= {"tenant", "weight"} and "tenant" in value:
            weight = value.get("weight")
            if weight is not None and (not isinstance(weight, (int, float)) or weight <= 0):
                raise ValueError(f"{path}: weight of tenant {value['tenant']!r} must be > 0, got {weight!r}")
            keys[key] = ApiKey(check_tenant_name(value["tenant"], path),
                               None if weight is None else float(weight))
        else:
            raise ValueError(f"{path}: each key maps to a tenant name or {{tenant, weight}}; "
                             f"got {value!r} (the key itself is not shown)")
    return keys


def key_weights(keys: dict[str, ApiKey]) -> dict[str, float]:
    """Tenant weights named in the keys file; two keys of one tenant must agree."""
    out: dict[str, float] = {}
    for k in keys.values():
        if k.weight is None:
            continue
        if out.setdefault(k.tenant, k.weight) != k.weight:
            raise ValueError(f"tenant {k.tenant!r} has two different weights in the keys file")
    return out


def parse_tenant_weight(text: str) -> tuple[str, float]:
    """``--tenant-weight gold=3``."""
    name, sep, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = -1.0
    if not sep or weight <= 0:
        raise ValueError(f"--tenant-weight {text!r}: expected NAME=WEIGHT with WEIGHT > 0")
    return check_tenant_name(name, "--tenant-weight"), weight


def parse_reservation(text: str) -> tuple[str, dict[str, int]]:
    """``--reserve gold:blocks=64,seqs=2`` or ``--reserve priority:0:seqs=1``: the class is
    everything before the last ':' (a tenant name, or "priority:N")."""
    cls, sep, spec = text.rpartition(":")
    if not sep or not cls:
        raise ValueError(f"--reserve {text!r}: expected CLASS:blocks=N,seqs=M")
    if cls.startswith("priority:"):
        if not cls[len("priority:"):].lstrip("-").isdigit():
            raise ValueError(f"--reserve {text!r}: priority class must be priority:<int>")
    else:
        check_tenant_name(cls, "--reserve")
    out: dict[str, int] = {}
    for part in spec.split(","):
        field, _, value = part.partition("=")
        if field not in ("blocks", "seqs") or not value.isdigit() or field in out:
            raise ValueError(f"--reserve {text!r}: each of blocks=N, seqs=M at most once, N >= 0")
        out[field] = int(value)
    return cls, out
