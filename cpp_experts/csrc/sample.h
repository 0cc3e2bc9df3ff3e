// The sampler's draw for rows that sample (executor/sampler.py is the definition and the reference):
// temperature, top_k, top_p, min_p, then Gumbel-max with counter-based noise, for one engine step's
// rows at once. Native because torch spent ~0.5 ms a row on the default model's 49152 columns (a
// topk, two exps over the row, mt19937 draws for every column, ~60 small ops): longer than a tenth of
// the decode step it follows.
#pragma once
#include <cstdint>
#include <vector>

namespace cpx {

// One row to draw for.
struct SampleSpec {
  int64_t row;        // its row of the logits
  float temperature;  // > 0: the logits are divided by it (in fp32, as torch divides)
  int64_t top_k;      // 1 <= top_k < vocab keeps the tokens reaching the k-th best; any other value keeps all
  float top_p;        // < 1: the smallest best-first set whose probability reaches it
  float log_min_p;    // log(min_p), -inf for none: drops tokens whose logit is below the best's + it
  uint64_t key;       // the noise's key: executor.sampler.noise_seed(seed, step)
};

// The uniform in (0, 1) of the sampler's noise at column `id` of the row keyed by `key`:
// (2 * (h >> 12) + 1) * 2^-53, where h is SplitMix64's finalizer of key + (id + 1) * 0x9E3779B97F4A7C15.
// A column's noise depends on (key, id) alone: a row with few candidates draws for those alone.
double noise_uniform(uint64_t key, int64_t id);

// out[r * width + j] = noise_uniform(keys[r], ids ? ids[r * width + j] : j).
void noise_uniforms(const uint64_t* keys, int64_t rows, const int64_t* ids, int64_t width, double* out);

// For each spec, the token Gumbel-max picks among the tokens its filters keep, x being fp32 logits with
// rows `stride` floats apart and `vocab` columns: the best of logit / temperature (fp32, widened) +
// -log(-log(u)) (double), ties to the smallest id. Where the sorted order matters (top_p), equal logits
// are in id order. out[i] = -1 leaves spec i to the caller: a NaN logit, none finite, or one infinite
// after the division.
void sample_rows(const float* x, int64_t stride, int64_t vocab, const std::vector<SampleSpec>& specs, int64_t* out);

// log_softmax of rows `rows` of x (fp32, rows `stride` floats apart, `vocab` columns) at `targets` (one
// token a row) into logprob[i], with each row's k best tokens, best first (equal logits in id order),
// into top_ids / top_values[i * k + j] for j < top_count[i] (the finite ones among them). ok[i] = 0 leaves
// row i to the caller: a NaN among its logits, or none finite.
void row_logprobs(const float* x, int64_t stride, int64_t vocab, const std::vector<int64_t>& rows,
                  const std::vector<int64_t>& targets, int k, float* logprob, int64_t* top_ids, float* top_values,
                  int32_t* top_count, uint8_t* ok);

}  // namespace cpx
