// Hearth's fused kernels for the device-generic forward pass (gpu-worker/src/generic/ops.rs
// holds their CPU twins, which the tests compare with the CPU engine). Each replaces several
// candle operations of a decode step with one launch:
//
//   embed_norm       the scaled embedding and the first layer's attention norm
//   residual_norm    post-norm of a block's output, the residual add and the next pre-norm
//   q_prep           query heads: QK-norm and RoPE, read from the fused QKV product
//   kv_write_*       key heads (QK-norm, RoPE) and value heads into their paged K/V slots
//   paged_attention_* every query row of a step, each over its own sequence's positions
//   gelu_mul         GELU (tanh) of the gate half times the up half of the fused product
//   logit_summary    each row's first argmax, maximum and log-sum-exp
//   softcap_inplace  cap * tanh(x / cap)
//
// A step's token ids, positions, sequence of each token and block tables travel in one u32
// buffer ("meta", uploaded once a step): ids[n] | pos[n] | seq[n] | tables[seqs * max_blocks].
// Compiled to PTX by build.rs with the pinned toolkit.

#include <cuda_fp16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The sum of `v` over the block, returned to every thread. `shared` holds 32 floats.
__device__ float block_sum(float v, float* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // `shared` may still be read from a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

// Row r of `emb` ([n, h], the looked-up embedding) times `scale` into out[0] ([2, n, h]), and
// that row RMS-normalized with weights `w` into out[1]. One block per row.
extern "C" __global__ void embed_norm(const float* emb, const float* w, float* out, int n, int h,
                                      float scale, float eps) {
    __shared__ float shared[32];
    const int r = blockIdx.x;
    const float* e = emb + (size_t)r * h;
    float* x = out + (size_t)r * h;
    float* y = out + (size_t)(n + r) * h;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        const float v = e[i] * scale;
        x[i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, shared) / h + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) y[i] = x[i] * inv * w[i];
}

// x' = x + rms_norm(o) * w[0] (x + o when `post` is 0) into out[0], and rms_norm(x') * w[1]
// into out[1]; x, o: [n, h], w: [2, h], out: [2, n, h]. One block per row.
extern "C" __global__ void residual_norm(const float* x, const float* o, const float* w, float* out,
                                         int n, int h, float eps, int post) {
    __shared__ float shared[32];
    const int r = blockIdx.x;
    const float* xr = x + (size_t)r * h;
    const float* orow = o + (size_t)r * h;
    float* xo = out + (size_t)r * h;
    float* yo = out + (size_t)(n + r) * h;
    float inv_o = 1.0f;
    if (post) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < h; i += blockDim.x) ss += orow[i] * orow[i];
        inv_o = 1.0f / sqrtf(block_sum(ss, shared) / h + eps);
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        const float v = xr[i] + (post ? orow[i] * inv_o * w[i] : orow[i]);
        xo[i] = v;
        ss += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, shared) / h + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) yo[i] = xo[i] * inv * w[h + i];
}

// One head of `hd` values at `src`: RMS-normalized with `norm` (when not null), then rotated by
// position `pos` (the two halves together, as Gemma does), into `dst`. Called by `hd / 2`
// threads, thread i holding values i and i + hd/2.
template <typename T>
__device__ void norm_rope(const float* src, const float* norm, const float* inv_freq, uint32_t pos,
                          int hd, float eps, T* dst, float* shared) {
    const int half = hd / 2, i = threadIdx.x;
    float a = src[i], b = src[i + half];
    if (norm != nullptr) {
        const float inv = 1.0f / sqrtf(block_sum(a * a + b * b, shared) / hd + eps);
        a *= inv * norm[i];
        b *= inv * norm[i + half];
    }
    float s, c;
    sincosf((float)pos * inv_freq[i], &s, &c);
    store(dst + i, a * c - b * s);
    store(dst + i + half, a * s + b * c);
}

// Query heads of the fused QKV rows (`qkv`: [n, (nh + 2 nkv) hd]) into `q` ([n, nh, hd]).
// Grid (n, nh), hd / 2 threads. `aux` holds the layer's query norm, key norm (hd each) and the
// RoPE inverse frequencies (hd / 2); `has_norm` says whether the model normalizes heads.
extern "C" __global__ void q_prep(const float* qkv, const uint32_t* meta, const float* aux, float* q,
                                  int n, int nh, int nkv, int hd, float eps, int has_norm) {
    __shared__ float shared[32];
    const int t = blockIdx.x, head = blockIdx.y;
    const size_t width = (size_t)(nh + 2 * nkv) * hd;
    norm_rope(qkv + t * width + (size_t)head * hd, has_norm ? aux : nullptr, aux + 2 * hd,
              meta[n + t], hd, eps, q + ((size_t)t * nh + head) * hd, shared);
}

// The slot of token t's position in its sequence's block table.
__device__ __forceinline__ size_t slot_of(const uint32_t* meta, int n, int t, int max_blocks,
                                          int block_size) {
    const uint32_t pos = meta[n + t], seq = meta[2 * n + t];
    const uint32_t block = meta[3 * n + (size_t)seq * max_blocks + pos / block_size];
    return (size_t)block * block_size + pos % block_size;
}

// Key heads (QK-norm, RoPE) and value heads of `qkv` into their slots of `cache`
// ([2, slots, nkv hd]: keys, then values). Grid (n, nkv), hd / 2 threads.
template <typename T>
__device__ void kv_write(const float* qkv, const uint32_t* meta, const float* aux, T* cache, int n,
                         int nh, int nkv, int hd, float eps, int has_norm, int max_blocks,
                         int block_size, size_t slots) {
    __shared__ float shared[32];
    const int t = blockIdx.x, head = blockIdx.y, half = hd / 2, i = threadIdx.x;
    const size_t width = (size_t)(nh + 2 * nkv) * hd, kv_dim = (size_t)nkv * hd;
    const float* row = qkv + t * width;
    const size_t at = slot_of(meta, n, t, max_blocks, block_size) * kv_dim + (size_t)head * hd;
    norm_rope(row + (size_t)(nh + head) * hd, has_norm ? aux + hd : nullptr, aux + 2 * hd,
              meta[n + t], hd, eps, cache + at, shared);
    const float* v = row + (size_t)(nh + nkv + head) * hd;
    store(cache + slots * kv_dim + at + i, v[i]);
    store(cache + slots * kv_dim + at + i + half, v[i + half]);
}

extern "C" __global__ void kv_write_f16(const float* qkv, const uint32_t* meta, const float* aux,
                                        __half* cache, int n, int nh, int nkv, int hd, float eps,
                                        int has_norm, int max_blocks, int block_size,
                                        unsigned long long slots) {
    kv_write(qkv, meta, aux, cache, n, nh, nkv, hd, eps, has_norm, max_blocks, block_size, slots);
}

extern "C" __global__ void kv_write_f32(const float* qkv, const uint32_t* meta, const float* aux,
                                        float* cache, int n, int nh, int nkv, int hd, float eps,
                                        int has_norm, int max_blocks, int block_size,
                                        unsigned long long slots) {
    kv_write(qkv, meta, aux, cache, n, nh, nkv, hd, eps, has_norm, max_blocks, block_size, slots);
}

// Attention of query row t, head `head` over its sequence's positions max(0, p + 1 - window)..=p
// (window 0: from 0), reading keys and values by slot through the block table. Grid (n, nh),
// up to MAX_WARPS warps (the launch picks more for longer contexts): each warp takes every
// warps-th position with an online softmax, lane l holding values l, l + 32, ... of the head
// (E = hd / 32 of them); the warps' partial results are then combined. Scores are q·k * scale,
// capped (cap * tanh(s / cap)) when `softcap` > 0.
constexpr int MAX_WARPS = 16;

template <typename T, int E>
__device__ void paged_attention(const float* q, const T* cache, const uint32_t* meta, float* out,
                                int n, int nh, int nkv, int window, float scale, float softcap,
                                int max_blocks, int block_size, size_t slots) {
    constexpr int HD = 32 * E;
    __shared__ float part_m[MAX_WARPS], part_l[MAX_WARPS];
    __shared__ float part_acc[MAX_WARPS][HD];
    const int t = blockIdx.x, head = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int kvh = head / (nh / nkv);
    const size_t kv_dim = (size_t)nkv * HD;
    const uint32_t pos = meta[n + t], seq = meta[2 * n + t];
    const uint32_t* table = meta + 3 * n + (size_t)seq * max_blocks;
    const int lo = (window > 0 && (int)pos + 1 > window) ? (int)pos + 1 - window : 0;

    float qv[E], acc[E];
    const float* qrow = q + ((size_t)t * nh + head) * HD;
#pragma unroll
    for (int e = 0; e < E; e++) {
        qv[e] = qrow[lane + 32 * e];
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j = lo + warp; j <= (int)pos; j += warps) {
        const size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const T* k = cache + slot * kv_dim + (size_t)kvh * HD;
        const T* v = cache + (slots + slot) * kv_dim + (size_t)kvh * HD;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) s += qv[e] * load(k + lane + 32 * e);
        s = warp_sum(s) * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s);
        const float c = expf(m - m_new), p = expf(s - m_new);
        l = l * c + p;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] = acc[e] * c + p * load(v + lane + 32 * e);
        m = m_new;
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < E; e++) part_acc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < warps; w++) big = fmaxf(big, part_m[w]);
    float total = 0.0f;
    for (int w = 0; w < warps; w++)
        if (part_l[w] > 0.0f) total += part_l[w] * expf(part_m[w] - big);
    float* o = out + ((size_t)t * nh + head) * HD;
    for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < warps; w++)
            if (part_l[w] > 0.0f) sum += part_acc[w][i] * expf(part_m[w] - big);
        o[i] = sum / total;
    }
}

#define PAGED_ATTENTION(NAME, T, E)                                                            \
    extern "C" __global__ void NAME(const float* q, const T* cache, const uint32_t* meta,      \
                                    float* out, int n, int nh, int nkv, int window, float scale, \
                                    float softcap, int max_blocks, int block_size,              \
                                    unsigned long long slots) {                                 \
        paged_attention<T, E>(q, cache, meta, out, n, nh, nkv, window, scale, softcap,           \
                              max_blocks, block_size, slots);                                   \
    }
PAGED_ATTENTION(paged_attention_f16_64, __half, 2)
PAGED_ATTENTION(paged_attention_f16_128, __half, 4)
PAGED_ATTENTION(paged_attention_f16_256, __half, 8)
PAGED_ATTENTION(paged_attention_f32_64, float, 2)
PAGED_ATTENTION(paged_attention_f32_128, float, 4)
PAGED_ATTENTION(paged_attention_f32_256, float, 8)

// GELU (tanh approximation, as x / (1 + e^(-2u))) of gu[r, i] times gu[r, f + i] into
// out[r, i]; gu: [n, 2f], out: [n, f].
extern "C" __global__ void gelu_mul(const float* gu, float* out, int n, int f) {
    const size_t total = (size_t)n * f;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < total;
         k += (size_t)gridDim.x * blockDim.x) {
        const size_t r = k / f, i = k % f;
        const float x = gu[r * 2 * f + i], u = gu[r * 2 * f + f + i];
        const float t = 0.7978846f * (x + 0.044715f * x * x * x);
        out[k] = x / (1.0f + expf(-2.0f * t)) * u;
    }
}

// cap * tanh(x / cap), in place over `count` values.
extern "C" __global__ void softcap_inplace(float* x, unsigned long long count, float cap) {
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < count;
         k += (size_t)gridDim.x * blockDim.x)
        x[k] = cap * tanhf(x[k] / cap);
}

// Row r of `logits` ([rows, vocab]): the first position of its largest value, that value, and
// ln Σ e^x, into out[r] = {argmax (as a float: exact below 2^24), max, lse}. One block a row.
extern "C" __global__ void logit_summary(const float* logits, float* out, int vocab) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ float shared[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    float bv = -INFINITY;
    int bi = vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > bv) {  // a thread sees its columns in order: the first of equals stays
            bv = v;
            bi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
    }
    __syncthreads();
    bv = -INFINITY;
    bi = vocab;
    for (int w = 0; w < warps; w++)
        if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) {
            bv = best_v[w];
            bi = best_i[w];
        }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(row[i] - bv);
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) {
        out[blockIdx.x * 3] = (float)(bi < vocab ? bi : 0);
        out[blockIdx.x * 3 + 1] = bv;
        out[blockIdx.x * 3 + 2] = bv + logf(sum);
    }
}
