"""LoRA adapters as plain data: the adapter a request names (``LoRARequest``, vLLM's type
and field names) and the adapters a server is started with (``LoRAModulePath``, from
``--lora-modules``).

A request's adapter travels with it, front to worker:

    front: model "sql-lora" or "<base>:sql-lora" ─▶ EngineRequest.lora_request
    scheduler: Request.lora_request ─▶ its block hashes' salt (no prefix hit across adapters),
               at most ``max_loras`` distinct adapters running (lora_slots below)
    plan: NewRequestData.lora_request ─▶ worker/lora: the weights, loaded from ``lora_path``
          on first use, into one of ``max_loras`` slots

``lora_int_id`` names the weights inside one engine (slots, host cache, prefix cache): two
different adapters must never share one. The server makes it from the name and path
(``adapter_id``), so every front and replica agrees on it without asking each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id} (0 is the base model).")

    @classmethod
    def named(cls, name: str, path: str, base_model_name: str | None = None) -> "LoRARequest":
        return cls(name, adapter_id(name, path), path, base_model_name)


def adapter_id(name: str, path: str) -> int:
    """A positive 63-bit id from the adapter's name and path (sha256: the same on every
    process, whatever PYTHONHASHSEED)."""
    digest = hashlib.sha256(b"pagedserve/lora\x00%s\x00%s" % (name.encode(), path.encode())).digest()
    return (int.from_bytes(digest[:8], "big") >> 1) or 1


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's name): ``name=path`` or the JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(value) -> list[LoRAModulePath]:
    """``--lora-modules`` as the CLI, a config file or ``LLM(...)`` gives it: None, one
    entry or a list of entries, each ``"name=path"``, a JSON object as text, a dict or a
    LoRAModulePath. ValueError naming the entry that is malformed or a name given twice."""
    if value is None:
        return []
    entries = value if isinstance(value, (list, tuple)) else [value]
    out: list[LoRAModulePath] = []
    for entry in entries:
        if isinstance(entry, LoRAModulePath):
            out.append(entry)
            continue
        if isinstance(entry, str) and entry.lstrip().startswith("{"):
            try:
                entry = json.loads(entry)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules entry {entry!r} is not valid JSON: {e}") from None
        if isinstance(entry, dict):
            unknown = set(entry) - {"name", "path", "base_model_name"}
            if unknown or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
                raise ValueError(f"--lora-modules entry {entry!r}: expected {{\"name\": str, \"path\": str, "
                                 f"\"base_model_name\": str (optional)}}" +
                                 (f"; unknown key(s) {sorted(unknown)}" if unknown else ""))
            out.append(LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name")))
        elif isinstance(entry, str) and "=" in entry:
            name, path = entry.split("=", 1)
            out.append(LoRAModulePath(name.strip(), path.strip()))
        else:
            raise ValueError(f"--lora-modules entry {entry!r}: expected name=path or a JSON object.")
        if not out[-1].name or not out[-1].path:
            raise ValueError(f"--lora-modules entry {entry!r}: the name and the path must not be empty.")
    names = [m.name for m in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {twice[0]!r} twice.")
    return out


def lora_salt(lora: LoRARequest | None) -> str | None:
    """What a request's adapter adds to its prefix-cache salt (kv_cache_utils): the id and
    the name, so the same tokens under two adapters, or under an adapter and the base
    model, never share K/V."""
    return None if lora is None else f"{lora.lora_int_id}:{lora.lora_name}"
