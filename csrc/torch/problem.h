// Turns the op arguments (tensors) into the framework-free problem structs of csrc/fsd/common.h,
// checking every shape, dtype, device and range on the way, and allocating the outputs. Shared by
// the CPU (ops.cpp) and CUDA (ops_cuda.cpp) implementations so both reject the same inputs with the
// same messages. The one place that checks the ops' arguments: fsd_ext/ops.py keeps only what the
// op cannot see (Python types, None for "off", the [V] / [B, V] / [..., V] reshapes). A message
// names the argument and what was expected; a wrong shape or value raises ValueError in Python
// (TORCH_CHECK_VALUE), a wrong dtype TypeError (TORCH_CHECK_TYPE).
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "fsd/common.h"
#include "fsd/rules.h"

namespace fsd_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

inline fsd::DType logits_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return fsd::DType::Float32;
    case at::kBFloat16: return fsd::DType::BFloat16;
    case at::kHalf: return fsd::DType::Float16;
    default: TORCH_CHECK_TYPE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return fsd::DType::Float32;
}

inline void check_same_device(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device(),
                    " like the logits");
}

inline void check_logits(const Tensor& t, int64_t ndim, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must have ", ndim, " dims, got shape ", t.sizes());
  logits_dtype(t, name);
  TORCH_CHECK_VALUE(t.size(-1) >= 1, name, " must have a vocabulary of at least 1, got shape ", t.sizes());
  // A size-1 or empty vocab dim may have any stride (torch calls such tensors contiguous).
  TORCH_CHECK_VALUE(t.stride(-1) == 1 || t.size(-1) == 1 || t.numel() == 0, name,
                    " must be contiguous along the vocabulary (last) dim");
  TORCH_CHECK_VALUE(t.size(-1) < (int64_t(1) << 31), name, " vocabulary must be < 2^31");
}

// A per-row float argument: its name, its range (the predicates of fsd/common.h) as error
// messages state it.
struct RowArg {
  const char* name;
  bool (*in_range)(double);
  const char* range;
};
inline const RowArg kThresholdArg{"threshold", fsd::threshold_in_range<double>, ">= 0"};
inline const RowArg kTemperatureArg{"temperature", fsd::temperature_in_range<double>,
                                    "finite (at most 3.403e+38, float32) and >= 0"};
inline const RowArg kDivTemperatureArg{"div_temperature", fsd::div_temperature_in_range<double>,
                                       "finite (at most 3.403e+38, float32) and > 0"};

// A float argument given either per row ([B] float32 tensor) or once for the call (checked here;
// the values of a tensor are checked by the CPU binding, and by the CUDA kernels row by row).
inline fsd::RowValue<float> row_value(const OptTensor& per_row, double scalar, int64_t batch,
                                      const Tensor& like, const RowArg& arg) {
  const char* name = arg.name;
  fsd::RowValue<float> value;
  if (per_row.has_value()) {
    const Tensor& t = *per_row;
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == batch, name, " must be a float or a [", batch,
                      "] tensor, got shape ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " tensor must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, " tensor must be contiguous");
    check_same_device(t, like, name);
    value.per_row = t.data_ptr<float>();
  } else {
    TORCH_CHECK_VALUE(arg.in_range(scalar), name, " must be ", arg.range, ", got ", scalar);
    value.scalar = (float)scalar;
  }
  return value;
}

inline fsd::RandomKey random_key(const OptTensor& seed_t, int64_t seed, bool seed_per_row,
                                 const OptTensor& offset_t, int64_t offset, int64_t batch,
                                 const Tensor& like) {
  fsd::RandomKey key;
  key.seed.scalar = seed;
  key.offset.scalar = offset;
  key.seed_per_row = seed_per_row;
  if (seed_t.has_value()) {
    const Tensor& t = *seed_t;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "seed tensor must be int64, got ", t.scalar_type());
    TORCH_CHECK_VALUE(seed_per_row ? t.dim() == 1 && t.size(0) == batch : t.numel() == 1,
                      "seed tensor must be int64 of shape [", batch, "] (per row) or [] (one for the call), got shape ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), "seed tensor must be contiguous");
    check_same_device(t, like, "seed");
    key.seed.per_row = t.data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(!seed_per_row, "seed_per_row needs a seed tensor");
  }
  if (offset_t.has_value()) {
    const Tensor& t = *offset_t;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "offset tensor must be int64, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.numel() == 1 && t.is_contiguous(),
                      "offset tensor must be a one-element int64 tensor, got shape ", t.sizes());
    check_same_device(t, like, "offset");
    key.offset.per_row = t.data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(offset >= 0, "offset must be >= 0, got ", offset);
  }
  return key;
}

inline fsd::SamplingFilter sampling_filter(int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be >= 1 (or 0 for off), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got ", top_p);
  TORCH_CHECK_VALUE(min_p >= 0.0 && min_p <= 1.0, "min_p must be in [0, 1], got ", min_p);
  fsd::SamplingFilter filter;
  filter.top_k = top_k;
  filter.top_p = (float)top_p;
  filter.min_p = (float)min_p;
  return filter;
}

// Outputs of accept: tokens [B, K+1] int64, num_accepted [B] int64, valid [B] bool, divergence
// [B, K] float32.
struct AcceptOutputs {
  Tensor tokens, num_accepted, valid, divergence;
};

// The accept op's arguments, in the order of its registered schema (ops.cpp), which stays flat for
// torch; everything past the binding's entry point (accept_op) sees this struct.
struct AcceptArgs {
  const Tensor& target_logits;
  const Tensor& draft_logits;
  const Tensor& draft_tokens;
  const OptTensor& num_draft;
  const OptTensor& threshold_t; double threshold;
  const OptTensor& temperature_t; double temperature;
  const OptTensor& div_temperature_t; double div_temperature;
  bool div_uses_sampling;
  const OptTensor& seed_t; int64_t seed; bool seed_per_row;
  const OptTensor& offset_t; int64_t offset;
  int64_t rule, divergence, top_k; double top_p, min_p; int64_t div_top_k;
  bool return_divergence;
};

using AcceptResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;  // tokens, num_accepted, valid, divergence

// The op's implementation for one backend: accept_op<accept_cpu> (ops.cpp) and
// accept_op<accept_cuda> (ops_cuda.cpp) are what they register, so the flat argument list is
// written out here alone.
template <AcceptResult (*Run)(const AcceptArgs&)>
AcceptResult accept_op(const Tensor& target_logits, const Tensor& draft_logits, const Tensor& draft_tokens,
                       const OptTensor& num_draft, const OptTensor& threshold_t, double threshold,
                       const OptTensor& temperature_t, double temperature, const OptTensor& div_temperature_t,
                       double div_temperature, bool div_uses_sampling, const OptTensor& seed_t, int64_t seed,
                       bool seed_per_row, const OptTensor& offset_t, int64_t offset, int64_t rule,
                       int64_t divergence, int64_t top_k, double top_p, double min_p, int64_t div_top_k,
                       bool return_divergence) {
  return Run(AcceptArgs{target_logits, draft_logits, draft_tokens, num_draft, threshold_t, threshold,
                        temperature_t, temperature, div_temperature_t, div_temperature, div_uses_sampling,
                        seed_t, seed, seed_per_row, offset_t, offset, rule, divergence, top_k, top_p, min_p,
                        div_top_k, return_divergence});
}

inline fsd::AcceptProblem make_accept_problem(const AcceptArgs& a, AcceptOutputs& out) {
  const Tensor& target = a.target_logits;
  const Tensor& draft = a.draft_logits;
  check_logits(target, 3, "target_logits");
  check_logits(draft, 3, "draft_logits");
  const int64_t batch = target.size(0), k = target.size(1) - 1;
  TORCH_CHECK_VALUE(k >= 0, "target_logits must hold K+1 >= 1 positions, got shape ", target.sizes());
  TORCH_CHECK_VALUE(draft.size(0) == batch && draft.size(1) == k, "draft_logits must be [B=", batch, ", K=", k,
                    ", V_d], got shape ", draft.sizes(), " (target_logits holds K+1 positions)");
  TORCH_CHECK_VALUE(draft.size(2) <= target.size(2), "draft_logits vocabulary V_d=", draft.size(2),
                    " must be <= target vocabulary V_t=", target.size(2));
  TORCH_CHECK_TYPE(draft.scalar_type() == target.scalar_type(), "draft_logits dtype ", draft.scalar_type(),
                   " must match target_logits dtype ", target.scalar_type());
  check_same_device(draft, target, "draft_logits");
  const Tensor& tokens = a.draft_tokens;
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong,
                   "draft_tokens must be int32 or int64, got ", tokens.scalar_type());
  TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.size(0) == batch && tokens.size(1) == k,
                    "draft_tokens must be [B=", batch, ", K=", k, "], got shape ", tokens.sizes());
  TORCH_CHECK_VALUE(tokens.is_contiguous(), "draft_tokens must be contiguous");
  check_same_device(tokens, target, "draft_tokens");
  TORCH_CHECK_VALUE(a.rule >= 0 && a.rule < fsd::kRuleCount, "rule id must be in [0, ", fsd::kRuleCount - 1, "], got ", a.rule);
  TORCH_CHECK_VALUE(a.divergence >= 0 && a.divergence < fsd::kDivergenceCount, "divergence id must be in [0, ",
                    fsd::kDivergenceCount - 1, "], got ", a.divergence);
  TORCH_CHECK_VALUE(a.div_top_k >= 0, "div_top_k must be >= 1 (or 0 for off), got ", a.div_top_k);
  const fsd::Criterion criterion = fsd::rule_traits((fsd::Rule)a.rule).criterion;
  TORCH_CHECK_VALUE(a.div_top_k == 0 || criterion == fsd::Criterion::None || criterion == fsd::Criterion::Divergence,
                    "div_top_k applies to the divergence rules (fsd, fsd_strict) only, got it with rule id ", a.rule);

  fsd::AcceptProblem p;
  p.batch = batch;
  p.max_draft = k;
  p.target_vocab = target.size(2);
  p.draft_vocab = draft.size(2);
  p.dtype = logits_dtype(target, "target_logits");
  p.target_logits = target.data_ptr();
  p.target_stride_b = target.stride(0);
  p.target_stride_k = target.stride(1);
  p.draft_logits = draft.data_ptr();
  p.draft_stride_b = draft.stride(0);
  p.draft_stride_k = draft.stride(1);
  p.draft_tokens = tokens.data_ptr();
  p.tokens_int32 = tokens.scalar_type() == at::kInt;
  if (a.num_draft.has_value()) {
    const Tensor& nd = *a.num_draft;
    TORCH_CHECK_TYPE(nd.scalar_type() == at::kLong, "num_draft must be an int64 tensor [B] (fsd_ext.accept also "
                     "takes int32), got ", nd.scalar_type());
    TORCH_CHECK_VALUE(nd.dim() == 1 && nd.size(0) == batch, "num_draft must be [B=", batch, "], got shape ",
                      nd.sizes());
    TORCH_CHECK_VALUE(nd.is_contiguous(), "num_draft must be contiguous");
    check_same_device(nd, target, "num_draft");
    p.num_draft = nd.data_ptr<int64_t>();
  }
  p.rule = (fsd::Rule)a.rule;
  p.divergence = fsd::statistic_divergence(p.rule, (fsd::Divergence)a.divergence);
  p.threshold = row_value(a.threshold_t, a.threshold, batch, target, kThresholdArg);
  p.temperature = row_value(a.temperature_t, a.temperature, batch, target, kTemperatureArg);
  p.div_uses_sampling = a.div_uses_sampling;
  p.div_temperature = row_value(a.div_temperature_t, a.div_temperature, batch, target, kDivTemperatureArg);
  p.div_top_k = a.div_top_k;
  p.filter = sampling_filter(a.top_k, a.top_p, a.min_p);
  p.key = random_key(a.seed_t, a.seed, a.seed_per_row, a.offset_t, a.offset, batch, target);

  const auto long_opts = target.options().dtype(at::kLong);
  out.tokens = at::empty({batch, k + 1}, long_opts);
  out.num_accepted = at::empty({batch}, long_opts);
  out.valid = at::empty({batch}, target.options().dtype(at::kBool));
  out.divergence = at::empty({batch, k}, target.options().dtype(at::kFloat));
  p.tokens = out.tokens.data_ptr<int64_t>();
  p.num_accepted = out.num_accepted.data_ptr<int64_t>();
  p.valid = out.valid.data_ptr<bool>();
  p.divergences = out.divergence.data_ptr<float>();
  p.need_divergence = a.return_divergence || fsd::rule_needs_divergence(p.rule);
  p.divergences_wanted = a.return_divergence;
  return p;
}

inline fsd::DivergenceProblem make_divergence_problem(const Tensor& target, const Tensor& draft,
                                                      int64_t kind, double temperature, int64_t top_k,
                                                      Tensor& out) {
  check_logits(target, 2, "target_logits");
  check_logits(draft, 2, "draft_logits");
  TORCH_CHECK_VALUE(target.size(0) == draft.size(0), "target_logits ", target.sizes(), " and draft_logits ",
                    draft.sizes(), " must agree on all but the last dim");
  TORCH_CHECK_VALUE(draft.size(1) <= target.size(1), "draft_logits vocabulary V_d=", draft.size(1),
                    " must be <= the target_logits vocabulary V_t=", target.size(1));
  TORCH_CHECK_TYPE(draft.scalar_type() == target.scalar_type(), "draft_logits dtype ", draft.scalar_type(),
                   " must match target_logits dtype ", target.scalar_type());
  check_same_device(draft, target, "draft_logits");
  TORCH_CHECK_VALUE(kind >= 0 && kind < fsd::kDivergenceCount, "kind id must be in [0, ", fsd::kDivergenceCount - 1, "], got ", kind);
  TORCH_CHECK_VALUE(fsd::div_temperature_in_range(temperature),
                    "temperature must be finite (at most 3.403e+38, float32) and > 0, got ", temperature);
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be >= 1 (or 0 for off), got ", top_k);
  fsd::DivergenceProblem p;
  p.rows = target.size(0);
  p.target_vocab = target.size(1);
  p.draft_vocab = draft.size(1);
  p.dtype = logits_dtype(target, "target_logits");
  p.target_logits = target.data_ptr();
  p.target_stride = target.stride(0);
  p.draft_logits = draft.data_ptr();
  p.draft_stride = draft.stride(0);
  p.divergence = (fsd::Divergence)kind;
  p.temperature = (float)temperature;
  p.top_k = top_k;
  out = at::empty({p.rows}, target.options().dtype(at::kFloat));
  p.out = out.data_ptr<float>();
  return p;
}

inline fsd::SampleProblem make_sample_problem(const Tensor& logits, const OptTensor& temperature_t,
                                              double temperature, int64_t top_k, double top_p,
                                              double min_p, const OptTensor& seed_t, int64_t seed,
                                              bool seed_per_row, const OptTensor& offset_t,
                                              int64_t offset, Tensor& out) {
  check_logits(logits, 3, "logits");
  fsd::SampleProblem p;
  p.batch = logits.size(0);
  p.positions = logits.size(1);
  p.vocab = logits.size(2);
  p.dtype = logits_dtype(logits, "logits");
  p.logits = logits.data_ptr();
  p.stride_b = logits.stride(0);
  p.stride_s = logits.stride(1);
  p.temperature = row_value(temperature_t, temperature, p.batch, logits, kTemperatureArg);
  p.filter = sampling_filter(top_k, top_p, min_p);
  p.key = random_key(seed_t, seed, seed_per_row, offset_t, offset, p.batch, logits);
  out = at::empty({p.batch, p.positions}, logits.options().dtype(at::kLong));
  p.tokens = out.data_ptr<int64_t>();
  return p;
}

inline void check_uniform_args(const Tensor& seed, const Tensor& offset, bool seed_per_row, int64_t rows,
                               int64_t positions, int64_t purpose) {
  TORCH_CHECK_VALUE(rows >= 0 && positions >= 0, "rows and positions must be >= 0, got ", rows, ", ", positions);
  TORCH_CHECK_VALUE(purpose >= 1 && purpose <= 3, "purpose id must be in [1, 3], got ", purpose);
  TORCH_CHECK_VALUE(positions <= (1 << 24), "positions must be <= 2^24, got ", positions);
  (void)seed; (void)offset; (void)seed_per_row;
}

}  // namespace fsd_torch
