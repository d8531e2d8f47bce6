"""GET /tokenizer_info: the tokenizer's configuration as vLLM returns it, what a client
needs to tokenize as the server does (tokenizer_config.json's fields: special tokens,
added tokens, the chat template), without the files' paths on the server. Added tokens
keep tokenizer_config.json's structure, {"id": {"content", "special", ...}} (the other
AddedToken values, e.g. bos_token, are their text)."""

from __future__ import annotations

from typing import Any

_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "special_tokens_map_file")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "content"):  # an AddedToken: its text, as vLLM sends it
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(t: Any) -> dict[str, Any]:
    """One entry of added_tokens_decoder as tokenizer_config.json writes it."""
    if isinstance(t, dict):
        return {k: t[k] for k in _ADDED_TOKEN_FIELDS if k in t}
    return {k: getattr(t, k) for k in _ADDED_TOKEN_FIELDS if hasattr(t, k)}


def tokenizer_info(tokenizer) -> dict[str, Any]:
    info = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PATH_FIELDS}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or info.get("added_tokens_decoder")
    info = _jsonable(info)
    if decoder:  # {"id": {content, special, ...}}, as tokenizer_config.json has it
        info["added_tokens_decoder"] = {str(i): _added_token(t) for i, t in decoder.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info
