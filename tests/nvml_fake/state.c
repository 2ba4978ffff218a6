/*
 * nvml-fake: the state file, read and re-read when it changes (docs/nvml_fake.md).
 *
 *   NVML_FAKE_STATE=<file>        the state file to read
 *   NVML_FAKE_SCENARIO=<yaml>     a scenario: rendered into a state file by
 *                                 `$NVML_FAKE_PYTHON -m node_agent.sim.nvml_state` (YAML stays in
 *                                 Python), into $NVML_FAKE_STATE when that is set, else into a
 *                                 temporary file removed at nvmlShutdown; rendered again when the
 *                                 scenario changes
 *   NVML_FAKE_PYTHON=<python>     the interpreter for that; default: this process's own when it
 *                                 is Python (argv[0] of /proc/self/cmdline), else python3
 *
 * A file "changes" when its inode, size, mtime or ctime does (writers replace it with rename,
 * so a reader never sees half a file).
 */
#define _GNU_SOURCE
#include "nvml_fake.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    struct timespec ctime;
} file_id_t;

static fake_state_t *g_state;       /* what the NVML entry points read */
static char g_state_path[4096];     /* the file it was read from */
static file_id_t g_state_id;        /* that file as last read */
static file_id_t g_scenario_id;     /* the scenario as last rendered */
static char g_rendered_path[4096];  /* a temporary state file this library made, or "" */
static char g_last_error[512];      /* the last problem reported, so it is said once */

void fake_lock(void) { pthread_mutex_lock(&g_mutex); }
void fake_unlock(void) { pthread_mutex_unlock(&g_mutex); }
int fake_trylock(void) { return pthread_mutex_trylock(&g_mutex); }

const fake_state_t *fake_state(void) { return g_state; }

static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void report(const char *fmt, ...)
{
    char message[sizeof g_last_error];
    va_list args;
    va_start(args, fmt);
    vsnprintf(message, sizeof message, fmt, args);
    va_end(args);
    if (strcmp(message, g_last_error) == 0)
        return;
    snprintf(g_last_error, sizeof g_last_error, "%s", message);
    fprintf(stderr, "nvml-fake: %s\n", message);
}

static int file_id(const char *path, file_id_t *id)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return -1;
    id->valid = 1;
    id->dev = st.st_dev;
    id->ino = st.st_ino;
    id->size = st.st_size;
    id->mtime = st.st_mtim;
    id->ctime = st.st_ctim;
    return 0;
}

static int same_file(const file_id_t *a, const file_id_t *b)
{
    return a->valid && b->valid && a->dev == b->dev && a->ino == b->ino && a->size == b->size
        && a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec
        && a->ctime.tv_sec == b->ctime.tv_sec && a->ctime.tv_nsec == b->ctime.tv_nsec;
}

/* -- sections ------------------------------------------------------------------------------- */

const char *fake_get_nth(const fake_section_t *section, const char *key, size_t n)
{
    for (size_t i = 0; i < section->count; i++)
        if (strcmp(section->entries[i].key, key) == 0 && n-- == 0)
            return section->entries[i].value;
    return NULL;
}

const char *fake_get(const fake_section_t *section, const char *key)
{
    for (size_t i = section->count; i-- > 0;)
        if (strcmp(section->entries[i].key, key) == 0)
            return section->entries[i].value;
    return NULL;
}

int fake_has_prefix(const fake_section_t *section, const char *prefix)
{
    size_t len = strlen(prefix);
    for (size_t i = 0; i < section->count; i++)
        if (strncmp(section->entries[i].key, prefix, len) == 0)
            return 1;
    return 0;
}

static int section_add(fake_section_t *section, const char *key, const char *value)
{
    if (section->count == section->capacity) {
        size_t capacity = section->capacity ? section->capacity * 2 : 64;
        fake_entry_t *grown = realloc(section->entries, capacity * sizeof *grown);
        if (!grown)
            return -1;
        section->entries = grown;
        section->capacity = capacity;
    }
    fake_entry_t *entry = &section->entries[section->count++];
    snprintf(entry->key, sizeof entry->key, "%s", key);
    snprintf(entry->value, sizeof entry->value, "%s", value);
    return 0;
}

static void state_free(fake_state_t *state)
{
    if (!state)
        return;
    free(state->global.entries);
    for (unsigned i = 0; i < FAKE_MAX_GPUS; i++)
        free(state->gpu[i].entries);
    free(state);
}

/* -- parsing -------------------------------------------------------------------------------- */

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    char *end = s + strlen(s);
    while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r'))
        *--end = '\0';
    return s;
}

/* Parse a state file; NULL with the reason in why. */
static fake_state_t *parse(const char *path, char *why, size_t why_len)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(why, why_len, "cannot read state file %s: %s", path, strerror(errno));
        return NULL;
    }
    fake_state_t *state = calloc(1, sizeof *state);
    if (!state) {
        fclose(f);
        snprintf(why, why_len, "out of memory reading %s", path);
        return NULL;
    }
    fake_section_t *section = &state->global;
    char line[FAKE_KEY_MAX + FAKE_VALUE_MAX + 64];
    int lineno = 0, header = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            snprintf(why, why_len, "%s:%d: line too long", path, lineno);
            goto fail;
        }
        char *text = trim(line);
        if (*text == '\0' || *text == '#')
            continue;
        if (!header) {
            int version = 0;
            if (sscanf(text, "nvml-fake-state %d", &version) != 1 || version != FAKE_STATE_FORMAT) {
                snprintf(why, why_len, "%s:%d: expected the header 'nvml-fake-state %d', found '%s'",
                         path, lineno, FAKE_STATE_FORMAT, text);
                goto fail;
            }
            header = 1;
            continue;
        }
        if (*text == '[') {
            unsigned index;
            char close = 0;
            if (sscanf(text, "[gpu %u%c", &index, &close) != 2 || close != ']') {
                snprintf(why, why_len, "%s:%d: expected a section '[gpu N]', found '%s'", path,
                         lineno, text);
                goto fail;
            }
            if (index != state->gpu_count || index >= FAKE_MAX_GPUS) {
                snprintf(why, why_len, "%s:%d: section [gpu %u] out of order: GPUs are numbered "
                         "0, 1, ... in order (next expected: %u, at most %d)", path, lineno,
                         index, state->gpu_count, FAKE_MAX_GPUS);
                goto fail;
            }
            section = &state->gpu[state->gpu_count++];
            continue;
        }
        size_t key_len = strcspn(text, " \t");
        if (key_len >= FAKE_KEY_MAX) {
            snprintf(why, why_len, "%s:%d: key longer than %d characters", path, lineno,
                     FAKE_KEY_MAX - 1);
            goto fail;
        }
        char key[FAKE_KEY_MAX];
        memcpy(key, text, key_len);
        key[key_len] = '\0';
        char *value = trim(text + key_len);
        if (strlen(value) >= FAKE_VALUE_MAX) {
            snprintf(why, why_len, "%s:%d: value of '%s' longer than %d characters", path, lineno,
                     key, FAKE_VALUE_MAX - 1);
            goto fail;
        }
        if (section_add(section, key, value) != 0) {
            snprintf(why, why_len, "out of memory reading %s", path);
            goto fail;
        }
    }
    if (!header) {
        snprintf(why, why_len, "%s: empty state file (expected the header 'nvml-fake-state %d')",
                 path, FAKE_STATE_FORMAT);
        goto fail;
    }
    fclose(f);
    return state;
fail:
    fclose(f);
    state_free(state);
    return NULL;
}

/* -- rendering a scenario ------------------------------------------------------------------- */

/* The Python to run the renderer with: $NVML_FAKE_PYTHON, this process when it is Python, or
 * python3 from PATH. A console script's argv[0] is its interpreter, venv path included. */
static void python_for_render(char *out, size_t len)
{
    const char *configured = getenv("NVML_FAKE_PYTHON");
    if (configured && *configured) {
        snprintf(out, len, "%s", configured);
        return;
    }
    snprintf(out, len, "python3");
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    char argv0[4096];
    ssize_t n = read(fd, argv0, sizeof argv0 - 1);
    close(fd);
    if (n <= 0)
        return;
    argv0[n] = '\0';
    const char *base = strrchr(argv0, '/');
    base = base ? base + 1 : argv0;
    if (strncmp(base, "python", 6) == 0)
        snprintf(out, len, "%s", argv0);
}

static int render(const char *scenario, const char *state_path)
{
    char python[4096];
    python_for_render(python, sizeof python);
    char *argv[] = {python, "-m", "node_agent.sim.nvml_state", (char *)scenario, "--out",
                    (char *)state_path, NULL};
    pid_t pid;
    int err = posix_spawnp(&pid, python, NULL, NULL, argv, environ);
    if (err != 0) {
        report("cannot run %s to render the scenario %s: %s (set NVML_FAKE_PYTHON to a Python "
               "that can import node_agent)", python, scenario, strerror(err));
        return -1;
    }
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            report("waiting for the scenario renderer: %s", strerror(errno));
            return -1;
        }
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        report("%s -m node_agent.sim.nvml_state %s failed (exit status %d; its message is above); "
               "set NVML_FAKE_PYTHON to a Python that can import node_agent", python, scenario,
               WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        return -1;
    }
    return 0;
}

/* The state file to read, rendering the scenario first when there is one and it changed. */
static const char *state_path(void)
{
    const char *scenario = getenv("NVML_FAKE_SCENARIO");
    const char *state = getenv("NVML_FAKE_STATE");
    if (!scenario || !*scenario) {
        if (!state || !*state)
            report("neither NVML_FAKE_STATE nor NVML_FAKE_SCENARIO is set: this stand-in "
                   "libnvidia-ml.so.1 has no GPUs to show (see docs/nvml_fake.md)");
        return state && *state ? state : NULL;
    }
    if (state && *state) {
        snprintf(g_rendered_path, sizeof g_rendered_path, "%s", state);
    } else if (!g_rendered_path[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(g_rendered_path, sizeof g_rendered_path, "%s/nvml-fake-state-XXXXXX",
                 tmp && *tmp ? tmp : "/tmp");
        int fd = mkstemp(g_rendered_path);
        if (fd < 0) {
            report("cannot create a temporary state file %s: %s", g_rendered_path,
                   strerror(errno));
            g_rendered_path[0] = '\0';
            return NULL;
        }
        close(fd);
    }
    file_id_t now = {0};
    if (file_id(scenario, &now) != 0) {
        report("cannot read NVML_FAKE_SCENARIO=%s: %s", scenario, strerror(errno));
        return g_scenario_id.valid ? g_rendered_path : NULL;
    }
    if (!same_file(&now, &g_scenario_id)) {
        if (render(scenario, g_rendered_path) != 0)
            return g_scenario_id.valid ? g_rendered_path : NULL;
        g_scenario_id = now;
    }
    return g_rendered_path;
}

static void forget_state(void)
{
    state_free(g_state);
    g_state = NULL;
    g_state_path[0] = '\0';
    memset(&g_state_id, 0, sizeof g_state_id);
}

int fake_state_refresh(void)
{
    const char *state = getenv("NVML_FAKE_STATE"), *scenario = getenv("NVML_FAKE_SCENARIO");
    if (!(state && *state) && !(scenario && *scenario)) {
        state_path(); /* says why there is nothing to show */
        forget_state();
        return -1;
    }
    const char *path = state_path();
    /* A state file that is there but changed into something unreadable keeps the state read
     * before (a test rewriting it mid-run made a mistake: said on stderr); another file, or
     * none read yet, has nothing to fall back on. */
    int same_path = g_state && path && strcmp(path, g_state_path) == 0;
    if (!path) {
        if (!same_path)
            forget_state();
        return g_state ? 0 : -1;
    }
    file_id_t now = {0};
    if (file_id(path, &now) != 0) {
        report("cannot read state file %s: %s", path, strerror(errno));
        if (!same_path)
            forget_state();
        return g_state ? 0 : -1;
    }
    if (same_path && same_file(&now, &g_state_id))
        return 0;
    char why[512];
    fake_state_t *fresh = parse(path, why, sizeof why);
    if (!fresh) {
        report("%s%s", why, same_path ? " (keeping the state read before)" : "");
        if (!same_path)
            forget_state();
        return g_state ? 0 : -1;
    }
    state_free(g_state);
    g_state = fresh;
    snprintf(g_state_path, sizeof g_state_path, "%s", path);
    g_state_id = now;
    g_last_error[0] = '\0';
    return 0;
}

void fake_state_release(void)
{
    forget_state();
    memset(&g_scenario_id, 0, sizeof g_scenario_id);
    const char *state = getenv("NVML_FAKE_STATE");
    if (g_rendered_path[0] && !(state && strcmp(state, g_rendered_path) == 0))
        unlink(g_rendered_path);
    g_rendered_path[0] = '\0';
}
