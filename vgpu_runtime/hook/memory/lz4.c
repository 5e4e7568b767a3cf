/*
 * lz4.c: LZ4 block decoding, for the compressed entries of fatbins (images.c). nvcc's and
 * nvFatbin's default compression (entry flag 0x2000) stores each entry as one raw LZ4 block
 * (checked on nvFatbin 12.9's output: tests/hook/data/global-4gib-sm90.lz4.fatbin). The input
 * is a workload's: every read and write is bounds-checked, and a block that is not well formed,
 * or does not fill the output exactly, is refused.
 */
#include <string.h>

#include "memory.h"

/* A length's extension bytes (255 each, then the last): *length grows by each; -1 past cap. */
static int extend(const unsigned char *src, size_t n, size_t *at, size_t *length, size_t cap) {
    unsigned char more;
    do {
        if (*at >= n) return -1;
        more = src[(*at)++];
        *length += more;
        if (*length > cap) return -1;
    } while (more == 255);
    return 0;
}

int64_t gm_lz4_decode(const unsigned char *src, size_t n, unsigned char *dst, size_t cap) {
    size_t at = 0, out = 0;
    if (cap > (size_t)INT64_MAX) return -1;
    while (at < n) {
        unsigned token = src[at++];
        size_t literals = token >> 4;
        if (literals == 15 && extend(src, n, &at, &literals, cap) != 0) return -1;
        if (literals > n - at || literals > cap - out) return -1;
        memcpy(dst + out, src + at, literals);
        at += literals;
        out += literals;
        if (at == n) return (int64_t)out;   /* the last sequence is literals alone */
        if (n - at < 2) return -1;
        size_t offset = (size_t)src[at] | (size_t)src[at + 1] << 8;
        at += 2;
        if (offset == 0 || offset > out) return -1;
        size_t match = token & 15;
        if (match == 15 && extend(src, n, &at, &match, cap) != 0) return -1;
        match += 4;
        if (match > cap - out) return -1;
        for (size_t k = 0; k < match; k++, out++) dst[out] = dst[out - offset];   /* may overlap */
    }
    return -1;   /* empty, or ended on a match: not a whole block */
}
