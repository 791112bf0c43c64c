/* The physical limit of a KV gather/scatter on this machine, per layout, without torch or Python.
 *
 * Each variant copies the same bytes two ways, interleaved: one contiguous memcpy (what "raw
 * copy" means in the benchmarks) and the layout's own pieces between random blocks of a paged
 * pool and 4 token-major chunks of 256 tokens (64 random blocks, the kvactors.bench_transfer
 * workload). Medians of the interleaved repetitions are compared; the ratio is the ceiling for
 * kvactors' "vs raw" figure of that layout and direction.
 *
 *   nhd: 32 layers, K/V, 1024 blocks of [16 tokens][8 heads][128] bf16; one block plane is one
 *        32 KiB run, copied as is (pool 2 GiB, chunks 128 MiB).
 *   mla: 32 layers, 1024 blocks of [16 tokens][576] bf16; one block is one 18 KiB run
 *        (pool 576 MiB, chunks 36 MiB).
 *   hnd: as nhd, but a block plane is [8 heads][16 tokens][128]: moving it transposes it to
 *        token-major rows [16][8*128], i.e. 128 runs of 256 bytes, permuted. "dst order" walks
 *        the token-major side sequentially, "src order" the head-major side.
 *   nhd separate: as nhd, but every layer is its own allocation (64 MiB each).
 *
 * `kvactors bench` (kvactors.cli.bench.ceiling) compiles the same memcpy loop at bench time and
 * runs it on the benchmark's own tensors, interleaved with kvactors; this program is the
 * stand-alone version, with no Python process around it.
 *
 *   gcc -O2 benchmarks/gather_limit.c -o /tmp/gather_limit && /tmp/gather_limit
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NL 32
#define NB 1024
#define BS 16
#define NH 8
#define HS 128
#define MLA_HS 576
#define NBLK 64 /* 4 chunks x 16 blocks */
#define BPO 16
#define REPS 21
#define ESZ 2

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static char *pool, *chunk, *src, *layer_pool[NL];
static size_t ids[NBLK];

enum { NHD, MLA, HND_DST, HND_SRC, NHD_SEP };
static const char *names[] = {"nhd", "mla", "hnd (dst order)", "hnd (src order)", "nhd separate"};

static size_t chunk_bytes(int lay) {
    return lay == MLA ? (size_t)NBLK * NL * BS * MLA_HS * ESZ : (size_t)NBLK * NL * 2 * BS * NH * HS * ESZ;
}

/* One block's 256-byte runs between the head-major pool block and the token-major chunk rows. */
static void hnd_block(char *rows, char *blk, int gather, int dst_order) {
    const size_t RUN = HS * ESZ;
    for (size_t a = 0; a < (dst_order ? BS : NH); a++)
        for (size_t b = 0; b < (dst_order ? NH : BS); b++) {
            size_t s = dst_order ? a : b, h = dst_order ? b : a;
            char *r = rows + (s * NH + h) * RUN, *k = blk + (h * BS + s) * RUN;
            if (gather)
                memcpy(r, k, RUN);
            else
                memcpy(k, r, RUN);
        }
}

/* The layout's transfer: chunk[c][p][l][j] <-> pool[l][p][ids[c*BPO+j]] (contract 3.2 order). */
static void transfer(int lay, int gather) {
    size_t planes = lay == MLA ? 1 : 2;
    size_t piece = lay == MLA ? (size_t)BS * MLA_HS * ESZ : (size_t)BS * NH * HS * ESZ;
    char *o = chunk;
    for (size_t c = 0; c < NBLK / BPO; c++)
        for (size_t p = 0; p < planes; p++)
            for (size_t l = 0; l < NL; l++)
                for (size_t j = 0; j < BPO; j++, o += piece) {
                    char *blk = lay == NHD_SEP
                                    ? layer_pool[l] + (p * NB + ids[c * BPO + j]) * piece
                                    : pool + ((l * planes + p) * NB + ids[c * BPO + j]) * piece;
                    if (lay == HND_DST || lay == HND_SRC)
                        hnd_block(o, blk, gather, lay == HND_DST);
                    else if (gather)
                        memcpy(o, blk, piece);
                    else
                        memcpy(blk, o, piece);
                }
}

static void run(int lay, int gather) {
    size_t n = chunk_bytes(lay);
    double raw[REPS], lay_t[REPS];
    transfer(lay, gather); /* warm-up */
    memcpy(chunk, src, n);
    for (size_t r = 0; r < REPS; r++) {
        double t0 = now();
        memcpy(chunk, src, n);
        double t1 = now();
        transfer(lay, gather);
        double t2 = now();
        raw[r] = t1 - t0;
        lay_t[r] = t2 - t1;
    }
    qsort(raw, REPS, sizeof raw[0], cmp);
    qsort(lay_t, REPS, sizeof lay_t[0], cmp);
    double mr = raw[REPS / 2], ml = lay_t[REPS / 2];
    printf("%-16s %-8s %4zu MiB: raw memcpy %6.2f GB/s, layout %6.2f GB/s, ratio %.2f\n", names[lay],
           gather ? "gather" : "scatter", n >> 20, n / mr / 1e9, n / ml / 1e9, mr / ml);
}

int main(void) {
    size_t pool_sz = (size_t)NL * 2 * NB * BS * NH * HS * ESZ, out_sz = chunk_bytes(NHD);
    pool = malloc(pool_sz);
    chunk = malloc(out_sz);
    src = malloc(out_sz);
    if (!pool || !chunk || !src) return 1;
    memset(pool, 1, pool_sz);
    for (size_t l = 0; l < NL; l++) { /* the per-layer allocations of "nhd separate" */
        layer_pool[l] = malloc(pool_sz / NL);
        if (!layer_pool[l]) return 1;
        memset(layer_pool[l], 1, pool_sz / NL);
    }
    memset(chunk, 0, out_sz);
    memset(src, 2, out_sz);
    srand(0);
    for (size_t i = 0; i < NBLK; i++) { /* distinct random block ids, as in the benchmark */
    again:
        ids[i] = (size_t)rand() % NB;
        for (size_t k = 0; k < i; k++)
            if (ids[k] == ids[i]) goto again;
    }
    printf("medians of %d interleaved repetitions\n", REPS);
    for (int lay = NHD; lay <= NHD_SEP; lay++)
        for (int g = 1; g >= 0; g--) run(lay, g);
    return 0;
}
