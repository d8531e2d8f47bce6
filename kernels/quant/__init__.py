"""Weight-only quantized GEMMs for Hugging Face checkpoints (AWQ, GPTQ, fp8): the weights stay
packed in memory and are dequantized where they are multiplied.

    int4.py               Int4Weight: AWQ and GPTQ in one layout (4-bit codes packed along
                          the input dimension, a scale and a zero per group), its torch
                          reference and the GEMM dispatch
    triton_int4_gemm.py   the CUDA kernel: dequantize a tile in registers, then tl.dot
    fp8.py                Fp8Weight: e4m3 bytes and a scale per output row
    triton_fp8_gemm.py    its CUDA kernel
    triton_tiles.py       the tile steps and host checks both kernels share

On CPU, int4 (fp16 scales, groups a multiple of 32; act-order with its inputs sorted by group)
is repacked at load into GGUF's Q4_1 blocks and runs on kernels/cpu_gguf.py's vector GEMM
(int4.as_q4_1); fp8 dequantizes the whole weight on each call and runs F.linear (correct,
memory as packed, slower than the plain weight). The Triton kernels are tested on CPU under the interpreter.
"""

from pagedserve.kernels.quant.fp8 import Fp8Weight
from pagedserve.kernels.quant.int4 import Int4Weight, PermutedInputs

# The packed weight types a linear layer may hold (kernels/cpu_linear.py dispatches on them).
QUANT_WEIGHTS = (Int4Weight, Fp8Weight, PermutedInputs)

__all__ = ["Fp8Weight", "Int4Weight", "PermutedInputs", "QUANT_WEIGHTS"]
