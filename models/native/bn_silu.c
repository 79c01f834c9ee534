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

static inline float sigmoid(float z) {
    float e = exp_reduced(fmaxf(fminf(-z, -SIG_FLOOR), -87.0f));
    return z < SIG_FLOOR ? 0.0f : 1.0f / (1.0f + e);
}

static void thread_rows(int64_t rows, int64_t *begin, int64_t *end) {
    int threads = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t share = rows / threads, extra = rows % threads;
    *begin = id * share + (id < extra ? id : extra);
    *end = *begin + share + (id < extra ? 1 : 0);
}

/* mean[c], var[c] (double) of y (rows x C); the sums are shifted by the first row's values */
int bn_stats(const float *y, int64_t rows, int64_t C, double *mean, double *var, int threads) {
    double *acc = calloc((size_t)threads * 2 * C, sizeof(double));
    if (!acc || rows < 1) { free(acc); return -1; }
    const float *pivot = y;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int id = omp_get_thread_num();
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        double *sum = acc + (size_t)id * 2 * C, *sq = sum + C;
        float *part = malloc(2 * C * sizeof(float));
        if (!part) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *psum = part, *psq = part + C;
            for (int64_t start = begin; start < end; start += BLOCK) {
                int64_t stop = start + BLOCK < end ? start + BLOCK : end;
                memset(part, 0, 2 * C * sizeof(float));
                for (int64_t r = start; r < stop; r++) {
                    const float *row = y + r * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; c++) {
                        float d = row[c] - pivot[c];
                        psum[c] += d;
                        psq[c] += d * d;
                    }
                }
                for (int64_t c = 0; c < C; c++) {
                    sum[c] += psum[c];
                    sq[c] += psq[c];
                }
            }
            free(part);
        }
    }
    if (!failed) {
        for (int64_t c = 0; c < C; c++) {
            double s = 0.0, q = 0.0;
            for (int t = 0; t < threads; t++) {
                s += acc[(size_t)t * 2 * C + c];
                q += acc[(size_t)t * 2 * C + C + c];
            }
            double m = s / (double)rows;
            mean[c] = (double)pivot[c] + m;
            double v = q / (double)rows - m * m;
            var[c] = v > 0.0 ? v : 0.0;
        }
    }
    free(acc);
    return failed ? -1 : 0;
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

static int bn_silu_backward_sums(const float *g, const float *y, float *dz, int64_t rows, int64_t C,
                                 const float *scale, const float *shift, const float *mean, double *total, double *dot,
                                 int threads) {
    double *acc = calloc((size_t)threads * 2 * C, sizeof(double));
    if (!acc) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int id = omp_get_thread_num();
        int64_t begin, end;
        thread_rows(rows, &begin, &end);
        double *sum = acc + (size_t)id * 2 * C, *cross = sum + C;
        float *part = malloc(2 * C * sizeof(float));
        if (!part) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *psum = part, *pcross = part + C;
            for (int64_t start = begin; start < end; start += BLOCK) {
                int64_t stop = start + BLOCK < end ? start + BLOCK : end;
                memset(part, 0, 2 * C * sizeof(float));
                for (int64_t r = start; r < stop; r++) {
                    const float *grow = g + r * C, *yrow = y + r * C;
                    float *drow = dz + r * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; c++) {
                        float z = yrow[c] * scale[c] + shift[c];
                        float s = sigmoid(z);
                        float d = grow[c] * (s * (1.0f + z * (1.0f - s)));
                        drow[c] = d;
                        psum[c] += d;
                        pcross[c] += d * (yrow[c] - mean[c]);
                    }
                }
                for (int64_t c = 0; c < C; c++) {
                    sum[c] += psum[c];
                    cross[c] += pcross[c];
                }
            }
            free(part);
        }
    }
    if (!failed) {
        for (int64_t c = 0; c < C; c++) {
            double s = 0.0, x = 0.0;
            for (int t = 0; t < threads; t++) {
                s += acc[(size_t)t * 2 * C + c];
                x += acc[(size_t)t * 2 * C + C + c];
            }
            total[c] = s;
            dot[c] = x;
        }
    }
    free(acc);
    return failed ? -1 : 0;
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
    int failed = bn_silu_backward_sums(g, y, dx, rows, C, scale, shift, mean32, total, dot, threads);
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
