/* Training-mode BatchNorm + SiLU over a channels_last float32 map, in as few passes over memory as the
 * arithmetic allows (see models/native/__init__.py for how it is built and models/bn_silu.py for its use).
 *
 * A channels_last (N, C, H, W) map is `rows` = N*H*W rows of C floats. Per-channel sums are taken in float over
 * blocks of BLOCK rows and added into double accumulators, one set per thread, combined in thread order after the
 * parallel region: the result depends on the thread count (`threads`, torch's) only, never on scheduling.
 *
 * bn_silu_train_forward: the statistics (one read of y), then out = silu(y * scale + shift) (one read, one write).
 * bn_silu_train_backward: dz = g * silu'(y * scale + shift) with per-channel sum(dz) and sum(dz * (y - mean))
 *                         (two reads, one write), then the input gradient from dz and y (two reads, one write).
 * The per-channel arithmetic between the passes is in double.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define BLOCK 256
#define SIG_FLOOR -80.0f /* below this, sigmoid(z) is taken as 0: exp(80) is still a normal float */

/* exp(x) for x in [-87, 80], within ~2 ulp: x = n ln2 + r (|r| <= ln2/2, ln2 in two parts), a degree-6
 * polynomial for exp(r) (the Cephes expf coefficients), 2^n from the exponent bits. Inline arithmetic only,
 * so the compiler vectorises it with the loop around it (a libm call per vector costs twice as much). */
static inline float exp_reduced(float x) {
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* -z clamped to [-87, -SIG_FLOOR] by selects, which vectorise without -ffinite-math-only (fminf/fmaxf do not): a
 * NaN z takes the upper bound, so z * sigmoid(z) stays NaN; z = +inf gives sigmoid 1, -inf gives 0. */
static inline float sigmoid(float z) {
    float t = -z;
    t = t < -SIG_FLOOR ? t : -SIG_FLOOR;
    t = t > -87.0f ? t : -87.0f;
    float e = exp_reduced(t);
    return z < SIG_FLOOR ? 0.0f : 1.0f / (1.0f + e);
}

static void thread_rows(int64_t rows, int64_t *begin, int64_t *end) {
    int threads = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t share = rows / threads, extra = rows % threads;
    *begin = id * share + (id < extra ? id : extra);
    *end = *begin + share + (id < extra ? 1 : 0);
}

/* A block's share of two per-channel sums: rows [start, stop) added into first[C] and second[C] (float). */
typedef void (*block_sums)(const void *args, int64_t start, int64_t stop, float *first, float *second);

/* Two per-channel sums over all rows into first[C] and second[C] (double): each thread sums its rows in float
 * blocks of BLOCK rows, each block added into the thread's double accumulators; the threads' sums are combined in
 * thread order. 0, or -1 when memory could not be allocated. */
static int channel_sums(int64_t rows, int64_t C, int threads, block_sums add_block, const void *args, double *first,
                        double *second) {
    double *acc = calloc((size_t)threads * 2 * C, sizeof(double));
    if (!acc) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        double *one = acc + (size_t)omp_get_thread_num() * 2 * C, *two = one + C;
        float *part = malloc(2 * C * sizeof(float));
        if (!part) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t start = begin; start < end; start += BLOCK) {
                memset(part, 0, 2 * C * sizeof(float));
                add_block(args, start, start + BLOCK < end ? start + BLOCK : end, part, part + C);
                for (int64_t c = 0; c < C; c++) {
                    one[c] += part[c];
                    two[c] += part[C + c];
                }
            }
            free(part);
        }
    }
    if (!failed) {
        for (int64_t c = 0; c < C; c++) {
            double one = 0.0, two = 0.0;
            for (int t = 0; t < threads; t++) {
                one += acc[(size_t)t * 2 * C + c];
                two += acc[(size_t)t * 2 * C + C + c];
            }
            first[c] = one;
            second[c] = two;
        }
    }
    free(acc);
    return failed ? -1 : 0;
}

struct stats_args {
    const float *y, *pivot;
    int64_t C;
};

static void stats_block(const void *args, int64_t start, int64_t stop, float *sum, float *squares) {
    const struct stats_args *a = args;
    for (int64_t r = start; r < stop; r++) {
        const float *row = a->y + r * a->C;
#pragma omp simd
        for (int64_t c = 0; c < a->C; c++) {
            float d = row[c] - a->pivot[c];
            sum[c] += d;
            squares[c] += d * d;
        }
    }
}

/* mean[c], var[c] (double) of y (rows x C); the sums are shifted by the first row's values */
int bn_stats(const float *y, int64_t rows, int64_t C, double *mean, double *var, int threads) {
    if (rows < 1) return -1;
    struct stats_args args = {y, y, C};
    if (channel_sums(rows, C, threads, stats_block, &args, mean, var) != 0) return -1;
    for (int64_t c = 0; c < C; c++) {
        double m = mean[c] / (double)rows, v = var[c] / (double)rows - m * m;
        mean[c] = (double)y[c] + m;
        var[c] = v > 0.0 ? v : 0.0;
    }
    return 0;
}

static int bn_silu_forward(const float *y, float *out, int64_t rows, int64_t C, const float *scale,
                           const float *shift, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        for (int64_t r = begin; r < end; r++) {
            const float *row = y + r * C;
            float *o = out + r * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                float z = row[c] * scale[c] + shift[c];
                o[c] = z * sigmoid(z);
            }
        }
    }
    return 0;
}

struct backward_args {
    const float *g, *y, *scale, *shift, *mean;
    float *dz;
    int64_t C;
};

/* dz = g * silu'(y * scale + shift) written out; sum(dz) and sum(dz * (y - mean)) */
static void backward_block(const void *args, int64_t start, int64_t stop, float *total, float *dot) {
    const struct backward_args *a = args;
    for (int64_t r = start; r < stop; r++) {
        const float *grow = a->g + r * a->C, *yrow = a->y + r * a->C;
        float *drow = a->dz + r * a->C;
#pragma omp simd
        for (int64_t c = 0; c < a->C; c++) {
            float z = yrow[c] * a->scale[c] + a->shift[c];
            float s = sigmoid(z);
            float d = grow[c] * (s * (1.0f + z * (1.0f - s)));
            drow[c] = d;
            total[c] += d;
            dot[c] += d * (yrow[c] - a->mean[c]);
        }
    }
}

static int bn_backward_input(const float *dz, const float *y, float *dy, int64_t rows, int64_t C,
                             const float *gain, const float *slope, const float *offset, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        for (int64_t r = begin; r < end; r++) {
            const float *drow = dz + r * C, *yrow = y + r * C;
            float *o = dy + r * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++)
                o[c] = gain[c] * drow[c] + slope[c] * yrow[c] + offset[c];
        }
    }
    return 0;
}

/* Forward of silu(batch_norm(y)) in training: mean and biased var of y (double, out), scale = weight / sqrt(var + eps)
 * and shift = bias - mean * scale (float, out, kept for backward), then out = silu(y * scale + shift).
 * 0, or -1 when memory for the per-thread sums could not be allocated. */
int bn_silu_train_forward(const float *y, float *out, int64_t rows, int64_t C, const float *weight, const float *bias,
                          double eps, double *mean, double *var, float *scale, float *shift, int threads) {
    if (bn_stats(y, rows, C, mean, var, threads) != 0) return -1;
    for (int64_t c = 0; c < C; c++) {
        double gain = (double)weight[c] / sqrt(var[c] + eps);
        scale[c] = (float)gain;
        shift[c] = (float)((double)bias[c] - mean[c] * gain);
    }
    return bn_silu_forward(y, out, rows, C, scale, shift, threads);
}

/* Backward: from g = dL/d(out), the parameter gradients grad_weight = sum(dz * (y - mean)) / sqrt(var + eps) and
 * grad_bias = sum(dz) (dz = g * silu'(y * scale + shift)) and, when input_gradient is set, into dx:
 *   dx = scale * dz + slope * (y - mean) - scale * mean(dz),   slope = -scale * mean(dz * (y - mean)) / (var + eps)
 * dx holds dz in between (it must be rows x C). 0, or -1 when memory could not be allocated. */
int bn_silu_train_backward(const float *g, const float *y, float *dx, int64_t rows, int64_t C, double eps,
                           const double *mean, const double *var, const float *scale, const float *shift,
                           float *grad_weight, float *grad_bias, int input_gradient, int threads) {
    float *channel = malloc(3 * C * sizeof(float));
    double *sums = malloc(2 * C * sizeof(double));
    if (!channel || !sums) {
        free(channel);
        free(sums);
        return -1;
    }
    float *mean32 = channel, *slope = channel + C, *offset = channel + 2 * C;
    double *total = sums, *dot = sums + C;
    for (int64_t c = 0; c < C; c++) mean32[c] = (float)mean[c];
    struct backward_args args = {g, y, scale, shift, mean32, dx, C};
    int failed = channel_sums(rows, C, threads, backward_block, &args, total, dot);
    if (!failed) {
        for (int64_t c = 0; c < C; c++) {
            double invstd = 1.0 / sqrt(var[c] + eps);
            double s = -(double)scale[c] * invstd * invstd * dot[c] / (double)rows;
            slope[c] = (float)s;
            offset[c] = (float)(-s * mean[c] - (double)scale[c] * total[c] / (double)rows);
            grad_weight[c] = (float)(dot[c] * invstd);
            grad_bias[c] = (float)total[c];
        }
        if (input_gradient) bn_backward_input(dx, y, dx, rows, C, scale, slope, offset, threads);
    }
    free(channel);
    free(sums);
    return failed ? -1 : 0;
}
