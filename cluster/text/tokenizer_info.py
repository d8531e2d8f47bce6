"""GET /tokenizer_info: the tokenizer's configuration as vLLM returns it, what a client
needs to tokenize as the server does (tokenizer_config.json's fields: special tokens,
added tokens, the chat template), without the files' paths on the server."""

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


def tokenizer_info(tokenizer) -> dict[str, Any]:
    info = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PATH_FIELDS}
    info = _jsonable(info)
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if decoder and "added_tokens_decoder" not in info:
        info["added_tokens_decoder"] = {str(i): t.content for i, t in decoder.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info
