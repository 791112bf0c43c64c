/* The physical limit of a KV gather on this machine, without torch or Python.
 *
 * Copies the same bytes two ways, interleaved: one contiguous memcpy (what "raw copy" means
 * in the benchmarks), and 32 KiB pieces from random blocks of a 2 GiB pool (NHD, 32 layers,
 * K/V, block 16, 8 heads x 128 bf16: one block plane is 32 KiB), which is what any gather of
 * 4 x 256-token chunks must read. The ratio is the ceiling for kvactors' gather-vs-raw figure.
 *
 *   gcc -O2 benchmarks/gather_limit.c -o /tmp/gather_limit && /tmp/gather_limit
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    const size_t NL = 32, NB = 1024, PIECE = 32768, NBLK = 64, REPS = 15;
    size_t pool_sz = NL * 2 * NB * PIECE, out_sz = NL * 2 * NBLK * PIECE;
    char *pool = malloc(pool_sz), *out = malloc(out_sz), *src = malloc(out_sz);
    if (!pool || !out || !src) return 1;
    memset(pool, 1, pool_sz);
    memset(out, 0, out_sz);
    memset(src, 2, out_sz);
    size_t ids[64];
    srand(0);
    for (size_t i = 0; i < NBLK; i++) ids[i] = (size_t)rand() % NB;
    double raw[15], gat[15];
    for (size_t r = 0; r < REPS; r++) {
        double t0 = now();
        memcpy(out, src, out_sz);
        double t1 = now();
        size_t o = 0;
        for (size_t l = 0; l < NL; l++)
            for (size_t p = 0; p < 2; p++)
                for (size_t j = 0; j < NBLK; j++, o += PIECE)
                    memcpy(out + o, pool + ((l * 2 + p) * NB + ids[j]) * PIECE, PIECE);
        double t2 = now();
        raw[r] = t1 - t0;
        gat[r] = t2 - t1;
    }
    qsort(raw, REPS, sizeof raw[0], cmp);
    qsort(gat, REPS, sizeof gat[0], cmp);
    double mr = raw[REPS / 2], mg = gat[REPS / 2];
    printf("raw memcpy %.2f GB/s, random 32 KiB pieces %.2f GB/s, ratio %.2f (medians of %zu)\n",
           out_sz / mr / 1e9, out_sz / mg / 1e9, mr / mg, REPS);
    return 0;
}
