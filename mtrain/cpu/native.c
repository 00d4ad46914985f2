/* Decoding kernels for a bfloat16 model on a CPU, built and called by mtrain.cpu.native (which
   says why they exist and what they were measured against).

   mtrain_cache_attention: attention of a few queries per (row, head) over a decoding cache.
   mtrain_topk_logsumexp: per row of bfloat16 logits, the k largest values with their columns and
   the log of the sum of the exponentials of all of them, in one pass.
   mtrain_keep_mask: a dropout mask from splitmix64 words, in one pass.
   mtrain_ce_sums, mtrain_ce_grad: the label-smoothed loss's row sums over bfloat16 logits, and its
   gradient written over them.
   mtrain_amx_linear: a bfloat16 linear layer (bias, optional ReLU) on the AMX tile units.

   Built without -ffast-math on purpose: that flag links code that sets flush-to-zero for the whole
   process at load time. exp16 below is the one vector exponential the kernels use. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline f32x16 splat(float x) { return (f32x16){0} + x; }

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* 16 bfloat16 values -> float32: widened and shifted into the high half (two instructions with
   AVX-512; the generic conversion compiles to six). */
static inline f32x16 load_bf16x16(const uint16_t *p) {
#ifdef __AVX512F__
  __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
  f32x16 f;
  memcpy(&f, &u, sizeof f);
  return f;
#else
  u16x16 h;
  memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* 16 float32 values -> bfloat16, rounded to nearest even as float_to_bf16 below rounds one. */
static inline void store_bf16x16(uint16_t *p, f32x16 f) {
  u32x16 u;
  memcpy(&u, &f, sizeof u);
  u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
#ifdef __AVX512F__
  __m512i w;
  memcpy(&w, &u, sizeof w);
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(w));
#else
  u16x16 h = __builtin_convertvector(u, u16x16);
  memcpy(p, &h, sizeof h);
#endif
}

static inline float bf16_to_float(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline f32x16 select16(i32x16 take_a, f32x16 a, f32x16 b) {
  i32x16 ia, ib, r;
  memcpy(&ia, &a, sizeof ia);
  memcpy(&ib, &b, sizeof ib);
  r = (take_a & ia) | (~take_a & ib);
  f32x16 f;
  memcpy(&f, &r, sizeof f);
  return f;
}

/* exp(x): x clamped to [ln 2^-126, 88.376] (so -inf gives about 1.2e-38, never a subnormal path),
   x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial, times 2^n through
   the exponent bits. Within 2 ulp of expf over the range. */
static inline f32x16 exp16(f32x16 x) {
  const f32x16 lo = splat(-87.33654f), hi = splat(88.37626f);
  x = select16(x < lo, lo, x);
  x = select16(x > hi, hi, x);
  f32x16 t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: round to an integer */
  f32x16 n = t - 12582912.0f;
  f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  i32x16 bits, pbits;
  memcpy(&bits, &t, sizeof bits);
  memcpy(&pbits, &p, sizeof pbits);
  pbits += (bits - 0x4B400000) << 23;
  memcpy(&p, &pbits, sizeof p);
  return p;
}

/* The sum of v's 16 lanes, lane 0 first, and their maximum. */
static inline float sum16(f32x16 v) {
  float total = 0.0f;
  for (int i = 0; i < 16; i++) total += v[i];
  return total;
}

static inline float max16(f32x16 v) {
  float best = -INFINITY;
  for (int i = 0; i < 16; i++) best = v[i] > best ? v[i] : best;
  return best;
}

/* Bit i set where v[i] > x: one compare into a mask register with AVX-512, else lane by lane. */
static inline uint32_t above16(f32x16 v, float x) {
#ifdef __AVX512F__
  __m512 a;
  memcpy(&a, &v, sizeof a);
  return (uint32_t)_mm512_cmp_ps_mask(a, _mm512_set1_ps(x), _CMP_GT_OQ);
#else
  uint32_t bits = 0;
  for (int i = 0; i < 16; i++) bits |= (uint32_t)(v[i] > x) << i;
  return bits;
#endif
}

/* ---- attention over a decoding cache ----------------------------------------------------------

   q    (B, H, G, D)  bfloat16 queries, any strides
   k    (B, H, N, D)  bfloat16 keys (last stride 1)
   v    (B, H, N, D)  bfloat16 values (last stride 1)
   mask (B, G or 1, N) uint8, 1 = may attend (last stride 1), or NULL: every key
   out  (B, H, G, D)  bfloat16 result, any strides; a query that may attend to no key gets zeros

   Per (row, head) and query, 16 keys at a time: each key's products with the query summed pairwise
   into a vector of 16 partial sums (one AVX-512 BF16 dot-product instruction per 32 dims: the
   products of two bfloat16 values are exact in float32, and they accumulate in float32), then the
   16 vectors reduced to the 16 keys' scores by one transposing sum (sum16x16). The keys are read in
   the cache's own layout, as many as there are: each step appends a key as one contiguous row.
   The softmax runs in float32 over the slots, masked ones weighted 0; the values are summed row by
   row in float32. The result is rounded to bfloat16 once, as a float32 attention cast back would
   be. Strides are in elements: qs[4], ks[3] (b, h, n), vs[3] (b, h, n), ms[2] (b, g: 0 for one
   mask row), os[4]. */

#define MAX_QUERIES 8
#define MAX_KEYS 4096

/* The 16 lane sums of x[0..15], in order: out[j] = sum of x[j]'s lanes. Three rounds of pairwise
   sums, each halving the vectors while it folds their lanes (45 instructions for 16 dot products,
   where a horizontal sum apiece would take about 128). */
static inline f32x16 sum16x16(const f32x16 *x) {
#ifdef __AVX512F__
  __m512 a[16], b[8], c[4];
  memcpy(a, x, sizeof a);
  for (int i = 0; i < 8; i++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = a[2i], y = a[2i+1] */
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++) { /* per 128-bit lane: the four vectors' sums over that lane's elements */
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  /* across the 128-bit lanes: c[i]'s four lanes summed into lane i of the result */
  __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, 0x88), _mm512_shuffle_f32x4(r01, r23, 0xDD));
  f32x16 out;
  memcpy(&out, &r, sizeof out);
  return out;
#else
  f32x16 out;
  for (int j = 0; j < 16; j++) out[j] = sum16(x[j]);
  return out;
#endif
}

/* The scores of query q (D bfloat16 values) with keys key[0..n-1] (rows `stride` apart), n <= 16,
   times scale; lanes from n on are 0. */
static inline f32x16 scores16(const int D, const uint16_t *q, const uint16_t *key, int64_t stride, int64_t n,
                              float scale) {
  f32x16 dots[16];
  for (int64_t j = 0; j < 16; j++) {
    f32x16 acc = splat(0.0f);
    if (j < n) {
      const uint16_t *row = key + j * stride;
#ifdef __AVX512BF16__
      __m512 sum = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(row + d));
      memcpy(&acc, &sum, sizeof acc);
#else
      for (int d = 0; d < D; d += 16) acc += load_bf16x16(q + d) * load_bf16x16(row + d);
#endif
    }
    dots[j] = acc;
  }
  return sum16x16(dots) * scale;
}

static inline __attribute__((always_inline)) void one_head(
    const int G, const int D, int64_t row, int64_t head, const uint16_t *q, const int64_t *qs,
    const uint16_t *k, const int64_t *ks, const uint16_t *v, const int64_t *vs,
    const uint8_t *mask, const int64_t *ms, uint16_t *out, const int64_t *os, int64_t N,
    float scale) {
  const int64_t padded = (N + 15) & ~(int64_t)15;
  uint16_t query[MAX_QUERIES][128] __attribute__((aligned(64)));
  float weight[MAX_QUERIES][MAX_KEYS] __attribute__((aligned(64)));
  int32_t keep[MAX_KEYS] __attribute__((aligned(64)));
  for (int g = 0; g < G; g++) {
    const uint16_t *qp = q + row * qs[0] + head * qs[1] + g * qs[2];
    for (int d = 0; d < D; d++) query[g][d] = qp[d * qs[3]];
  }
  const uint16_t *keys = k + row * ks[0] + head * ks[1];
  for (int64_t s = 0; s < padded; s += 16)
    for (int g = 0; g < G; g++) {
      f32x16 x = scores16(D, query[g], keys + s * ks[2], ks[2], N - s, scale);
      memcpy(&weight[g][s], &x, sizeof x);
    }
  for (int g = 0; g < G; g++) {
    const uint8_t *allowed = mask ? mask + row * ms[0] + g * ms[1] : NULL;
    for (int64_t s = 0; s < N; s++) keep[s] = allowed && !allowed[s] ? 0 : -1;
    for (int64_t s = N; s < padded; s++) keep[s] = 0;
    float *w = weight[g];
    f32x16 top = splat(-INFINITY);
    for (int64_t s = 0; s < padded; s += 16) {
      f32x16 x, m;
      memcpy(&x, w + s, sizeof x);
      i32x16 k;
      memcpy(&k, keep + s, sizeof k);
      m = select16(k, x, splat(-INFINITY));
      top = select16(m > top, m, top);
    }
    const float best = max16(top);
    if (best == -INFINITY) { /* nothing to attend to */
      for (int64_t s = 0; s < padded; s++) w[s] = 0.0f;
      continue;
    }
    f32x16 sum = splat(0.0f);
    for (int64_t s = 0; s < padded; s += 16) {
      f32x16 x;
      memcpy(&x, w + s, sizeof x);
      i32x16 k;
      memcpy(&k, keep + s, sizeof k);
      f32x16 e = select16(k, exp16(x - best), splat(0.0f));
      memcpy(w + s, &e, sizeof e);
      sum += e;
    }
    const float inv = 1.0f / sum16(sum);
    for (int64_t s = 0; s < padded; s += 16) {
      f32x16 x;
      memcpy(&x, w + s, sizeof x);
      x *= inv;
      memcpy(w + s, &x, sizeof x);
    }
  }
  f32x16 acc[MAX_QUERIES][128 / 16];
  for (int g = 0; g < G; g++)
    for (int j = 0; j < D / 16; j++) acc[g][j] = splat(0.0f);
  const uint16_t *values = v + row * vs[0] + head * vs[1];
  for (int64_t s = 0; s < N; s++) {
    f32x16 value[128 / 16];
    for (int j = 0; j < D / 16; j++) value[j] = load_bf16x16(values + s * vs[2] + 16 * j);
    for (int g = 0; g < G; g++) {
      float w = weight[g][s];
      for (int j = 0; j < D / 16; j++) acc[g][j] += w * value[j];
    }
  }
  for (int g = 0; g < G; g++) {
    uint16_t *op = out + row * os[0] + head * os[1] + g * os[2];
    if (os[3] == 1) {
      for (int j = 0; j < D / 16; j++) store_bf16x16(op + 16 * j, acc[g][j]);
      continue;
    }
    float result[128];
    memcpy(result, acc[g], sizeof(float) * D);
    for (int d = 0; d < D; d++) op[d * os[3]] = float_to_bf16(result[d]);
  }
}

#define HEAD(g, d) one_head(g, d, i / H, i % H, q, qs, k, ks, v, vs, mask, ms, out, os, N, scale)
#define QUERIES(d)                \
  switch (G) {                    \
    case 1: HEAD(1, d); break;    \
    case 2: HEAD(2, d); break;    \
    case 3: HEAD(3, d); break;    \
    case 4: HEAD(4, d); break;    \
    case 5: HEAD(5, d); break;    \
    case 6: HEAD(6, d); break;    \
    case 7: HEAD(7, d); break;    \
    default: HEAD(8, d); break;   \
  }

int mtrain_cache_attention(const uint16_t *q, const int64_t *qs, const uint16_t *k,
                           const int64_t *ks, const uint16_t *v, const int64_t *vs,
                           const uint8_t *mask, const int64_t *ms, uint16_t *out,
                           const int64_t *os, int64_t B, int64_t H, int64_t G, int64_t N,
                           int64_t D, float scale, int threads) {
  if (G < 1 || G > MAX_QUERIES || N < 1 || N > MAX_KEYS || (D != 32 && D != 64 && D != 128))
    return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < B * H; i++) {
    if (D == 64) {
      QUERIES(64)
    } else if (D == 32) {
      QUERIES(32)
    } else {
      QUERIES(128)
    }
  }
  return 0;
}

/* ---- top-k and log-sum-exp of logits ----------------------------------------------------------

   x (rows, V) bfloat16 logits, row stride `stride`; top (rows, k) float32 descending and ids
   (rows, k) int64 their columns (of equal values the first column first; -inf fills a row with
   fewer than k values above -inf, at column 0); lse (rows) float32, log sum exp over all V, or
   NULL: no exponentials at all (greedy search's argmax). One pass: each block of 16 updates the running maximum and sum of exponentials, and only
   a block holding a value above the current k-th best is searched. The sum is taken of exp(x)
   itself where the row's maximum lies in (-60, 88 - ln V) (no overflow, no loss of the largest
   terms), else in a second pass of exp(x - max). */

#define MAX_K 32

static inline void insert(float val, int64_t col, int k, float *tv, int64_t *ti, int *filled) {
  int j = *filled < k ? (*filled)++ : k - 1;
  while (j > 0 && tv[j - 1] < val) {
    tv[j] = tv[j - 1];
    ti[j] = ti[j - 1];
    j--;
  }
  tv[j] = val;
  ti[j] = col;
}

static void topk_row(const uint16_t *x, int64_t V, int k, float *top, int64_t *ids, float *lse) {
  float tv[MAX_K];
  int64_t ti[MAX_K];
  int filled = 0;
  float kth = -INFINITY; /* the k-th best so far (once k are held) */
  f32x16 high = splat(-INFINITY), sum = splat(0.0f);
  int64_t s = 0;
  for (; s + 16 <= V; s += 16) {
    f32x16 v = load_bf16x16(x + s);
    high = select16(v > high, v, high);
    if (lse) sum += exp16(v);
    /* Until k values are held every finite one is taken (kth stays -inf, so "above" means finite);
       after that only a block with a value above the k-th best is searched, lane by set lane. */
    for (uint32_t bits = above16(v, kth); bits; bits &= bits - 1) {
      int i = __builtin_ctz(bits);
      if (v[i] > kth) {
        insert(v[i], s + i, k, tv, ti, &filled);
        if (filled == k) kth = tv[k - 1];
      }
    }
  }
  float best = max16(high), total = sum16(sum);
  for (; s < V; s++) {
    float val = bf16_to_float(x[s]);
    best = val > best ? val : best;
    if (lse) total += expf(val);
    if (val > kth) { /* as above: kth is -inf until k values are held */
      insert(val, s, k, tv, ti, &filled);
      if (filled == k) kth = tv[k - 1];
    }
  }
  for (int i = filled; i < k; i++) {
    tv[i] = -INFINITY;
    ti[i] = 0;
  }
  if (lse) {
    if (best > -60.0f && best < 88.0f - logf((float)V)) {
      *lse = logf(total);
    } else if (best == -INFINITY || best == INFINITY || best != best) {
      *lse = best;
    } else {
      f32x16 acc = splat(0.0f);
      int64_t t = 0;
      for (; t + 16 <= V; t += 16) acc += exp16(load_bf16x16(x + t) - best);
      float rest = sum16(acc);
      for (; t < V; t++) rest += expf(bf16_to_float(x[t]) - best);
      *lse = best + logf(rest);
    }
  }
  for (int i = 0; i < k; i++) {
    top[i] = tv[i];
    ids[i] = ti[i];
  }
}

int mtrain_topk_logsumexp(const uint16_t *x, int64_t rows, int64_t V, int64_t stride, int64_t k,
                          float *top, int64_t *ids, float *lse, int threads) {
  if (k < 1 || k > MAX_K || V < k) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++)
    topk_row(x + r * stride, V, (int)k, top + r * k, ids + r * k, lse ? lse + r : NULL);
  return 0;
}

/* ---- dropout masks ------------------------------------------------------------------------------

   n mask elements of `width` bytes (2 or 4): all ones to keep, 0 to drop. Word j (from 0) is
   splitmix64's output for the counter seed + (j + 1) * golden gamma, a function of (seed, j) alone,
   so any number of threads gives the same bits; element i takes the low 15 bits of word i / 4's
   16-bit lane i % 4 as its uniform u and is kept when u >= threshold (a drop rate of
   threshold / 2^15). mtrain.cpu.ops.splitmix_words computes the same words with PyTorch's integer
   ops where this file is not built. */

typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int16_t i16x32 __attribute__((vector_size(64)));

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ull

static inline u64x8 splitmix8(uint64_t seed, int64_t first) {
  u64x8 z = {0, 1, 2, 3, 4, 5, 6, 7};
  z = (z + (uint64_t)first + 1) * GOLDEN_GAMMA + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int mtrain_keep_mask(uint64_t seed, int64_t n, int64_t threshold, int64_t width, void *out, int threads) {
  if ((width != 2 && width != 4) || threshold < 0 || threshold > 32767) return -1;
  const int64_t blocks = (n + 31) / 32; /* 8 words, 32 elements each */
  const uint16_t t = (uint16_t)threshold;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; blk++) {
    u64x8 words = splitmix8(seed, 8 * blk);
    u16x32 lanes;
    memcpy(&lanes, &words, sizeof lanes); /* little-endian: lane l of word j is element 4 j + l */
    i16x32 keep = (lanes & 0x7FFF) >= t;  /* -1 or 0 */
    const int64_t start = 32 * blk, count = n - start < 32 ? n - start : 32;
    if (width == 2) {
      if (count == 32)
        memcpy((int16_t *)out + start, &keep, sizeof keep);
      else
        for (int64_t i = 0; i < count; i++) ((int16_t *)out)[start + i] = keep[i];
    } else {
      int32_t wide[32];
      for (int i = 0; i < 32; i++) wide[i] = keep[i];
      memcpy((int32_t *)out + start, wide, sizeof(int32_t) * count);
    }
  }
  return 0;
}

/* ---- label-smoothed cross-entropy over bfloat16 logits ------------------------------------------

   mtrain_ce_sums: per row r of x (rows, V) bfloat16, row stride `stride`: sums[r] = the sum of
   exp(x[r, j]) over the row, no maximum taken out (the caller sums again, shifted, the rows whose log
   falls outside the range where that is exact to float32 rounding), and where means is not NULL,
   means[r] = the row's mean. One read of the row, where PyTorch took an upcast copy, a mean, an
   exp in place and a sum over each chunk of rows.

   mtrain_ce_grad: x's rows overwritten, in place, with the loss's gradient in bfloat16:
   g * exp(x - lse[r]) - low, and at column target[r] that minus picked in addition (g the loss's
   gradient, low = g * eps / V, picked = g * (1 - eps)); each value rounded once. */

int mtrain_ce_sums(const uint16_t *x, int64_t rows, int64_t V, int64_t stride, float *sums, float *means,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *row = x + r * stride;
    f32x16 exps = splat(0.0f), values = splat(0.0f);
    int64_t j = 0;
    for (; j + 16 <= V; j += 16) {
      f32x16 v = load_bf16x16(row + j);
      exps += exp16(v);
      values += v;
    }
    float e = sum16(exps), m = sum16(values);
    for (; j < V; j++) {
      float v = bf16_to_float(row[j]);
      e += expf(v);
      m += v;
    }
    sums[r] = e;
    if (means) means[r] = m / (float)V;
  }
  return 0;
}

int mtrain_ce_grad(uint16_t *x, int64_t rows, int64_t V, int64_t stride, const float *lse, const int64_t *target,
                   float g, float low, float picked, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    uint16_t *row = x + r * stride;
    const float l = lse[r];
    const int64_t t = target[r];
    const float at_target = g * expf(bf16_to_float(row[t]) - l) - low - picked;
    int64_t j = 0;
    for (; j + 16 <= V; j += 16) store_bf16x16(row + j, exp16(load_bf16x16(row + j) - l) * g - low);
    for (; j < V; j++) row[j] = float_to_bf16(g * expf(bf16_to_float(row[j]) - l) - low);
    if (t >= 0 && t < V) row[t] = float_to_bf16(at_target);
  }
  return 0;
}

/* ---- linear layers on AMX -----------------------------------------------------------------------

   out (M, N) = x (M, K) W^T + bias, optionally through a ReLU, for bfloat16 x and W on a CPU with
   AMX-BF16: the tile units multiply a 16 x 32 block of x by a 32 x 16 block of W into 16 x 16
   float32 sums in one instruction. W is packed once (mtrain.cpu.native.amx_pack) into the tiles'
   layout: for each 16 outputs and 32 inputs, 16 rows of 16 output pairs of consecutive inputs.
   Each thread computes 32 x 32 blocks of out, in four accumulator tiles over the K/32 steps, and
   rounds them to bfloat16 once, after the bias (and ReLU) in float32. The blocks are dealt out
   so that a thread's consecutive blocks share the smaller operand: outputs first, rows inside
   (sharing the weights) where x has fewer rows than W, else rows first.

   Rows are x's, `xs` elements apart; out's rows `os` apart. A last block of fewer than 32 rows
   is read from a zero-padded copy; the packed weight has zero rows up to a multiple of 32
   outputs, whose sums are never stored. K must be a multiple of 32 (-1 otherwise, as without AMX
   or when the kernel may not use the tiles). */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static int amx_permitted(void) {
  static int permitted = -1; /* the kernel grants it for the whole process; asking again is harmless */
  if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

static void amx_configure(void) {
  struct tile_config config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

/* One 32 x 32 block: rows x[0..31] (stride xs), the packed weights of outputs n .. n + 31. */
static inline void amx_block(const uint16_t *x, int64_t xs, const uint16_t *w0, const uint16_t *w1, int64_t K,
                             float *sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, xs * 2);
    _tile_loadd(5, x + 16 * xs + k, xs * 2);
    _tile_loadd(6, w0 + k * 16, 64);
    _tile_loadd(7, w1 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  _tile_stored(2, sums + 16 * 32, 128);
  _tile_stored(3, sums + 16 * 32 + 16, 128);
}

/* 1 where the tile units may be used: built for them and granted by the kernel. */
int mtrain_amx_ready(void) { return amx_permitted(); }

int mtrain_amx_linear(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, int relu,
                      uint16_t *out, int64_t os, int64_t M, int64_t N, int64_t K, int threads) {
  if (M < 1 || N < 1 || K < 32 || K % 32 || !amx_permitted()) return -1;
  const int64_t row_blocks = (M + 31) / 32, pairs = (N + 31) / 32;
  /* Consecutive blocks share the smaller operand, read again from the cache for each: the weights
     (by_rows: a block of rows at a time, every output) where they are smaller than x, else x. */
  const int by_rows = N <= M;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    amx_configure();
    float sums[32 * 32] __attribute__((aligned(64)));
    uint16_t *tail = NULL; /* the last rows, zero-padded to 32: copied once per thread that needs them */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs * row_blocks; i++) {
      const int64_t n = (by_rows ? i % pairs : i / row_blocks) * 32;
      const int64_t m = (by_rows ? i / pairs : i % row_blocks) * 32, rows = M - m < 32 ? M - m : 32;
      const uint16_t *rows_x = x + m * xs;
      int64_t stride = xs;
      if (rows < 32) {
        if (!tail) {
          tail = calloc(32 * K, sizeof(uint16_t));
          if (!tail) { /* no memory: the caller falls back to another kernel */
#pragma omp atomic write
            failed = 1;
            continue;
          }
          for (int64_t r = 0; r < rows; r++) memcpy(tail + r * K, rows_x + r * xs, sizeof(uint16_t) * K);
        }
        rows_x = tail;
        stride = K;
      }
      amx_block(rows_x, stride, w + n * K, w + (n + 16) * K, K, sums);
      /* the outputs n .. n + width - 1 exist; the packed weight's rows past N are zeros */
      const int64_t width = N - n < 32 ? N - n : 32;
      const __mmask32 keep = width == 32 ? 0xFFFFFFFFu : (1u << width) - 1;
      __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
      if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n)), 16));
        b1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep >> 16, bias + n + 16)), 16));
      }
      for (int64_t r = 0; r < rows; r++) { /* bias, ReLU, one rounding to nearest even for 32 values */
        __m512 lo = _mm512_add_ps(_mm512_load_ps(sums + 32 * r), b0);
        __m512 hi = _mm512_add_ps(_mm512_load_ps(sums + 32 * r + 16), b1);
        if (relu) {
          lo = _mm512_max_ps(lo, _mm512_setzero_ps());
          hi = _mm512_max_ps(hi, _mm512_setzero_ps());
        }
        _mm512_mask_storeu_epi16(out + (m + r) * os + n, keep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    _tile_release();
    free(tail);
  }
  return failed ? -1 : 0;
}
#else
int mtrain_amx_ready(void) { return 0; }

int mtrain_amx_linear(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, int relu,
                      uint16_t *out, int64_t os, int64_t M, int64_t N, int64_t K, int threads) {
  (void)x, (void)xs, (void)w, (void)bias, (void)relu, (void)out, (void)os, (void)M, (void)N, (void)K, (void)threads;
  return -1;
}
#endif
