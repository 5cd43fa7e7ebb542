"""Kernel bodies for ``mx.fast.metal_kernel`` and ``mx.fast.cuda_kernel`` (JIT, no build step).

MLX generates each kernel's signature from the input and output names; the bodies below use
two template constants, ``T`` (float dtype) and ``D`` (head_dim), so one model compiles a
handful of kernels; everything else (head counts, rotary dims, style, page size, window,
split plan) arrives in a small int32 ``meta`` input. All arithmetic is float32.

RoPE (``ROPE_*``): one thread per (pair ``j`` of head_dim / 2, head ``h`` of q then k, token
``t``). Pairs ``j < DIMS / 2`` are rotated (half-split: ``x[j], x[j + DIMS / 2]``; traditional:
``x[2j], x[2j + 1]``) by ``theta = scale * position * 2 ** (-j / (DIMS / 2) * log2(base))``,
the formula of ``mx.fast.rope``; the other threads copy the pass-through features
``DIMS ..`` two at a time. ``params = [scale, log2(base)]``,
``meta = [DIMS, HQ, HKV, TRADITIONAL]``.

Paged decode (``PAGED_*``, split-K "flash decoding"): one threadgroup / block of ``NSG``
simd groups / warps per (group of ``G`` query heads sharing one kv head, request, split),
``G`` a template constant. Split ``s`` covers visible positions
``start + s * CHUNK .. start + (s + 1) * CHUNK - 1``; warp ``w`` walks every ``NSG``-th of
them, finds each key through ``page_table`` (never materialising a gathered copy), loads
its K and V row once for all ``G`` heads and keeps one online-softmax state per head. The
warps' states are merged into the split's partial ``(max, denominator, unnormalised
output)``; :func:`merge_partials` combines the splits and the sink logit with MLX ops.
``params = [scale]``, ``meta = [HQ, HKV, PS, WINDOW (0 = none), SPLITS, CHUNK]``.
"""

from __future__ import annotations

__all__ = [
    "CUDA_PAGED_QUANTIZED_SOURCE",
    "CUDA_PAGED_SOURCE",
    "paged_group_size",
    "CUDA_ROPE_SOURCE",
    "METAL_PAGED_QUANTIZED_SOURCE",
    "METAL_PAGED_SOURCE",
    "METAL_ROPE_SOURCE",
    "PAGED_SIMD_GROUPS",
]

#: Simd groups (Metal) / warps (CUDA) of 32 threads per (query-head group, request).
PAGED_SIMD_GROUPS = 8
#: Per-thread float registers allowed for one group's q and accumulator rows.
_GROUP_REGISTERS = 32


def paged_group_size(hq: int, hkv: int, head_dim: int) -> int:
    """Query heads per threadgroup: the largest divisor of ``hq / hkv`` that fits registers."""
    ratio = hq // hkv
    per_head = -(-head_dim // 32)
    fitting = [
        g for g in range(1, ratio + 1) if ratio % g == 0 and g * per_head <= _GROUP_REGISTERS
    ]
    return max(fitting) if fitting else 1


METAL_ROPE_SOURCE = """
    const uint j = thread_position_in_grid.x;
    const uint h = thread_position_in_grid.y;
    const uint t = thread_position_in_grid.z;
    const uint DIMS = meta[0];
    const uint HQ = meta[1];
    const uint HKV = meta[2];
    const bool TRADITIONAL = meta[3] != 0;
    const uint HALF = DIMS / 2;
    if (j >= D / 2 || h >= HQ + HKV) {
        return;
    }
    const bool is_q = h < HQ;
    const uint row = is_q ? (t * HQ + h) * D : (t * HKV + (h - HQ)) * D;
    const device T* src = is_q ? q : k;
    device T* dst = is_q ? q_rot : k_rot;
    if (j < HALF) {
        const uint i1 = TRADITIONAL ? 2 * j : j;
        const uint i2 = TRADITIONAL ? 2 * j + 1 : j + HALF;
        const float p = params[0] * static_cast<float>(positions[t]);
        const float theta = p * metal::exp2(-(static_cast<float>(j) / HALF) * params[1]);
        const float c = metal::fast::cos(theta);
        const float s = metal::fast::sin(theta);
        const float x1 = static_cast<float>(src[row + i1]);
        const float x2 = static_cast<float>(src[row + i2]);
        dst[row + i1] = static_cast<T>(x1 * c - x2 * s);
        dst[row + i2] = static_cast<T>(x1 * s + x2 * c);
    } else {
        const uint e = DIMS + 2 * (j - HALF);
        dst[row + e] = src[row + e];
        dst[row + e + 1] = src[row + e + 1];
    }
"""

CUDA_ROPE_SOURCE = """
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int h = blockIdx.y * blockDim.y + threadIdx.y;
    const int t = blockIdx.z * blockDim.z + threadIdx.z;
    const int DIMS = meta[0];
    const int HQ = meta[1];
    const int HKV = meta[2];
    const bool TRADITIONAL = meta[3] != 0;
    const int HALF = DIMS / 2;
    if (j >= D / 2 || h >= HQ + HKV || t >= positions_shape[0]) {
        return;
    }
    const bool is_q = h < HQ;
    const long row = is_q ? (long(t) * HQ + h) * D : (long(t) * HKV + (h - HQ)) * D;
    const T* src = is_q ? q : k;
    T* dst = is_q ? q_rot : k_rot;
    if (j < HALF) {
        const int i1 = TRADITIONAL ? 2 * j : j;
        const int i2 = TRADITIONAL ? 2 * j + 1 : j + HALF;
        const float p = params[0] * static_cast<float>(positions[t]);
        const float theta = p * exp2f(-(static_cast<float>(j) / HALF) * params[1]);
        float s;
        float c;
        sincosf(theta, &s, &c);
        const float x1 = static_cast<float>(src[row + i1]);
        const float x2 = static_cast<float>(src[row + i2]);
        dst[row + i1] = static_cast<T>(x1 * c - x2 * s);
        dst[row + i2] = static_cast<T>(x1 * s + x2 * c);
    } else {
        const int e = DIMS + 2 * (j - HALF);
        dst[row + e] = src[row + e];
        dst[row + e + 1] = src[row + e + 1];
    }
"""

_PAGED_TEMPLATE = """
    constexpr int NSG = @NSG@;
    constexpr int EPT = (D + 31) / 32;
    @SHARED@ float tg_m[NSG * G];
    @SHARED@ float tg_l[NSG * G];
    @SHARED@ float tg_acc[NSG * D];
    const int HQ = meta[0];
    const int HKV = meta[1];
    const int PS = meta[2];
    const int WINDOW = meta[3];
    const int SPLITS = meta[4];
    const int CHUNK = meta[5];
    @IDS@
    const int b = zid / SPLITS;
    const int split = zid % SPLITS;
    const int h0 = group * G;
    const int kvh = h0 / (HQ / HKV);
    const int max_pages = page_table_shape[1];
    const @I64@ num_slots = @SLOTS@;
    const int len = seq_lens[b];
    const int visible_start = WINDOW > 0 ? @MAX@(len - WINDOW, 0) : 0;
    const int start = visible_start + split * CHUNK;
    const int stop = @MIN@(len, start + CHUNK);
    const float neg_inf = @NEG_INF@;

    float qv[G][EPT];
    float acc[G][EPT];
    float m[G];
    float l[G];
    for (int r = 0; r < G; ++r) {
        for (int e = 0; e < EPT; ++e) {
            const int dd = lane + 32 * e;
            const @I64@ qi = (@I64@(b) * HQ + h0 + r) * D + dd;
            qv[r][e] = dd < D ? static_cast<float>(q[qi]) * params[0] : 0.0f;
            acc[r][e] = 0.0f;
        }
        m[r] = neg_inf;
        l[r] = 0.0f;
    }
    for (int pos = start + sg; pos < stop; pos += NSG) {
        const int col = pos / PS;
        if (col >= max_pages) {
            break;
        }
        const int page = page_table[@I64@(b) * max_pages + col];
        const @I64@ slot = @I64@(page) * PS + pos % PS;
        if (page < 0 || slot >= num_slots) {
            continue;
        }
        float kx[EPT];
        float vx[EPT];
        @LOAD@
        for (int r = 0; r < G; ++r) {
            float dot = 0.0f;
            for (int e = 0; e < EPT; ++e) {
                dot += qv[r][e] * kx[e];
            }
            @WARP_SUM@
            const float m_new = @MAX@(m[r], dot);
            const float corr = @EXP@(m[r] - m_new);
            const float p = @EXP@(dot - m_new);
            l[r] = l[r] * corr + p;
            for (int e = 0; e < EPT; ++e) {
                acc[r][e] = acc[r][e] * corr + p * vx[e];
            }
            m[r] = m_new;
        }
    }

    if (lane == 0) {
        for (int r = 0; r < G; ++r) {
            tg_m[sg * G + r] = m[r];
            tg_l[sg * G + r] = l[r];
        }
    }
    for (int r = 0; r < G; ++r) {
        for (int e = 0; e < EPT; ++e) {
            const int dd = lane + 32 * e;
            if (dd < D) {
                tg_acc[sg * D + dd] = acc[r][e];
            }
        }
        @BARRIER@;
        if (sg == 0) {
            // This split's partial state, relative to its own running maximum.
            const @I64@ row = (@I64@(b) * SPLITS + split) * HQ + h0 + r;
            float mx_all = neg_inf;
            for (int i = 0; i < NSG; ++i) {
                mx_all = @MAX@(mx_all, tg_m[i * G + r]);
            }
            float w[NSG];
            float denom = 0.0f;
            for (int i = 0; i < NSG; ++i) {
                const float mi = tg_m[i * G + r];
                w[i] = mi == neg_inf ? 0.0f : @EXP@(mi - mx_all);
                denom += tg_l[i * G + r] * w[i];
            }
            if (lane == 0) {
                part_m[row] = mx_all;
                part_l[row] = denom;
            }
            for (int e = 0; e < EPT; ++e) {
                const int dd = lane + 32 * e;
                if (dd < D) {
                    float o = 0.0f;
                    for (int i = 0; i < NSG; ++i) {
                        o += tg_acc[i * D + dd] * w[i];
                    }
                    part_acc[row * D + dd] = o;
                }
            }
        }
        @BARRIER@;
    }
"""


#: Plain pages: row ``slot`` of kv head ``kvh`` is ``D`` values of ``T``.
_PLAIN_LOAD = """const @I64@ base = (@I64@(kvh) * num_slots + slot) * D;
        for (int e = 0; e < EPT; ++e) {
            const int dd = lane + 32 * e;
            kx[e] = dd < D ? static_cast<float>(k_pool[base + dd]) : 0.0f;
            vx[e] = dd < D ? static_cast<float>(v_pool[base + dd]) : 0.0f;
        }"""

#: Quantized pages (``mx.quantize``'s affine form): a row is ``D * BITS / 32`` packed words,
#: value ``dd`` in bits ``(dd * BITS) % 32`` of word ``dd * BITS / 32`` (lowest bits first),
#: and one scale and bias of ``T`` per ``GS`` values; dequantized as ``scale * q + bias``.
_QUANTIZED_LOAD = """const @I64@ row = @I64@(kvh) * num_slots + slot;
        const @I64@ words = row * (D * BITS / 32);
        const @I64@ groups = row * (D / GS);
        for (int e = 0; e < EPT; ++e) {
            const int dd = lane + 32 * e;
            if (dd < D) {
                const int word = dd * BITS / 32;
                const int shift = (dd * BITS) % 32;
                const uint32_t mask = (1u << BITS) - 1u;
                const @I64@ gi = groups + dd / GS;
                const float kq = static_cast<float>((k_data[words + word] >> shift) & mask);
                const float vq = static_cast<float>((v_data[words + word] >> shift) & mask);
                kx[e] = static_cast<float>(k_scales[gi]) * kq + static_cast<float>(k_biases[gi]);
                vx[e] = static_cast<float>(v_scales[gi]) * vq + static_cast<float>(v_biases[gi]);
            } else {
                kx[e] = 0.0f;
                vx[e] = 0.0f;
            }
        }"""


def _dialect(template: str, **parts: str) -> str:
    for key, value in parts.items():
        template = template.replace(f"@{key}@", value)
    return template


_METAL_PARTS = dict(
    NSG=str(PAGED_SIMD_GROUPS),
    SHARED="threadgroup",
    IDS="""const int group = threadgroup_position_in_grid.y;
    const int zid = threadgroup_position_in_grid.z;
    const int sg = simdgroup_index_in_threadgroup;
    const int lane = thread_index_in_simdgroup;""",
    I64="int64_t",
    MAX="metal::max",
    MIN="metal::min",
    EXP="metal::exp",
    NEG_INF="-metal::numeric_limits<float>::infinity()",
    WARP_SUM="dot = metal::simd_sum(dot);",
    BARRIER="threadgroup_barrier(metal::mem_flags::mem_threadgroup)",
)

_CUDA_PARTS = dict(
    NSG=str(PAGED_SIMD_GROUPS),
    SHARED="__shared__",
    IDS="""const int group = blockIdx.y;
    const int zid = blockIdx.z;
    const int sg = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;""",
    I64="long",
    MAX="max",
    MIN="min",
    EXP="expf",
    NEG_INF="__int_as_float(0xff800000)",
    WARP_SUM="""for (int off = 16; off > 0; off >>= 1) {
                dot += __shfl_xor_sync(0xffffffffu, dot, off);
            }""",
    BARRIER="__syncthreads()",
)


def _paged_source(parts: dict[str, str], *, quantized: bool) -> str:
    """The paged attention body in one dialect, reading plain or quantized pages."""
    load = _QUANTIZED_LOAD if quantized else _PLAIN_LOAD
    slots = "k_data_shape[1]" if quantized else "k_pool_shape[1]"
    template = _PAGED_TEMPLATE.replace("@LOAD@", load).replace("@SLOTS@", slots)
    return _dialect(template, **parts)


METAL_PAGED_SOURCE = _paged_source(_METAL_PARTS, quantized=False)
CUDA_PAGED_SOURCE = _paged_source(_CUDA_PARTS, quantized=False)
#: Inputs ``q, k_data, k_scales, k_biases, v_data, v_scales, v_biases, page_table, seq_lens,
#: params, meta``; template ``T, D, G, BITS, GS``.
METAL_PAGED_QUANTIZED_SOURCE = _paged_source(_METAL_PARTS, quantized=True)
CUDA_PAGED_QUANTIZED_SOURCE = _paged_source(_CUDA_PARTS, quantized=True)
