// Compilation unit: the Python module. Each kernel is wrapped with torch's error handling (a failed TORCH_CHECK is
// a RuntimeError with its message); decode_stack also runs without the GIL, so the server's I/O thread can run.
// torch/csrc/Exceptions.h brings the wrappers and the tensor casters: 24 s to compile on AMD Zen 3, where
// torch/extension.h took 42 s.
#include <torch/csrc/Exceptions.h>
#include "kernels.h"

#define SY_BIND(f) m.def(#f, torch::wrap_pybind_function(f), #f)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  SY_BIND(paged_decode);
  SY_BIND(paged_kv_write);
  SY_BIND(paged_prefill);
  SY_BIND(paged_decode_int8);
  SY_BIND(paged_kv_write_int8);
  SY_BIND(paged_prefill_int8);
  SY_BIND(race_sample);
  SY_BIND(add_rms_norm);
  SY_BIND(silu_mul);
  SY_BIND(rope_);
  SY_BIND(w8a8_quantize);
  SY_BIND(w8a8_dequantize);
  SY_BIND(w8a8_silu_mul_quantize);
  SY_BIND(w8a8_small_available);
  SY_BIND(w8a8_small_pack);
  SY_BIND(w8a8_small_linear);
  SY_BIND(w8a16_small_linear);
  SY_BIND(w8a8_avx2_available);
  SY_BIND(w8a8_avx2_pack);
  SY_BIND(w8a8_avx2_linear);
  SY_BIND(w8a8_avx2_wide_rows);
  SY_BIND(w8a16_avx2_linear);
  SY_BIND(w8a16_avx2_bound);
  m.def("decode_stack", torch::wrap_pybind_function_no_gil(decode_stack), "decode_stack");
}
