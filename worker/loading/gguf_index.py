"""A GGUF file's table of contents, read with the standard library alone: the scalar metadata
and, for every tensor, its name, GGML type, shape and where its bytes are.

    header    magic "GGUF", version, tensor count, metadata count
    metadata  key, value type, value   (strings and arrays: lengths first)
    tensors   name, dims (innermost first), GGML type id, offset into the data section
    data      at the next multiple of general.alignment (32 by default)

The ``gguf`` package's reader builds a numpy view of every metadata value, a second or more
for a 49k-token vocabulary's strings and merges; this walks past arrays by their lengths, so
a start that only needs the tensors (the native GGUF load, the type check) does not pay for
the vocabulary. Pure stdlib.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

# GGML type id -> (name, weights a block, bytes a block): the gguf package's GGML_QUANT_SIZES
# for the types a Llama-family file holds, written out so this module needs no numpy.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}

# metadata value type -> struct format (8: string, 9: array are read by hand)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: str  # GGML type name: "Q4_1", "F32", ... ("type 99" for one this table lacks)
    shape: tuple[int, ...]  # row-major (outermost first): [rows, columns] for a weight
    offset: int  # of its first byte in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    path: str
    metadata: dict  # key -> scalar or string value (arrays: their length, as ("array", n))
    tensors: dict[str, TensorInfo]  # in file order


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.take("<I"), self.take("<Q")
            if etype in _SCALARS:
                self.at += n * struct.calcsize(_SCALARS[etype])
            else:
                for _ in range(n):
                    self.value(etype)
            return ("array", n)
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf_index(path: str | os.PathLike) -> GGUFIndex:
    """The file's metadata scalars and tensor table (see the module doc); ValueError for a file
    that is not GGUF or ends early."""
    import mmap

    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raise ValueError(f"{path!r} is not a GGUF file: it is empty.") from None
    try:
        c = _Cursor(buf)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError(f"{path!r} is not a GGUF file: it does not start with the GGUF magic bytes.")
            c.at = 4
            version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
            if version < 2:
                raise ValueError(f"{path!r} is GGUF version {version}; versions 2 and 3 are read.")
            metadata = {}
            for _ in range(n_kv):
                key = c.string()
                metadata[key] = c.value(c.take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.take("<Q") for _ in range(c.take("<I"))]
                infos.append((name, dims, c.take("<I"), c.take("<Q")))
        except struct.error:
            raise ValueError(f"{path!r} is truncated: its header ends early ({len(buf):,} bytes).") from None
        align = int(metadata.get("general.alignment", 32))
        data_start = -(-c.at // align) * align
        tensors = {}
        for name, dims, type_id, offset in infos:
            tname, block, block_bytes = GGML_TYPES.get(type_id, (f"type {type_id}", 1, 0))
            n = 1
            for d in dims:
                n *= d
            nbytes = n // block * block_bytes
            start = data_start + offset
            if block_bytes and start + nbytes > len(buf):
                raise ValueError(f"{path!r} is truncated: tensor {name!r} ends at byte {start + nbytes:,} "
                                 f"of {len(buf):,}.")
            tensors[name] = TensorInfo(name, tname, tuple(reversed(dims)), start, nbytes)
        return GGUFIndex(path, metadata, tensors)
    finally:
        buf.close()
