// A decode-only step's decoder layers in one call: the same kernels, in the same order and on the same tensors as
// the Python layer loop (`worker.model.llama.DecoderLayer` with fused ops, W8A8 or int8 linears and the C++ paged
// attention), so outputs are bit-identical; what goes is ~25 Python-dispatched calls a layer, during which the
// other OpenMP threads only spin. It runs without the GIL (bindings.cpp).
#include "kernels.h"
#include "bf16.h"
#include "vec_exp.h"
#include "kv_int8.h"
#include <ATen/core/dispatch/Dispatcher.h>
namespace stack {

// How one linear runs at this step's row count (`worker.model.decode_stack.linear_kind`), and the tensors it takes
enum Kind : int64_t {
  kVnni = 0,       // w8a8_small_linear: inv_smooth, packed, colsum, col_scale
  kAvx2 = 1,       // w8a8_avx2_linear: inv_smooth, packed, col_scale
  kWeightOnly = 2, // torch._weight_int8pack_mm on activations of the scales' dtype: qweight, scales
  kIntMm = 3,      // w8a8_quantize, torch._int_mm, w8a8_dequantize: inv_smooth, wt, col_scale
  kA16 = 4,        // w8a16_avx2_linear (int8 weight-only on int16 rows): packed, col_scale
  kA16Vnni = 5,    // w8a16_small_linear (the same on VNNI): packed, colsum, col_scale
  kPacked = 6,     // mkldnn::_linear_pointwise over a oneDNN-packed bf16 weight (worker.quant.packed): packed
};

static int64_t arity(int64_t kind) {
  switch (kind) {
    case kVnni: return 4;
    case kAvx2: return 3;
    case kWeightOnly: return 2;
    case kIntMm: return 3;
    case kA16: return 2;
    case kA16Vnni: return 3;
    case kPacked: return 1;
    default: TORCH_CHECK(false, "decode_stack: unknown linear kind ", kind);
  }
}

// x [rows, in] @ packed.T through the op `PackedLinear` calls (rows up to its EXACT_ROWS: no padding), boxed: its
// schema's C++ types are the dispatcher's business
static torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> st{x, packed, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                       std::string("")};
  op.callBoxed(&st);
  return st[0].toTensor();
}

// x [rows, in] contiguous -> [rows, out] of x's dtype; `t` points at the linear's tensors
static torch::Tensor linear(const torch::Tensor& x, int64_t kind, const torch::Tensor* t) {
  switch (kind) {
    case kPacked: return packed_linear(x, t[0]);
    case kVnni: return w8a8_small_linear(x, t[0], t[1], t[2], t[3]);
    case kAvx2: return w8a8_avx2_linear(x, t[0], t[1], t[2]);
    case kWeightOnly: return at::_weight_int8pack_mm(x.to(t[1].scalar_type()), t[0], t[1]).to(x.scalar_type());
    case kA16: return w8a16_avx2_linear(x, t[0], t[1]);
    case kA16Vnni: return w8a16_small_linear(x, t[0], t[1], t[2]);
    default: {
      auto [xq, row_scale] = w8a8_quantize(x, t[0]);
      return w8a8_dequantize(at::_int_mm(xq, t[1]), row_scale, t[2], x);
    }
  }
}

}  // namespace stack

// x [B, hidden] (the embeddings; updated in place and returned): every decoder layer of a decode-only step.
// `weights` per layer: input norm, post-attention norm, then qkv, o, gate_up and down (each its kind's tensors,
// `kinds` four per layer), then the layer's caches kc, vc (and k_scale, v_scale when `int8_kv`).
// positions, slot_mapping [B] int64; tables [B, max_pages], lens [B] int64; cos/sin [max_pos, hd / 2] fp32.
torch::Tensor decode_stack(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> kinds,
                           torch::Tensor positions, torch::Tensor cos_t, torch::Tensor sin_t,
                           torch::Tensor slot_mapping, torch::Tensor tables, torch::Tensor lens, int64_t nh,
                           int64_t kvh, int64_t bs, double scale, double eps, bool int8_kv, double grow) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && kinds.size() % 4 == 0, "decode_stack: x [B, hidden], 4 kinds a layer");
  const int64_t layers = static_cast<int64_t>(kinds.size()) / 4, B = x.size(0), kv_tensors = int8_kv ? 4 : 2;
  size_t total = layers * (2 + kv_tensors);  // checked before any layer runs: a malformed call writes nothing
  for (int64_t kind : kinds) total += stack::arity(kind);
  TORCH_CHECK(total == weights.size(), "decode_stack: ", weights.size(), " tensors where the kinds need ", total);
  const auto none = torch::empty({0}, x.options());
  const torch::Tensor* w = weights.data();  // the layer's norms, then its linears' tensors, then its caches
  for (int64_t l = 0; l < layers; ++l, w += kv_tensors) {
    const int64_t* k4 = kinds.data() + 4 * l;
    const torch::Tensor* lin[4];
    const torch::Tensor* norms = w;
    w += 2;
    for (int j = 0; j < 4; ++j) { lin[j] = w; w += stack::arity(k4[j]); }
    const torch::Tensor* kv = w;

    auto h = add_rms_norm(x, none, norms[0], eps);
    auto qkv = stack::linear(h, k4[0], lin[0]);
    const int64_t hd = qkv.size(1) / (nh + 2 * kvh);
    qkv = qkv.view({B, nh + 2 * kvh, hd});
    rope_(qkv, positions, cos_t, sin_t, nh + kvh);
    auto q = qkv.narrow(1, 0, nh), k = qkv.narrow(1, nh, kvh), v = qkv.narrow(1, nh + kvh, kvh);
    torch::Tensor attn;
    if (int8_kv) {
      paged_kv_write_int8(k, v, kv[0], kv[1], kv[2], kv[3], slot_mapping, bs, grow);
      attn = paged_decode_int8(q, kv[0], kv[1], kv[2], kv[3], tables, lens, bs, scale);
    } else {
      paged_kv_write(k, v, kv[0], kv[1], slot_mapping);
      attn = paged_decode(q, kv[0], kv[1], tables, lens, bs, scale);
    }
    h = add_rms_norm(x, stack::linear(attn.view({B, nh * hd}), k4[1], lin[1]), norms[1], eps);
    x.add_(stack::linear(silu_mul(stack::linear(h, k4[2], lin[2])), k4[3], lin[3]));
  }
  return x;
}
