/*
 * nvml-fake: a stand-in libnvidia-ml.so.1 for tests (docs/nvml_fake.md).
 *
 * Internal interface between the state file reader (state.c) and the NVML entry points
 * (nvml_fake.c). Nothing here is part of NVML's ABI; the ABI comes from NVIDIA's nvml.h.
 */
#ifndef NVML_FAKE_H
#define NVML_FAKE_H

#include <stddef.h>

/* Format version on the state file's first line: "nvml-fake-state 1". */
#define FAKE_STATE_FORMAT 1
/* Enough for any node the scenario schema allows (gpus: maximum 64). */
#define FAKE_MAX_GPUS 64
#define FAKE_KEY_MAX 64
#define FAKE_VALUE_MAX 256

typedef struct {
    char key[FAKE_KEY_MAX];
    char value[FAKE_VALUE_MAX];
} fake_entry_t;

/* The global section (before any "[gpu N]") or one GPU's section: entries in file order. */
typedef struct {
    fake_entry_t *entries;
    size_t count;
    size_t capacity;
} fake_section_t;

typedef struct {
    fake_section_t global;
    fake_section_t gpu[FAKE_MAX_GPUS];
    unsigned gpu_count;
} fake_state_t;

/*
 * The current state, read from $NVML_FAKE_STATE (or rendered from $NVML_FAKE_SCENARIO) and
 * read again whenever that file changes. Call with fake_lock held; never NULL after a
 * successful fake_state_refresh().
 */
const fake_state_t *fake_state(void);

/*
 * Read the state file again if it changed since the last read (or was never read).
 * Returns 0 when a state is loaded (the previous one is kept when a changed file does not
 * parse: the reason goes to stderr once), -1 when none could ever be loaded (reason on stderr).
 * Call with fake_lock held.
 */
int fake_state_refresh(void);

/* Forget the loaded state and remove a state file this library rendered itself. */
void fake_state_release(void);

void fake_lock(void);
void fake_unlock(void);
/* 0 when the lock was free and is now held. */
int fake_trylock(void);

/* The value of key in a section (the last line wins, so appended lines override), or NULL. */
const char *fake_get(const fake_section_t *section, const char *key);
/* The i-th entry with this key (0-based), or NULL when there are fewer. */
const char *fake_get_nth(const fake_section_t *section, const char *key, size_t n);
/* Whether any key of the section starts with prefix. */
int fake_has_prefix(const fake_section_t *section, const char *prefix);

#endif
