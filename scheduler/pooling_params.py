"""PoolingParams: what a pooling request asks of the worker (vLLM's PoolingParams, the
embedding task). A request that carries them runs its prompt only (prefill, chunked or not),
samples nothing, and ends with its pooled hidden state:

    hidden states of the prompt ─ pooling_type ─▶ one vector [hidden] (fp32)
        LAST  the last position's          (prefix-cache hits fine: the last is always computed)
        MEAN  the mean over every position (summed chunk by chunk on the worker)
        CLS   the first position's
    ─▶ the first ``dimensions`` entries (Matryoshka; None: all) ─▶ L2-normalised if ``normalize``

The engine fills ``pooling_type`` and ``normalize`` from the model's pooler config
(worker/pooler.py) where the request leaves them None; the scheduler reads
``reads_prefix_cache``, the worker the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(slots=True)
class PoolingParams:
    # Matryoshka truncation: keep the first ``dimensions`` entries before normalising.
    dimensions: int | None = None
    # None: the model's default (its sentence-transformers Normalize module; True without
    # one). vLLM's request field is ``use_activation`` (older: ``normalize``).
    normalize: bool | None = None
    # None: the model's (worker/pooler.py). One of POOLING_TYPES.
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}.")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may stand in for computed positions: only with LAST
        pooling (the last position is never a hit). MEAN needs every position's hidden
        state and CLS the first one's, which a hit skips; such a request computes its
        whole prompt (its blocks are still cached for others after)."""
        return self.pooling_type == "LAST"


def check_dimensions(dimensions: int | None, model: str, embedding_size: int, matryoshka: bool,
                     sizes: list[int] | None) -> None:
    """ValueError (vLLM's words) unless the model can return ``dimensions`` entries: its
    config.json says it is Matryoshka-trained (``matryoshka``; ``sizes``: the sizes it allows,
    None for any), and ``dimensions`` is in [1, embedding_size]."""
    d = dimensions
    if d is None:
        return
    if not matryoshka:
        raise ValueError(f"Model {model!r} does not support Matryoshka embeddings; dimensions must be unset "
                         f"(received dimensions={d}).")
    if not 1 <= d <= embedding_size:
        raise ValueError(f"Model {model!r} only supports dimensions in range [1, {embedding_size}], got {d}.")
    if sizes is not None and d not in sizes:
        raise ValueError(f"Model {model!r} only supports Matryoshka dimensions {sizes}, got {d}.")


def runner_mismatch(model: str, pooling: bool, api: str = "Completions") -> str:
    """The 400 for a request the model's runner does not serve (vLLM's words first, then
    how to serve it): an embedding request to a generation model (``pooling``), or a
    generation request (``api``: "Completions", "Chat Completions", ...) to an embedding one."""
    if pooling:
        return (f"The model does not support Embeddings API: {model!r} is served for text generation. Serve an "
                "embedding model with --runner pooling (vLLM's older flag: --task embed) to use /v1/embeddings.")
    return (f"The model does not support {api} API: {model!r} is served for embeddings (--runner pooling); "
            "use POST /v1/embeddings, or serve it with --runner generate to generate text.")
