/*
 * test_prompt_cache.c - the prompt-cache directory cannot serve wrong output (issue 26):
 * an engine on a copy of the bundled model writes entries; each corruption below is
 * applied to a fresh copy of that directory, a new engine starts on it, and
 *   - the corrupted entry is refused (counted in tqkv_engine_stats.prompt_cache_refused,
 *     a line on stderr at default verbosity), every intact one still loads;
 *   - the request that the corrupted entry would have answered gives exactly the output
 *     of an engine without any cache (0 wrong outputs).
 * Cases: stored token key altered (to another prompt's prefix), payload byte altered,
 * model weights changed in place (same size and config), FIFO, 3 GiB sparse junk file
 * (start-up under 1 s, nothing read), symlink (to an intact entry outside the directory,
 * and to /dev/zero), a directory, an old-format file, a file truncated or extended.
 * Nothing here may hang: the process has an alarm.
 */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine_helpers.h"
#include "testutil.h"
#include "tqkv_engine.h"

static char g_src[4096];        /* the bundled model */
static char g_model[512];       /* its copy (weights altered by one case) */
static char g_base[512];        /* the directory the first engine wrote */
static char g_work[512];        /* a corrupted copy of g_base */
static char g_err[512];         /* stderr of the last engine init */

#define CHUNK 32

static void sh(const char *fmt, const char *a, const char *b) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, fmt, a, b);
    if (system(cmd) != 0) fail_msg("command failed: %s", cmd);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* An engine on the model copy with the prompt cache in dir (NULL: no cache); its init's
 * stderr goes to g_err. *init_s gets the init time. */
static tqkv_engine *open_engine(const char *dir, double *init_s) {
    fflush(stderr);
    int saved = dup(2);
    int fd = open(g_err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    close(fd);
    double t = now_s();
    tqkv_engine *e = engine_open(g_model, TQKV_TQ4, CHUNK, dir ? (size_t)64 << 20 : 0, dir, 0, NULL, 0, 0);
    if (init_s) *init_s = now_s() - t;
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    return e;
}

static char *read_err(void) {
    FILE *f = fopen(g_err, "rb");
    static char buf[16384];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    return buf;
}

static uint64_t refused(tqkv_engine *e) {
    tqkv_engine_stats st;
    OK(tqkv_engine_stats_get(e, &st));
    return st.prompt_cache_refused;
}

/* The entry file of g_base with the most tokens (its path in out). */
static int biggest_entry(const char *dir, char *out, size_t cap) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int best = -1;
    while ((de = readdir(d))) {
        const char *dash = strrchr(de->d_name, '-');
        size_t nl = strlen(de->d_name);
        if (!dash || nl < 7 || strcmp(de->d_name + nl - 6, ".tqkvp")) continue;
        int n = atoi(dash + 1);
        if (n > best) {
            best = n;
            snprintf(out, cap, "%s/%s", dir, de->d_name);
        }
    }
    closedir(d);
    assert_true(best > 0);
    return best;
}

static void fresh_work(void) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", g_work, g_base, g_work);
    if (system(cmd) != 0) fail_msg("command failed: %s", cmd);
}

/* Patch len bytes at off of file path. */
static void patch(const char *path, long off, const void *bytes, size_t len) {
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, bytes, len, off), (ssize_t)len);
    close(fd);
}

typedef struct {
    job    a, c;          /* a: wrote the entries; c: another prompt of a's length */
    result cold_a, cold_c;
    int    n_entry;       /* tokens of a's biggest entry */
    char   entry[1024];
} world;

static world W;

/* Run j on e; its output must equal cold and it must not be served from a refused entry. */
static void expect_cold(tqkv_engine *e, const job *j, const result *cold, int *wrong) {
    result r;
    submit(e, j, &r);
    run_until_idle(e);
    assert_int_equal(r.done, 1);
    int same = r.n_tok == cold->n_tok && !memcmp(r.toks, cold->toks, sizeof(int32_t) * (size_t)r.n_tok) &&
               !memcmp(r.lp, cold->lp, sizeof(float) * (size_t)r.n_tok);
    if (!same) (*wrong)++;
    assert_same_tokens(&r, cold);
}

// ---------------------------------------------------------------------------
// Setup: model copy, cold outputs, the entries
// ---------------------------------------------------------------------------

static int setup(void **state) {
    (void)state;
    int pid = (int)getpid();
    snprintf(g_model, sizeof g_model, "/tmp/tqkv_pcm_%d", pid);
    snprintf(g_base, sizeof g_base, "/tmp/tqkv_pcb_%d", pid);
    snprintf(g_work, sizeof g_work, "/tmp/tqkv_pcw_%d", pid);
    snprintf(g_err, sizeof g_err, "/tmp/tqkv_pce_%d.txt", pid);
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "rm -rf %s %s %s && cp -r '%s' %s", g_model, g_base, g_work, g_src, g_model);
    if (system(cmd) != 0) return -1;
    test_rng r;
    rng_init(&r, test_seed() ^ 26);
    tqkv_engine *e = open_engine(NULL, NULL);
    int V = tqkv_model_get_config(tqkv_engine_model(e))->vocab_size;
    memset(&W, 0, sizeof W);
    W.a.n_prompt = 150;
    for (int t = 0; t < W.a.n_prompt; t++) W.a.prompt[t] = rng_int(&r, 1, V - 1);
    W.a.max_tokens = 10;
    W.a.top_logprobs = 2;
    W.c = W.a;
    for (int t = 0; t < W.c.n_prompt; t++) W.c.prompt[t] = rng_int(&r, 1, V - 1);
    submit(e, &W.a, &W.cold_a);
    run_until_idle(e);
    submit(e, &W.c, &W.cold_c);
    run_until_idle(e);
    tqkv_engine_free(e);
    /* the entries of a */
    e = open_engine(g_base, NULL);
    result ra;
    submit(e, &W.a, &ra);
    run_until_idle(e);
    tqkv_engine_free(e);
    W.n_entry = biggest_entry(g_base, W.entry, sizeof W.entry);
    printf("entries written; biggest holds %d tokens (%s)\n", W.n_entry, W.entry);
    /* intact: a restart serves a from the entry, output unchanged */
    e = open_engine(g_base, NULL);
    submit(e, &W.a, &ra);
    run_until_idle(e);
    assert_int_equal(refused(e), 0);
    assert_int_equal(ra.cached, W.n_entry);
    assert_same_tokens(&ra, &W.cold_a);
    tqkv_engine_free(e);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "rm -rf %s %s %s %s", g_model, g_base, g_work, g_err);
    return system(cmd) == 0 ? 0 : -1;
}

/* g_work's name of the biggest entry file. */
static void work_entry(char *out, size_t cap) {
    snprintf(out, cap, "%s/%s", g_work, strrchr(W.entry, '/') + 1);
}

// ---------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------

/* The stored token key rewritten to c's prefix: unchecked, c would get a's state. */
static void test_altered_token_key(void **state) {
    (void)state;
    fresh_work();
    char path[1024];
    work_entry(path, sizeof path);
    /* header 40 bytes + desc; the desc length is at offset 16 */
    FILE *f = fopen(path, "rb");
    uint32_t dl = 0;
    assert_int_equal(fseek(f, 16, SEEK_SET), 0);
    assert_int_equal(fread(&dl, 4, 1, f), 1);
    fclose(f);
    patch(path, 40 + (long)dl, W.c.prompt, sizeof(int32_t) * (size_t)W.n_entry);
    tqkv_engine *e = open_engine(g_work, NULL);
    assert_int_equal(refused(e), 1);
    assert_non_null(strstr(read_err(), "checksum mismatch"));
    int wrong = 0;
    result rc;
    submit(e, &W.c, &rc);
    run_until_idle(e);
    assert_int_equal(rc.cached, 0);
    expect_cold(e, &W.c, &W.cold_c, &wrong);
    expect_cold(e, &W.a, &W.cold_a, &wrong);
    assert_int_equal(wrong, 0);
    tqkv_engine_free(e);
}

/* One byte of the state payload flipped (and, separately, the last byte). */
static void test_altered_payload(void **state) {
    (void)state;
    for (int where = 0; where < 2; where++) {
        fresh_work();
        char path[1024];
        work_entry(path, sizeof path);
        struct stat st;
        assert_int_equal(stat(path, &st), 0);
        long off = where ? (long)st.st_size - 1 : (long)st.st_size / 2;
        unsigned char b;
        FILE *f = fopen(path, "rb");
        assert_int_equal(fseek(f, off, SEEK_SET), 0);
        assert_int_equal(fread(&b, 1, 1, f), 1);
        fclose(f);
        b ^= 0x10;
        patch(path, off, &b, 1);
        tqkv_engine *e = open_engine(g_work, NULL);
        assert_int_equal(refused(e), 1);
        assert_non_null(strstr(read_err(), "refused"));
        int wrong = 0;
        expect_cold(e, &W.a, &W.cold_a, &wrong);
        assert_int_equal(wrong, 0);
        tqkv_engine_free(e);
    }
}

/* The file cut short by 1 byte and extended by 1 byte. */
static void test_truncated_extended(void **state) {
    (void)state;
    for (int grow = 0; grow < 2; grow++) {
        fresh_work();
        char path[1024];
        work_entry(path, sizeof path);
        struct stat st;
        assert_int_equal(stat(path, &st), 0);
        assert_int_equal(truncate(path, st.st_size + (grow ? 1 : -1)), 0);
        tqkv_engine *e = open_engine(g_work, NULL);
        assert_int_equal(refused(e), 1);
        int wrong = 0;
        expect_cold(e, &W.a, &W.cold_a, &wrong);
        assert_int_equal(wrong, 0);
        tqkv_engine_free(e);
    }
}

/* Weights changed in place: same files, sizes and config; one weight byte differs. The
 * entries of the old weights are refused and the output is the new model's cold output. */
static void test_weights_changed(void **state) {
    (void)state;
    fresh_work();
    char w[1024];
    snprintf(w, sizeof w, "%s/model-00002-of-00004.safetensors", g_model);
    struct stat st;
    assert_int_equal(stat(w, &st), 0);
    long off = (long)st.st_size - 2; /* low byte of the last bf16 weight: a small change */
    unsigned char b, orig;
    FILE *f = fopen(w, "rb");
    assert_int_equal(fseek(f, off, SEEK_SET), 0);
    assert_int_equal(fread(&orig, 1, 1, f), 1);
    fclose(f);
    b = orig ^ 0x01;
    patch(w, off, &b, 1);
    struct stat st2;
    assert_int_equal(stat(w, &st2), 0);
    assert_int_equal(st2.st_size, st.st_size);
    /* the cold output of the changed model */
    tqkv_engine *e = open_engine(NULL, NULL);
    result cold;
    submit(e, &W.a, &cold);
    run_until_idle(e);
    tqkv_engine_free(e);
    e = open_engine(g_work, NULL);
    uint64_t nref = refused(e);
    tqkv_engine_stats sts;
    OK(tqkv_engine_stats_get(e, &sts));
    printf("weights changed: %llu entries refused, %zu prefix bytes loaded\n",
           (unsigned long long)nref, sts.prefix_cache_bytes);
    assert_true(nref >= 1);
    assert_int_equal(sts.prefix_cache_bytes, 0); /* nothing of the old weights is used */
    assert_non_null(strstr(read_err(), "other weights"));
    int wrong = 0;
    result r;
    submit(e, &W.a, &r);
    run_until_idle(e);
    assert_int_equal(r.cached, 0);
    expect_cold(e, &W.a, &cold, &wrong);
    assert_int_equal(wrong, 0);
    tqkv_engine_free(e);
    patch(w, off, &orig, 1); /* restore for the other cases */
}

/* Not regular files: a FIFO (would block an open without O_NONBLOCK), a symlink to an
 * intact entry outside the directory, a symlink to /dev/zero, a directory; an old-format
 * file; small junk. Each refused; the intact entry still loads and serves a. */
static void test_not_regular_files(void **state) {
    (void)state;
    fresh_work();
    char p[1024], outside[1024];
    snprintf(p, sizeof p, "%s/fifo.tqkvp", g_work);
    assert_int_equal(mkfifo(p, 0644), 0);
    snprintf(outside, sizeof outside, "%s_outside.tqkvp", g_work);
    sh("cp '%s' '%s'", W.entry, outside);
    snprintf(p, sizeof p, "%s/link-out.tqkvp", g_work);
    assert_int_equal(symlink(outside, p), 0);
    snprintf(p, sizeof p, "%s/link-zero.tqkvp", g_work);
    assert_int_equal(symlink("/dev/zero", p), 0);
    snprintf(p, sizeof p, "%s/dir.tqkvp", g_work);
    assert_int_equal(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/old.tqkvp", g_work);
    FILE *f = fopen(p, "wb");
    const char old_head[48] = "TQKVPC01"; /* the old magic, the rest zero */
    fwrite(old_head, 1, sizeof old_head, f);
    fclose(f);
    snprintf(p, sizeof p, "%s/junk.tqkvp", g_work);
    f = fopen(p, "wb");
    fwrite("hello, not a cache file at all\n", 1, 31, f);
    fclose(f);
    double t = 0;
    tqkv_engine *e = open_engine(g_work, &t);
    const char *err = read_err();
    printf("non-regular files: refused %llu, init %.2f s\n%s", (unsigned long long)refused(e), t, err);
    assert_int_equal(refused(e), 6);
    assert_non_null(strstr(err, "fifo.tqkvp is not a regular file"));
    assert_non_null(strstr(err, "link-out.tqkvp is a symbolic link"));
    assert_non_null(strstr(err, "link-zero.tqkvp is a symbolic link"));
    assert_non_null(strstr(err, "dir.tqkvp is not a regular file"));
    assert_non_null(strstr(err, "old format"));
    assert_non_null(strstr(err, "6 refused"));
    int wrong = 0;
    result r;
    submit(e, &W.a, &r);
    run_until_idle(e);
    assert_int_equal(r.cached, W.n_entry); /* the intact entry is still used */
    assert_same_tokens(&r, &W.cold_a);
    expect_cold(e, &W.c, &W.cold_c, &wrong);
    assert_int_equal(wrong, 0);
    tqkv_engine_free(e);
    unlink(outside);
}

/* A 3 GiB sparse junk file, and a 3 GiB sparse file with a valid header: refused from
 * their size; the directory's load takes well under 1 s (the import API times it). */
static void test_huge_junk(void **state) {
    (void)state;
    fresh_work();
    char p[1024], q[1024];
    snprintf(p, sizeof p, "%s/huge.tqkvp", g_work);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)3 << 30), 0);
    close(fd);
    snprintf(q, sizeof q, "%s/huge-header.tqkvp", g_work);
    sh("cp '%s' '%s'", W.entry, q);
    assert_int_equal(truncate(q, (off_t)3 << 30), 0);
    double t = 0;
    tqkv_engine *e = open_engine(g_work, &t);
    assert_int_equal(refused(e), 2);
    assert_non_null(strstr(read_err(), "over the"));
    /* each file's refusal alone, timed through the import API (the bound: the
     * junk adds under 1 s to start-up; reading 3 GiB would take seconds) */
    const char *files[] = {p, q};
    for (int i = 0; i < 2; i++) {
        double t0 = now_s();
        assert_int_equal(tqkv_engine_prefix_import(e, files[i]), TQKV_ECORRUPT);
        double dt = now_s() - t0;
        printf("3 GiB sparse file %d refused in %.6f s: %s\n", i, dt, tqkv_last_error());
        assert_true(dt < 1.0);
    }
    printf("engine init with both files in the directory: %.3f s\n", t);
    int wrong = 0;
    expect_cold(e, &W.c, &W.cold_c, &wrong);
    assert_int_equal(wrong, 0);
    tqkv_engine_free(e);
}

int main(void) {
    source_path("models/qwen3-code-28m", g_src, sizeof g_src);
    struct stat s;
    if (stat(g_src, &s) != 0) {
        fprintf(stderr, "test_prompt_cache: bundled model absent: SKIPPED\n");
        return 77;
    }
    alarm(900); /* a hang (a FIFO opened blocking) fails the test instead of stalling it */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_altered_token_key),
        cmocka_unit_test(test_altered_payload),
        cmocka_unit_test(test_truncated_extended),
        cmocka_unit_test(test_weights_changed),
        cmocka_unit_test(test_not_regular_files),
        cmocka_unit_test(test_huge_junk),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
