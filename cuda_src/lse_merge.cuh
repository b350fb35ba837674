// Merging attention results over disjoint sets of keys by their log-sum-exp. Results O_s with
// log-sum-exps lse_s (each over its own keys) make the result over all of the keys:
//   m = max_s lse_s,   w_s = exp(lse_s - m),   lse = m + log sum_s w_s,   O = sum_s w_s O_s / sum_s w_s
// (the largest term weighs 1, so nothing overflows and the sum is >= 1 where any result saw a
// key). The decode kernel merges its warps' and its splits' partial results so, in log2 units
// (flash_decode.cu, split_merge.cuh); cuflash2.merge_states merges what attention calls
// returned, in natural logs (merge_states.cu).
#pragma once
#include "mma_primitives.cuh"

// The weight w_s = 2^((lse - m) * to_log2) of a result whose log-sum-exp is `lse` in a merge
// whose largest is `m`: `to_log2` 1 for log2 units, log2(e) for natural logs (the difference
// is scaled, not each lse: exact where lse and m are close, as the weights that count are).
// 0 for a result that saw no key (lse = -inf), and where none did (m = -inf: no -inf - -inf).
CF2_DEVICE float merge_weight(float lse, float m, float to_log2 = 1.f) {
    return (m == neg_inf() || lse == neg_inf()) ? 0.f : fast_exp2((lse - m) * to_log2);
}
