"""GGUF helpers of the tests: the writer itself is loadtest/gguf_writer.py's (the GPU check
writes its checkpoint with it too); here transformers' GGUF load with the file parsed once,
a written-once cache of a checkpoint's GGUF, and a bare file of another architecture for the
refusal test."""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from pagedserve.loadtest.gguf_writer import quantize, quantize_k, write_gguf_from_hf  # noqa: F401  (the tests' imports)


@contextlib.contextmanager
def parse_gguf_once():
    """transformers' own GGUF load, as it is, but with the file parsed once: it builds a
    ``gguf.GGUFReader`` for the config, another for the tokenizer and a third for the
    weights (each reads every vocab and merges string, seconds apiece on a 49k-token
    vocab), and ggml's tensor-name table once per tensor. Both are pure functions of their
    arguments, so memoizing them changes nothing transformers computes, only how often."""
    import gguf
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


def gguf_once(hf_dir: str, root, name: str, qtype: str) -> str:
    """``hf_dir`` as ``root/name-qtype/name.qtype.gguf``, written the first time only."""
    out = os.path.join(os.fspath(root), f"{name}-{qtype}", f"{name}.{qtype}.gguf")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        write_gguf_from_hf(hf_dir, out + ".tmp", qtype)
        os.replace(out + ".tmp", out)
    return out


def write_foreign_gguf(out: str, arch: str = "gpt2") -> str:
    """A small, valid GGUF of another architecture (one tensor), for the refusal test."""
    import gguf

    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
