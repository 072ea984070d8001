// PyTorch binding of the AdaLN kernels: checks the tensors, allocates outputs and scratch through
// the caching allocator and launches on the current stream. `adaln` is the op with its autograd
// node in C++ (eager calls); `fwd` and `bwd` are the two halves that the torch.library custom ops
// of ops/_adaln.py call under torch.compile.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

#include "adaln.h"

namespace {

AdalnDtype to_adaln(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return ADALN_F32;
    case at::kBFloat16: return ADALN_BF16;
    case at::kHalf: return ADALN_F16;
    default: TORCH_CHECK(false, "adaln: `", name, "` has dtype ", t, "; expected float32, bfloat16 or float16");
  }
}

void check_3d(const at::Tensor& t, const char* name, int64_t B, int64_t D, const at::Tensor& x) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device(), "adaln: `", name, "` must be on ", x.device());
  TORCH_CHECK(t.dim() == 3 && t.size(0) == B && t.size(2) == D, "adaln: `", name, "` must be [", B, ", 1 or N, ",
              D, "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 || D == 1, "adaln: `", name, "` needs a contiguous last dimension");
}

int64_t row_stride(const at::Tensor& t) { return t.size(1) == 1 ? 0 : t.stride(1); }

const float* opt_ptr(const std::optional<at::Tensor>& t, const char* name, int64_t D) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == D && t->is_contiguous(),
              "adaln: `", name, "` must be a contiguous float32 [", D, "] tensor");
  return t->data_ptr<float>();
}

// The launch options as the Python side passes them: (pdl, cluster, fwd_features, bwd_features).
AdalnLaunchOptions to_options(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 4, "adaln: launch options must be (pdl, cluster, fwd_features, bwd_features), got ",
              v.size(), " values");
  AdalnLaunchOptions o;
  o.pdl = static_cast<int>(v[0]);
  o.cluster = static_cast<int>(v[1]);
  o.fwd_features = static_cast<int>(v[2]);
  o.bwd_features = static_cast<int>(v[3]);
  return o;
}

// Rows wider than ADALN_MAX_D_ANY run only on the vector paths: 16-byte-aligned start and row strides.
bool wide_rows(const at::Tensor& t) {
  const int64_t vec = 16 / static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % vec == 0 && t.stride(1) % vec == 0;
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "adaln: ", what, " failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> adaln_fwd_cuda(const at::Tensor& x, const at::Tensor& scale,
                                                              const at::Tensor& shift,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps,
                                                              at::ScalarType out_dtype,
                                                              const std::vector<int64_t>& launch) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1, "adaln: `x` must be a CUDA [B, N, D] tensor with a contiguous last dimension");
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  check_3d(scale, "scale", B, D, x);
  check_3d(shift, "shift", B, D, x);
  TORCH_CHECK(scale.scalar_type() == shift.scalar_type(), "adaln: `scale` and `shift` must share a dtype");
  TORCH_CHECK(weight.has_value() == bias.has_value(), "adaln: pass both `weight` and `bias` or neither");
  TORCH_CHECK(D <= ADALN_MAX_D_ANY || (wide_rows(x) && wide_rows(scale) && wide_rows(shift)), "adaln: D=", D,
              " > ", ADALN_MAX_D_ANY, " needs 16-byte-aligned rows of x, scale and shift");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({B, N, D}, x.options().dtype(out_dtype));
  auto mean = at::empty({B * N}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({B * N}, x.options().dtype(at::kFloat));
  AdalnFwdParams p{};
  p.x = x.data_ptr();
  p.x_sb = x.stride(0);
  p.x_sn = x.stride(1);
  p.scale = scale.data_ptr();
  p.scale_sb = scale.stride(0);
  p.scale_sn = row_stride(scale);
  p.shift = shift.data_ptr();
  p.shift_sb = shift.stride(0);
  p.shift_sn = row_stride(shift);
  p.weight = opt_ptr(weight, "weight", D);
  p.bias = opt_ptr(bias, "bias", D);
  p.y = y.data_ptr();
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.B = B;
  p.N = N;
  p.D = D;
  p.eps = static_cast<float>(eps);
  p.x_dtype = to_adaln(x.scalar_type(), "x");
  p.mod_dtype = to_adaln(scale.scalar_type(), "scale");
  p.out_dtype = to_adaln(out_dtype, "out_dtype");
  p.launch = to_options(launch);
  TORCH_CHECK(adaln_supported(p.x_dtype, p.mod_dtype, p.out_dtype, D), "adaln: no fused kernel for x ",
              x.scalar_type(), ", scale ", scale.scalar_type(), ", output ", out_dtype, ", D=", D);
  check(adaln_fwd(p, c10::cuda::getCurrentCUDAStream()), "forward launch");
  return {y, mean, rstd};
}

// Returns dx, dscale (shaped like scale), dshift ([B, 1, D] per sample; empty per token: it is dy),
// dweight and dbias (fp32 [D]; empty without an affine).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> adaln_bwd_cuda(
    const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    const std::vector<int64_t>& launch) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1, "adaln: `x` must be a CUDA [B, N, D] tensor with a contiguous last dimension");
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  check_3d(scale, "scale", B, D, x);
  TORCH_CHECK(dy_in.sizes() == x.sizes(), "adaln: the output gradient must be ", x.sizes(), ", got ", dy_in.sizes());
  // Autograd may hand in an expanded gradient (stride 0 everywhere, e.g. from y.sum()); the kernel
  // takes any leading strides but needs a contiguous last dimension.
  // Rows wider than ADALN_MAX_D_ANY also need 16-byte-aligned rows (a fresh contiguous copy has them).
  const bool keep = dy_in.stride(2) == 1 && (D <= ADALN_MAX_D_ANY || wide_rows(dy_in));
  const at::Tensor dy = keep ? dy_in : dy_in.contiguous();
  TORCH_CHECK(D <= ADALN_MAX_D_ANY || (wide_rows(x) && wide_rows(scale)), "adaln: D=", D, " > ", ADALN_MAX_D_ANY,
              " needs 16-byte-aligned rows of x and scale");
  TORCH_CHECK(mean.is_contiguous() && rstd.is_contiguous() && mean.numel() == B * N && rstd.numel() == B * N,
              "adaln: `mean`/`rstd` must be contiguous [B * N]");
  const bool per_token = scale.size(1) != 1;
  const c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty({B, N, D}, x.options());
  auto dscale = at::empty({B, per_token ? N : 1, D}, scale.options());
  auto dshift = per_token ? at::empty({0}, scale.options()) : at::empty({B, 1, D}, scale.options());
  const bool affine = weight.has_value();
  auto dweight = at::empty({affine ? D : 0}, x.options().dtype(at::kFloat));
  auto dbias = at::empty({affine ? D : 0}, x.options().dtype(at::kFloat));
  AdalnBwdParams p{};
  p.dy = dy.data_ptr();
  p.dy_sb = dy.stride(0);
  p.dy_sn = dy.stride(1);
  p.x = x.data_ptr();
  p.x_sb = x.stride(0);
  p.x_sn = x.stride(1);
  p.scale = scale.data_ptr();
  p.scale_sb = scale.stride(0);
  p.scale_sn = row_stride(scale);
  p.weight = opt_ptr(weight, "weight", D);
  p.bias = opt_ptr(bias, "bias", D);
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dscale = dscale.data_ptr();
  p.dshift = per_token ? nullptr : dshift.data_ptr();
  p.dweight = affine ? dweight.data_ptr<float>() : nullptr;
  p.dbias = affine ? dbias.data_ptr<float>() : nullptr;
  p.B = B;
  p.N = N;
  p.D = D;
  p.per_token = per_token;
  p.x_dtype = to_adaln(x.scalar_type(), "x");
  p.mod_dtype = to_adaln(scale.scalar_type(), "scale");
  p.out_dtype = to_adaln(dy.scalar_type(), "grad_output");
  p.launch = to_options(launch);
  TORCH_CHECK(adaln_supported(p.x_dtype, p.mod_dtype, p.out_dtype, D), "adaln: no fused backward for x ",
              x.scalar_type(), ", scale ", scale.scalar_type(), ", grad ", dy.scalar_type(), ", D=", D);
  const size_t bytes = adaln_bwd_workspace_bytes(p);
  // The caching allocator returns blocks aligned far beyond the 16 bytes the kernels need.
  auto workspace = at::empty({static_cast<int64_t>((bytes + 3) / 4)}, x.options().dtype(at::kFloat));
  p.workspace = workspace.data_ptr<float>();
  check(adaln_bwd(p, c10::cuda::getCurrentCUDAStream()), "backward launch");
  return {dx, dscale, dshift, dweight, dbias};
}

// The eager op: a C++ autograd function, so that the backward runs on the autograd engine's device
// thread as it does for built-in ops, without taking the GIL or entering Python (a Python
// torch.autograd.Function's backward does both, every call). weight/bias are optionals: autograd
// registers them as inputs only when present.
class AdalnFunction : public torch::autograd::Function<AdalnFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& scale,
                            const at::Tensor& shift, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps, at::ScalarType out_dtype,
                            const std::vector<int64_t>& launch) {
    auto [y, mean, rstd] = adaln_fwd_cuda(x, scale, shift, weight, bias, eps, out_dtype, launch);
    // Only defined tensors are saved: [x, scale, mean, rstd] or, with an affine, [..., weight, bias].
    std::vector<at::Tensor> saved = {x, scale, mean, rstd};
    if (weight.has_value()) {
      saved.push_back(*weight);
      saved.push_back(*bias);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["launch"] = launch;
    ctx->saved_data["shift_dtype"] = static_cast<int64_t>(shift.scalar_type());
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The kernels' gradients carry no graph of their own: refuse rather than return a wrong one.
    TORCH_CHECK(!at::GradMode::is_enabled(), "adaln: the fused op has no double backward (create_graph=True)");
    const auto saved = ctx->get_saved_variables();
    const bool affine = saved.size() == 6;
    const std::optional<at::Tensor> weight = affine ? std::optional<at::Tensor>(saved[4]) : std::nullopt;
    const std::optional<at::Tensor> bias = affine ? std::optional<at::Tensor>(saved[5]) : std::nullopt;
    const at::Tensor& scale = saved[1];
    const at::Tensor& dy = grads[0];
    auto [dx, dscale, dshift, dweight, dbias] =
        adaln_bwd_cuda(dy, saved[0], scale, weight, bias, saved[2], saved[3], ctx->saved_data["launch"].toIntVector());
    if (scale.size(1) != 1) {  // per token, d(shift) is the output gradient itself
      dshift = dy.to(static_cast<at::ScalarType>(ctx->saved_data["shift_dtype"].toInt()));
    }
    return {dx, dscale, dshift, affine ? dweight : at::Tensor(), affine ? dbias : at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor adaln_autograd(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                          at::ScalarType out_dtype, const std::vector<int64_t>& launch) {
  return AdalnFunction::apply(x, scale, shift, weight, bias, eps, out_dtype, launch);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adaln", &adaln_autograd, "AdaLN with its autograd node: y");
  m.def("fwd", &adaln_fwd_cuda, "AdaLN forward: (y, mean, rstd)");
  m.def("bwd", &adaln_bwd_cuda, "AdaLN backward: (dx, dscale, dshift, dweight, dbias)");
  m.attr("max_d") = ADALN_MAX_D;
  m.attr("max_d_any") = ADALN_MAX_D_ANY;
}
