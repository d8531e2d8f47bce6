// What every extension takes of torch: at::Tensor (as torch::Tensor), pybind11 with torch's
// Tensor caster; each source adds what else it uses (ATen/Parallel.h). load_inline puts
// torch/extension.h first unless told not to (kernels/cpu_build.py tells it not to): all of
// libtorch's C++ API (torch::nn, autograd, serialization), whose parsing was most of every build.
#ifndef PAGEDSERVE_CPU_PRELUDE_H
#define PAGEDSERVE_CPU_PRELUDE_H

// GCC 12.1 and 12.2's AVX-512 intrinsics warn "'__Y' may be used uninitialized" wherever they
// are inlined (their _mm512_undefined_ps; GCC bug 105593, fixed in 12.3): ignored for the
// system headers' own lines, here, where immintrin.h is first included (torch's headers
// include it too), not for this project's code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
namespace torch { using at::Tensor; }

#endif  // PAGEDSERVE_CPU_PRELUDE_H
