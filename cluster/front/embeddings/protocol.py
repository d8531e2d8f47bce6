"""The embeddings request body and response (OpenAI's shapes, with vLLM's extensions), as
vLLM serves ``POST /v1/embeddings``.

    input: "text" | ["text", ...] | [id, ...] | [[id, ...], ...]   one engine request per input
    encoding_format: "float" (lists of numbers) | "base64" (float32 little-endian bytes, base64:
                     what the openai SDK asks for by default and decodes with numpy)
    dimensions       Matryoshka: the first N entries, renormalised (models whose config.json
                     says they support it; else a 400 naming the field, vLLM's words)
    vLLM's: truncate_prompt_tokens, truncation_side, add_special_tokens, priority, cache_salt,
            use_activation (older: normalize): normalise or not, over the model's default

A field this server does not implement is a 400 naming it (``NOT_IMPLEMENTED``; vLLM's
``embed_dtype`` / ``endianness`` only when they ask for something other than float32
little-endian); a field no OpenAI or vLLM schema has is accepted and named back, as on the
other routes.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import ClassVar, Literal

from pydantic import Field

from pagedserve.cluster.front.openai.schemas import Int, OpenAIBase, Text, TokenId, _IgnoredFields
from pagedserve.cluster.wire.outputs import decode_vector
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

# vLLM's embedding fields this server does not implement -> the values that ask for what it
# does anyway (None always does). Any other value is a 400 naming the field.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "embed_dtype": ("float32",), "endianness": ("native", "little"),
    "messages": (), "add_generation_prompt": (), "continue_final_message": (), "chat_template": (),
    "chat_template_kwargs": (), "mm_processor_kwargs": (), "media_io_kwargs": (), "padding": ("do_not_pad",),
    "request_id": (),
}


def embedding_id() -> str:
    return f"embd-{uuid.uuid4().hex}"  # vLLM's shape


class EmbeddingRequest(_IgnoredFields):
    _not_implemented: ClassVar[dict[str, tuple]] = NOT_IMPLEMENTED

    model: Text | None = None
    input: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    # vLLM's extensions.
    truncate_prompt_tokens: Int | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    priority: Int = 0
    cache_salt: Text | None = None
    use_activation: bool | None = None
    normalize: bool | None = None  # vLLM's older name for use_activation

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding asked for; ValueError (a 400 on ``input``) for an empty one."""
        p = self.input
        if isinstance(p, str):
            p = [p]
        elif p and all(isinstance(t, int) for t in p):
            p = [list(p)]  # type: ignore[list-item]
        if not p:
            raise ValueError("input must not be empty.")
        for i, q in enumerate(p):
            if len(q) == 0:
                raise ValueError(f"input[{i}] is empty: every input must have at least one "
                                 f"{'character' if isinstance(q, str) else 'token'}.")
        return list(p)

    def to_params(self) -> tuple[SamplingParams, PoolingParams]:
        """The truncation (the only SamplingParams an embedding reads) and the pooling
        params; ValueError (a 400) for out-of-range values."""
        if self.use_activation is not None and self.normalize is not None and self.use_activation != self.normalize:
            raise ValueError("use_activation and normalize (its older name) disagree: give one.")
        normalize = self.use_activation if self.use_activation is not None else self.normalize
        params = SamplingParams(max_tokens=None, detokenize=False, truncate_prompt_tokens=self.truncate_prompt_tokens,
                                truncation_side=self.truncation_side or "left")
        return params, PoolingParams(dimensions=self.dimensions, normalize=normalize)


class EmbeddingData(OpenAIBase):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBase):
    prompt_tokens: int = 0  # after truncate_prompt_tokens: what the model read
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBase):
    id: str = Field(default_factory=embedding_id)
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode(vector: bytes, encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or its float32 little-endian bytes in
    base64 (OpenAI's ``encoding_format: base64``)."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return decode_vector(vector)
