"""What this process's KV routers decided, for the front's /metrics: requests routed by
prefix or by load, and the prompt tokens the chosen replica already held. A module of its
own because Serve pickles the router's module by value (routing.py): counts kept there
would be a copy /metrics never reads. Any thread."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_routed = {"prefix": 0, "load": 0}
_tokens = {"prompt": 0, "matched": 0}


def count(by: str, matched_tokens: int, prompt_tokens: int) -> None:
    with _lock:
        _routed[by] += 1
        _tokens["matched"] += min(matched_tokens, prompt_tokens)
        _tokens["prompt"] += prompt_tokens


def snapshot() -> dict:
    """{"routed": {"prefix": n, "load": n}, "prompt_tokens": n, "matched_tokens": n}"""
    with _lock:
        return {"routed": dict(_routed), "prompt_tokens": _tokens["prompt"], "matched_tokens": _tokens["matched"]}
