/*
 * arrays.c: the size estimate for CUDA arrays, which the driver never reports.
 *
 * Estimate = element bytes x channels x width, each row padded to 512 bytes, x height x
 * depth (0 counts as 1; layers and cube faces are in Depth), rounded up to 2 MiB, the
 * driver's allocation granularity. Element bytes come from the format; formats the table
 * does not know (packed, block-compressed, normalised) count as 4 bytes per channel, which
 * over-estimates rather than lets memory through uncounted.
 */
#include "memory.h"

static uint64_t element_bytes(CUarray_format format) {
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    default: return 4;
    }
}

uint64_t gm_array_bytes(size_t width, size_t height, size_t depth, CUarray_format format,
                        unsigned int channels) {
    const uint64_t row_align = 512, granularity = 2u << 20;
    uint64_t row = (uint64_t)width * element_bytes(format) * (channels ? channels : 1);
    row = (row + row_align - 1) / row_align * row_align;
    uint64_t bytes = row * (height ? height : 1) * (depth ? depth : 1);
    return (bytes + granularity - 1) / granularity * granularity;
}
