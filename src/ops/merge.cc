// merge_attention (attention.h): partial attention results over disjoint key sets, merged by
// their log-sum-exps. The row loop is written out here (nothing to fuse with: one pass over
// two rows); double per element so the merge adds at most the output's own rounding.
#include <algorithm>
#include <cmath>
#include <limits>

#include "mha/attention.h"
#include "ops/attention_checks.h"
#include "util/check.h"
#include "util/parallel.h"

namespace mha {

void merge_attention(const View<float>& out, const View<float>& lse, const View<const float>& part_out,
                     const View<const float>& part_lse, int num_threads) {
  check_num_threads(num_threads, "merge_attention: ");
  MHA_CHECK(out.rank == 4, "merge_attention: out must be 4-D (B, H, T, Dv); got {}", shape_string(out));
  MHA_CHECK(part_out.rank == 4 && std::equal(out.shape.begin(), out.shape.begin() + 4, part_out.shape.begin()),
            "merge_attention: part_out must have out's shape {}; got {}", shape_string(out), shape_string(part_out));
  for (const auto& [l, name] : {std::pair{View<const float>(lse), "lse"}, std::pair{part_lse, "part_lse"}}) {
    MHA_CHECK(l.rank == 3 && std::equal(out.shape.begin(), out.shape.begin() + 3, l.shape.begin()),
              "merge_attention: {} must be (B, H, T) = {} to match out {}; got {}", name,
              shape_string(out.shape.data(), 3), shape_string(out), shape_string(l));
  }
  const View<const float> acc[] = {out, lse}, part[] = {part_out, part_lse};
  const char* acc_names[] = {"out", "lse"};
  const char* part_names[] = {"part_out", "part_lse"};
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) {
      MHA_CHECK(!ops::views_overlap(acc[a], acc_names[a], part[b], part_names[b]),
                "merge_attention: {} overlaps {}", acc_names[a], part_names[b]);
    }
  }
  MHA_CHECK(!ops::views_overlap(out, "out", lse, "lse"), "merge_attention: out overlaps lse");
  const int64_t B = out.shape[0], H = out.shape[1], T = out.shape[2], Dv = out.shape[3];
  if (B == 0 || H == 0 || T == 0) return;
  MHA_CHECK(lse.data != nullptr && part_lse.data != nullptr, "merge_attention: lse {} or part_lse {} has a null data pointer",
            shape_string(lse), shape_string(part_lse));
  MHA_CHECK(Dv == 0 || (out.data != nullptr && part_out.data != nullptr),
            "merge_attention: out {} or part_out {} has a null data pointer", shape_string(out), shape_string(part_out));
  constexpr float kInf = std::numeric_limits<float>::infinity();
  parallel_for(B * H, num_threads, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t t = 0; t < T; ++t) {
      float& la = lse.data[b * lse.stride[0] + h * lse.stride[1] + t * lse.stride[2]];
      const float lp = part_lse.data[b * part_lse.stride[0] + h * part_lse.stride[1] + t * part_lse.stride[2]];
      float* o = out.data + b * out.stride[0] + h * out.stride[1] + t * out.stride[2];
      const float* po = part_out.data + b * part_out.stride[0] + h * part_out.stride[1] + t * part_out.stride[2];
      const int64_t oe = out.stride[3], pe = part_out.stride[3];
      if (std::isnan(la) || std::isnan(lp) || la == kInf || lp == kInf) {
        for (int64_t c = 0; c < Dv; ++c) o[c * oe] = std::numeric_limits<float>::quiet_NaN();
        la = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const double m = std::max(la, lp);
      if (m == -kInf) {  // neither part saw a key
        for (int64_t c = 0; c < Dv; ++c) o[c * oe] = 0.0f;
        continue;
      }
      const double wa = std::exp(la - m), wp = std::exp(lp - m), sum = wa + wp;
      for (int64_t c = 0; c < Dv; ++c) {
        double x = 0;
        if (wa > 0) x += o[c * oe] * wa;
        if (wp > 0) x += po[c * pe] * wp;
        o[c * oe] = static_cast<float>(x / sum);
      }
      la = static_cast<float>(m + std::log(sum));
    }
  });
}

}  // namespace mha
