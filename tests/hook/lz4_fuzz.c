/* Feeds gm_lz4_decode (vgpu_runtime/hook/memory/lz4.c) a real LZ4 block and mutations of it
 * under ASan and UBSan: the real block must decode to the expected bytes exactly, and no
 * mutation may read or write out of bounds or return more than its output's size.
 *   lz4_fuzz BLOCK EXPECTED ITERATIONS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int64_t gm_lz4_decode(const unsigned char *src, size_t n, unsigned char *dst, size_t cap);

static unsigned char *slurp(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    rewind(f);
    unsigned char *data = malloc(*size ? *size : 1);
    if (fread(data, 1, *size, f) != *size) exit(2);
    fclose(f);
    return data;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    size_t n, want;
    unsigned char *block = slurp(argv[1], &n), *expected = slurp(argv[2], &want);
    long iterations = atol(argv[3]);
    unsigned char *out = malloc(want);
    if (gm_lz4_decode(block, n, out, want) != (int64_t)want || memcmp(out, expected, want)) {
        fprintf(stderr, "the real block did not decode to the expected bytes\n");
        return 1;
    }
    if (gm_lz4_decode(block, n, out, want - 1) != -1) {
        fprintf(stderr, "a block that does not fit was not refused\n");
        return 1;
    }
    srand(7);
    long decoded = 0;
    for (long i = 0; i < iterations; i++) {
        size_t len = (size_t)rand() % (n + 16);
        unsigned char *mutant = malloc(len ? len : 1);   /* exact size: ASan sees overreads */
        memcpy(mutant, block, len < n ? len : n);
        for (size_t k = n; k < len; k++) mutant[k] = (unsigned char)rand();
        for (int flips = rand() % 4; flips > 0 && len > 0; flips--)
            mutant[(size_t)rand() % len] = (unsigned char)rand();
        size_t cap = (size_t)rand() % (want + want / 2 + 1);
        unsigned char *dst = malloc(cap ? cap : 1);
        int64_t got = gm_lz4_decode(mutant, len, dst, cap);
        if (got > (int64_t)cap || got < -1) {
            fprintf(stderr, "returned %lld\n", (long long)got);
            return 1;
        }
        decoded += got >= 0;
        free(dst);
        free(mutant);
    }
    printf("%ld %ld\n", iterations, decoded);
    free(out);
    free(block);
    free(expected);
    return 0;
}
