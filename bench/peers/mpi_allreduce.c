/*
 * mpi_allreduce.c -- OpenMPI peer baseline for ddp-rs's allreduce benchmark.
 *
 * Measures MPI_Allreduce(MPI_FLOAT, MPI_SUM) over message sizes from
 * --min-bytes to --max-bytes in x4 steps and prints nccl-tests style rows:
 *
 *     bytes  time_us  algbw_GBs  busbw_GBs  wrong
 *
 * (or, with --json, one object per line with keys
 *  bytes, time_us, algbw_gbs, busbw_gbs, wrong).
 *
 * Timing: for every iteration all ranks MPI_Barrier, then each rank times its
 * own MPI_Allreduce with MPI_Wtime; the per-iteration time is the max over
 * ranks, and the reported time is the median over iterations.
 *   algbw = bytes / time,  busbw = algbw * 2(N-1)/N      (GB = 1e9 bytes)
 * `wrong` is the number of mismatching elements (summed over ranks) in a
 * separate correctness pass with known inputs; it should always be 0.
 *
 * --nonblocking: MPI_Iallreduce completed by an MPI_Test loop instead (Open MPI runs it in
 * libnbc, not in the tuned component of the blocking call); the baseline of ddp-comm's mpi
 * backend, which issues every collective non-blocking (bench/peers/mpi_compare.sh).
 *
 * --thread-multiple: initialize with MPI_Init_thread(MPI_THREAD_MULTIPLE), the level ddp-comm asks
 * for (Open MPI then takes its locks on every call), to separate that cost from our layer's.
 *
 * Build:  mpicc -O2 -o mpi_allreduce bench/peers/mpi_allreduce.c
 * Run:    mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_allreduce \
 *             --min-bytes 1024 --max-bytes 67108864 [--iters 20] [--warmup 5] [--json]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int nonblocking = 0;

/* MPI_Allreduce, or MPI_Iallreduce + MPI_Test until done (--nonblocking). */
static int allreduce(void *buf, int count) {
    if (!nonblocking)
        return MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Request req;
    int done = 0, rc = MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
    while (rc == MPI_SUCCESS && !done) rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static long long parse_size(const char *s) {
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    if (end && (*end == 'K' || *end == 'k')) v *= 1024LL;
    else if (end && (*end == 'M' || *end == 'm')) v *= 1024LL * 1024LL;
    else if (end && (*end == 'G' || *end == 'g')) v *= 1024LL * 1024LL * 1024LL;
    return v;
}

static void usage(int rank) {
    if (rank == 0)
        fprintf(stderr,
                "usage: mpi_allreduce [--min-bytes N] [--max-bytes N] [--iters N] "
                "[--small-iters N] [--warmup N] [--nonblocking] [--thread-multiple] [--json]\n"
                "  sizes accept K/M/G suffixes (binary); sizes < 1 MiB use --small-iters\n");
}

int main(int argc, char **argv) {
    int multiple = 0;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--thread-multiple")) multiple = 1;
    if (multiple) {
        int provided = 0;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
        if (provided != MPI_THREAD_MULTIPLE) {
            fprintf(stderr, "mpi_allreduce: MPI_THREAD_MULTIPLE not granted (%d)\n", provided);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    } else {
        MPI_Init(&argc, &argv);
    }
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    long long min_bytes = 1024, max_bytes = 64LL * 1024 * 1024;
    int iters = 20, small_iters = 200, warmup = 5, json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = (i + 1 < argc) ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) { json = 1; continue; }
        if (!strcmp(a, "--nonblocking")) { nonblocking = 1; continue; }
        if (!strcmp(a, "--thread-multiple")) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(rank); MPI_Finalize(); return 0; }
        if (!v) { usage(rank); MPI_Abort(MPI_COMM_WORLD, 2); }
        if (!strcmp(a, "--min-bytes")) min_bytes = parse_size(v);
        else if (!strcmp(a, "--max-bytes")) max_bytes = parse_size(v);
        else if (!strcmp(a, "--iters")) iters = atoi(v);
        else if (!strcmp(a, "--small-iters")) small_iters = atoi(v);
        else if (!strcmp(a, "--warmup")) warmup = atoi(v);
        else {
            if (rank == 0) fprintf(stderr, "mpi_allreduce: unknown argument '%s'\n", a);
            usage(rank);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        i++;
    }
    if (min_bytes < 4 || max_bytes < min_bytes || iters < 1 || small_iters < 1 || warmup < 0) {
        if (rank == 0)
            fprintf(stderr, "mpi_allreduce: bad arguments (min-bytes=%lld max-bytes=%lld iters=%d)\n",
                    min_bytes, max_bytes, iters);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    size_t max_count = (size_t)(max_bytes / 4);
    int max_iters = iters > small_iters ? iters : small_iters;
    float *buf = malloc(max_count * sizeof(float));
    double *t = malloc((size_t)max_iters * sizeof(double));
    double *tmax = malloc((size_t)max_iters * sizeof(double));
    if (!buf || !t || !tmax) {
        fprintf(stderr, "mpi_allreduce: rank %d: out of memory for %zu floats\n", rank, max_count);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    if (rank == 0) {
        printf("# mpi_allreduce: MPI_Allreduce float sum, world=%d, warmup=%d, iters=%d (small-iters=%d "
               "below 1 MiB), time = median over iters of max-over-ranks per-iteration time\n",
               world, warmup, iters, small_iters);
        if (!json) printf("%12s %12s %10s %10s %6s\n", "bytes", "time_us", "algbw_GBs", "busbw_GBs", "wrong");
        fflush(stdout);
    }

    double lat_1k = -1, lat_4k = -1;
    for (long long bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
        int count = (int)(bytes / 4);
        int n = bytes < 1024 * 1024 ? small_iters : iters;
        for (int j = 0; j < count; j++) buf[j] = 1.0f;
        for (int w = 0; w < warmup; w++) {
            allreduce(buf, count);
            for (int j = 0; j < count; j++) buf[j] = 1.0f; /* keep values finite */
        }
        for (int it = 0; it < n; it++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            allreduce(buf, count);
            t[it] = MPI_Wtime() - t0;
        }
        MPI_Allreduce(t, tmax, n, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        qsort(tmax, (size_t)n, sizeof(double), cmp_double);
        double med = (n % 2) ? tmax[n / 2] : 0.5 * (tmax[n / 2 - 1] + tmax[n / 2]);

        /* correctness pass: element j on rank r is (r+1)*(j%97); sum is known exactly. */
        for (int j = 0; j < count; j++) buf[j] = (float)((rank + 1) * (j % 97));
        allreduce(buf, count);
        long long wrong = 0, wrong_all = 0;
        float ranksum = (float)world * (float)(world + 1) / 2.0f;
        for (int j = 0; j < count; j++)
            if (buf[j] != ranksum * (float)(j % 97)) wrong++;
        MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);

        double time_us = med * 1e6;
        double algbw = (double)bytes / med / 1e9;
        double busbw = algbw * 2.0 * (world - 1) / world;
        if (bytes == 1024) lat_1k = time_us;
        if (bytes == 4096) lat_4k = time_us;
        if (rank == 0) {
            if (json)
                printf("{\"bytes\": %lld, \"time_us\": %.3f, \"algbw_gbs\": %.6f, \"busbw_gbs\": %.6f, "
                       "\"wrong\": %lld}\n",
                       bytes, time_us, algbw, busbw, wrong_all);
            else
                printf("%12lld %12.2f %10.4f %10.4f %6lld\n", bytes, time_us, algbw, busbw, wrong_all);
            fflush(stdout);
        }
    }
    if (rank == 0) {
        if (lat_1k >= 0) printf("# latency 1 KiB: %.2f us\n", lat_1k);
        if (lat_4k >= 0) printf("# latency 4 KiB: %.2f us\n", lat_4k);
        fflush(stdout);
    }
    free(buf);
    free(t);
    free(tmax);
    MPI_Finalize();
    return 0;
}
