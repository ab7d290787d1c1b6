/* fuzz_env.c -- libFuzzer target: the DS4_* environment reader (ds4_env_read in ds4.c).
 *
 * The input, split at NUL bytes, becomes the whole environment (environ), e.g.
 * "DS4_THREADS=12\0PATH=/bin". Invariants: ds4_env_read returns 0 with threads in
 * [0, DS4_MAX_THREADS] and cuda_graphs 0 or 1 when every DS4_* name is known and its value
 * valid, or -1 with a non-empty one-line error; never crashes. (The command-line flags of
 * ds4_cli.c: fuzz_cli.c.)
 */
#define _POSIX_C_SOURCE 200809L
#include "../../ds4.c"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *copy = malloc(size + 1);
    char **env = malloc(sizeof(char *) * (size + 2));
    if (!copy || !env) { free(copy); free(env); return 0; }
    memcpy(copy, data, size);
    copy[size] = 0;
    size_t n = 0;
    for (size_t i = 0; i <= size; ) {       /* NUL-separated strings, the empty ones skipped */
        size_t len = strlen(copy + i);
        if (len) env[n++] = copy + i;
        i += len + 1;
    }
    env[n] = NULL;
    char **saved = environ;
    environ = env;
    ds4_env e;
    char err[512];
    err[0] = 0;
    int rc = ds4_env_read(&e, err, sizeof err);
    environ = saved;
    if (rc == 0) {
        if (e.threads < 0 || e.threads > DS4_MAX_THREADS) { fprintf(stderr, "fuzz_env: threads %d out of range\n", e.threads); abort(); }
        if (e.cuda_graphs != 0 && e.cuda_graphs != 1) { fprintf(stderr, "fuzz_env: cuda_graphs %d\n", e.cuda_graphs); abort(); }
        if (e.launch_trace && !e.launch_trace[0]) { fprintf(stderr, "fuzz_env: empty launch_trace accepted\n"); abort(); }
        if (e.graph_layers < 0 || e.graph_layers > 1024 || e.graph_cache < 1 || e.graph_cache > 4096 ||
            e.graph_fail < 0 || e.graph_fail > 1000000 || (e.graph_pdl != 0 && e.graph_pdl != 1)) {
            fprintf(stderr, "fuzz_env: graph settings %d %d %d %d out of range\n", e.graph_layers, e.graph_cache,
                    e.graph_fail, e.graph_pdl);
            abort();
        }
        if ((e.hooks && !e.hooks[0]) || !e.hooks_out || !e.hooks_out[0] || (e.hooks_drop != 0 && e.hooks_drop != 1) ||
            e.hooks_ring_mb < 0 || e.hooks_ring_mb > 65536 || e.hooks_throttle_us < 0 || e.hooks_throttle_us > 1000000) {
            fprintf(stderr, "fuzz_env: hook settings accepted out of range\n");
            abort();
        }
        if (e.rollback_restore < 0 || e.rollback_restore > 3 ||
            (e.mtp_force_file && (!e.mtp_force_file[0] || !(e.mtp_force_p >= 0.0f && e.mtp_force_p <= 1.0f)))) {
            fprintf(stderr, "fuzz_env: DS4_ROLLBACK_RESTORE or DS4_MTP_FORCE accepted out of range\n");
            abort();
        }
    } else if (rc != -1 || !err[0]
#ifndef DS4_FUZZ_ENV_ALLOW_NL   /* for a long run past the known finding (crashers/env/) */
               || strchr(err, '\n')
#endif
               ) {
        fprintf(stderr, "fuzz_env: rc %d, error '%s' (want -1 and one non-empty line)\n", rc, err);
        abort();
    }
    free(env);
    free(copy);
    return 0;
}
