/*
 * nvml-fake: a stand-in libnvidia-ml.so.1 for tests, built against NVIDIA's nvml.h so that the
 * function signatures, struct layouts and versioned-struct constants are NVIDIA's own (a
 * mismatch is a compile error). The real nvidia-ml-py loads it through ctypes like the real
 * library. What each function answers comes from the state file (state.c, docs/nvml_fake.md):
 * a value the file does not give is NVML_ERROR_NOT_SUPPORTED, "error <code>" as a value returns
 * that code, and per function (global or per GPU):
 *
 *   unsupported <fn>     NVML_ERROR_NOT_SUPPORTED
 *   absent <fn>          NVML_ERROR_FUNCTION_NOT_FOUND (an older driver without it)
 *   error <fn> <code>    any nvmlReturn_t
 *   hang <fn>            the call blocks until the state file no longer says so
 *   lost <0|1>           (GPU) every call on the GPU returns NVML_ERROR_GPU_IS_LOST
 *
 * <fn> is the exported name (nvmlDeviceGetPciInfo_v3), its name without the _vN suffix
 * (nvmlDeviceGetPciInfo), or * for every function.
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* define nvmlInit and nvmlInit_v2 alike, as libnvidia-ml does */
#include <nvml.h>

#include "nvml_fake.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define HANDLE_MAGIC 0x6e766d6cu /* "nvml" */
#define POLL_NS 10000000L        /* 10 ms between looks at the state file while waiting */

struct nvmlDevice_st {
    unsigned magic;
    unsigned index;
};

typedef struct {
    unsigned gpu;
    char id[32];
} delivered_t;

struct nvmlEventSet_st {
    unsigned magic;
    unsigned long long registered[FAKE_MAX_GPUS]; /* event types per GPU index */
    delivered_t *delivered;                       /* Xid events this set has returned */
    size_t delivered_count, delivered_capacity;
};

static struct nvmlDevice_st g_devices[FAKE_MAX_GPUS];
static int g_init_count;

enum { NO_GPU = -1, BAD_HANDLE = -2 };

/* -- the one entry and exit of every call ---------------------------------------------------- */

static void sleep_ns(long ns)
{
    struct timespec t = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

/* NVML_FAKE_TRACE=<file>: one line per call, "<function> <gpu|-> <return code>". */
static void trace(const char *fn, long gpu, nvmlReturn_t rc)
{
    const char *path = getenv("NVML_FAKE_TRACE");
    if (!path || !*path)
        return;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    char line[160];
    int n = gpu >= 0 ? snprintf(line, sizeof line, "%s %ld %d\n", fn, gpu, (int)rc)
                     : snprintf(line, sizeof line, "%s - %d\n", fn, (int)rc);
    if (n > 0 && write(fd, line, (size_t)n) < 0) {
        /* tracing is best effort */
    }
    close(fd);
}

static int name_matches(const char *pattern, const char *fn)
{
    if (strcmp(pattern, "*") == 0 || strcmp(pattern, fn) == 0)
        return 1;
    /* "nvmlInit" names every way in: nvidia-ml-py calls nvmlInitWithFlags */
    if (strcmp(pattern, "nvmlInit") == 0 && strncmp(fn, "nvmlInit", 8) == 0)
        return 1;
    size_t len = strlen(pattern);
    if (strncmp(pattern, fn, len) != 0 || fn[len] != '_' || fn[len + 1] != 'v')
        return 0;
    const char *digits = fn + len + 2;
    if (!*digits)
        return 0;
    for (; *digits; digits++)
        if (!isdigit((unsigned char)*digits))
            return 0;
    return 1;
}

/* What a section says about calls of fn: 1 = hang, else the return code. */
static nvmlReturn_t switches(const fake_section_t *section, const char *fn, int *hang)
{
    *hang = 0;
    for (size_t i = 0; i < section->count; i++) {
        const fake_entry_t *e = &section->entries[i];
        if (strcmp(e->key, "hang") == 0 && name_matches(e->value, fn))
            *hang = 1;
    }
    if (*hang)
        return NVML_SUCCESS;
    for (size_t i = 0; i < section->count; i++) {
        const fake_entry_t *e = &section->entries[i];
        if (strcmp(e->key, "unsupported") == 0 && name_matches(e->value, fn))
            return NVML_ERROR_NOT_SUPPORTED;
        if (strcmp(e->key, "absent") == 0 && name_matches(e->value, fn))
            return NVML_ERROR_FUNCTION_NOT_FOUND;
        if (strcmp(e->key, "error") == 0) {
            char name[FAKE_VALUE_MAX];
            int code;
            if (sscanf(e->value, "%255s %d", name, &code) == 2 && name_matches(name, fn))
                return (nvmlReturn_t)code;
        }
    }
    return NVML_SUCCESS;
}

static int flag(const fake_section_t *section, const char *key)
{
    const char *v = fake_get(section, key);
    return v && strcmp(v, "0") != 0;
}

/*
 * Start a call: take the lock, read the state file again if it changed, and apply the switches
 * of the global section and, for a GPU (index >= 0), of its section. Returns with the lock held
 * whatever it returns; leave() releases it. A call the state says hangs waits here, the lock
 * released, until the state says otherwise (or NVML is shut down meanwhile).
 */
static nvmlReturn_t enter(const char *fn, long index, int needs_init, int by_index,
                          const fake_section_t **gpu)
{
    for (;;) {
        fake_lock();
        if (needs_init && g_init_count == 0)
            return NVML_ERROR_UNINITIALIZED;
        if (fake_state_refresh() != 0) {
            const char *state = getenv("NVML_FAKE_STATE"), *scenario = getenv("NVML_FAKE_SCENARIO");
            int configured = (state && *state) || (scenario && *scenario);
            /* unconfigured, the stand-in is as good as no library: what a host without the
             * driver answers, so a process that loads it by accident sees no GPUs */
            return configured ? NVML_ERROR_UNKNOWN : NVML_ERROR_LIBRARY_NOT_FOUND;
        }
        const fake_state_t *state = fake_state();
        int hang;
        nvmlReturn_t rc = switches(&state->global, fn, &hang);
        if (!hang && rc == NVML_SUCCESS && index != NO_GPU) {
            if (index == BAD_HANDLE)
                return NVML_ERROR_INVALID_ARGUMENT;
            if (index >= (long)state->gpu_count)
                return by_index ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_GPU_IS_LOST;
            const fake_section_t *section = &state->gpu[index];
            if (flag(section, "lost"))
                return NVML_ERROR_GPU_IS_LOST;
            rc = switches(section, fn, &hang);
            *gpu = section;
        }
        if (!hang)
            return rc;
        fake_unlock();
        sleep_ns(POLL_NS);
    }
}

static nvmlReturn_t leave(const char *fn, long index, nvmlReturn_t rc)
{
    fake_unlock();
    trace(fn, index, rc);
    return rc;
}

static long handle_index(nvmlDevice_t device)
{
    if (device < g_devices || device >= g_devices + FAKE_MAX_GPUS || device->magic != HANDLE_MAGIC)
        return BAD_HANDLE;
    return (long)(device - g_devices);
}

static nvmlDevice_t handle_of(unsigned index)
{
    g_devices[index].magic = HANDLE_MAGIC;
    g_devices[index].index = index;
    return &g_devices[index];
}

#define SYSTEM_CALL()                                                       \
    const long gpu_index = NO_GPU;                                          \
    nvmlReturn_t rc = enter(__func__, NO_GPU, 1, 0, NULL);                  \
    if (rc != NVML_SUCCESS)                                                 \
        return leave(__func__, gpu_index, rc);                              \
    const fake_section_t *global = &fake_state()->global;                   \
    (void)global

#define DEVICE_CALL(device)                                                 \
    const fake_section_t *gpu = NULL;                                       \
    const long gpu_index = handle_index(device);                            \
    nvmlReturn_t rc = enter(__func__, gpu_index, 1, 0, &gpu);               \
    if (rc != NVML_SUCCESS)                                                 \
        return leave(__func__, gpu_index, rc)

#define DONE(code) return leave(__func__, gpu_index, (code))
#define REQUIRE(cond)                                                       \
    do {                                                                    \
        if (!(cond))                                                        \
            DONE(NVML_ERROR_INVALID_ARGUMENT);                              \
    } while (0)

/* -- reading values ------------------------------------------------------------------------- */

/* A value "error <code>" answers that code instead of a value. */
static int value_error(const char *v, nvmlReturn_t *rc)
{
    int code;
    if (strncmp(v, "error ", 6) == 0 && sscanf(v + 6, "%d", &code) == 1) {
        *rc = (nvmlReturn_t)code;
        return 1;
    }
    return 0;
}

static nvmlReturn_t bad_value(const char *key, const char *v)
{
    fprintf(stderr, "nvml-fake: state key '%s': '%s' is not a number\n", key, v);
    return NVML_ERROR_UNKNOWN;
}

/* n numbers in one value ("remapped_rows 0 1 1 0"), each at most limits[i]: what does not
 * parse, or is too large for its C type, is NVML_ERROR_UNKNOWN (the table's rule). */
static nvmlReturn_t get_numbers(const fake_section_t *s, const char *key, unsigned long long *out,
                                int n, const unsigned long long *limits)
{
    const char *v = fake_get(s, key);
    nvmlReturn_t rc;
    if (!v)
        return NVML_ERROR_NOT_SUPPORTED;
    if (value_error(v, &rc))
        return rc;
    const char *p = v;
    for (int i = 0; i < n; i++) {
        while (*p == ' ' || *p == '\t')
            p++;
        char *end;
        errno = 0;
        unsigned long long x = strtoull(p, &end, 0);
        if (errno || end == p || *p == '-' || x > limits[i])
            return bad_value(key, v);
        out[i] = x;
        p = end;
    }
    while (*p == ' ' || *p == '\t')
        p++;
    return *p ? bad_value(key, v) : NVML_SUCCESS;
}

static const unsigned long long UINT_LIMITS[] = {0xffffffffULL, 0xffffffffULL, 0xffffffffULL,
                                                 0xffffffffULL, 0xffffffffULL, 0xffffffffULL,
                                                 0xffffffffULL, 0xffffffffULL};

static nvmlReturn_t get_ull(const fake_section_t *s, const char *key, unsigned long long *out)
{
    static const unsigned long long limit[] = {~0ULL};
    return get_numbers(s, key, out, 1, limit);
}

/* Several unsigned ints in one value (at most 8). */
static nvmlReturn_t get_uints(const fake_section_t *s, const char *key, unsigned *out, int n)
{
    unsigned long long v[8];
    nvmlReturn_t rc = get_numbers(s, key, v, n, UINT_LIMITS);
    for (int i = 0; rc == NVML_SUCCESS && i < n; i++)
        out[i] = (unsigned)v[i];
    return rc;
}

static nvmlReturn_t get_uint(const fake_section_t *s, const char *key, unsigned int *out)
{
    return get_uints(s, key, out, 1);
}

static nvmlReturn_t get_str(const fake_section_t *s, const char *key, char *out, unsigned int len)
{
    const char *v = fake_get(s, key);
    nvmlReturn_t rc;
    if (!v)
        return NVML_ERROR_NOT_SUPPORTED;
    if (value_error(v, &rc))
        return rc;
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(v) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, v, strlen(v) + 1);
    return NVML_SUCCESS;
}

/* The NVLink rule: a link index the state does not describe is INVALID_ARGUMENT on a GPU with
 * NVLink (an index beyond its links) and NOT_SUPPORTED on one without; a link whose state is
 * "error <code>" answers that code for every call on it (a captured link NVML did not answer
 * for: docs/capture.md). */
static nvmlReturn_t nvlink_check(const fake_section_t *gpu, unsigned link)
{
    char key[FAKE_KEY_MAX];
    snprintf(key, sizeof key, "nvlink.%u.state", link);
    const char *state = fake_get(gpu, key);
    if (!state)
        return fake_has_prefix(gpu, "nvlink.") ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = NVML_SUCCESS;
    value_error(state, &rc);
    return rc;
}

/* -- the getters generated from the NVML call table (node_agent/gpu/nvml_calls.py) ---------- */

#include "nvml_fake_calls.h"

/* -- init and shutdown ---------------------------------------------------------------------- */

static nvmlReturn_t init(const char *fn)
{
    nvmlReturn_t rc = enter(fn, NO_GPU, 0, 0, NULL);
    if (rc == NVML_SUCCESS)
        g_init_count++;
    return leave(fn, NO_GPU, rc);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return init(__func__); }
EXPORT nvmlReturn_t nvmlInit(void) { return init(__func__); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return init(__func__);
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    SYSTEM_CALL();
    if (--g_init_count == 0)
        fake_state_release();
    DONE(NVML_SUCCESS);
}

/* -- enumeration ---------------------------------------------------------------------------- */

static nvmlReturn_t count(const char *fn, unsigned int *deviceCount)
{
    nvmlReturn_t rc = enter(fn, NO_GPU, 1, 0, NULL);
    if (rc == NVML_SUCCESS) {
        if (deviceCount)
            *deviceCount = fake_state()->gpu_count;
        else
            rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    return leave(fn, NO_GPU, rc);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) { return count(__func__, deviceCount); }
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return count(__func__, deviceCount); }

static nvmlReturn_t by_index(const char *fn, unsigned int index, nvmlDevice_t *device)
{
    long i = index < FAKE_MAX_GPUS ? (long)index : FAKE_MAX_GPUS;
    const fake_section_t *gpu = NULL;
    nvmlReturn_t rc = enter(fn, i, 1, 1, &gpu);
    if (rc == NVML_SUCCESS) {
        if (device)
            *device = handle_of((unsigned)i);
        else
            rc = NVML_ERROR_INVALID_ARGUMENT;
    }
    return leave(fn, i, rc);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return by_index(__func__, index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return by_index(__func__, index, device);
}

/* The GPU whose key equals value (case-insensitive), or NVML_ERROR_NOT_FOUND. */
static nvmlReturn_t find_by(const char *fn, const char *key, const char *value, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter(fn, NO_GPU, 1, 0, NULL);
    if (rc != NVML_SUCCESS)
        return leave(fn, NO_GPU, rc);
    if (!value || !device)
        return leave(fn, NO_GPU, NVML_ERROR_INVALID_ARGUMENT);
    const fake_state_t *state = fake_state();
    for (unsigned i = 0; i < state->gpu_count; i++) {
        const char *v = fake_get(&state->gpu[i], key);
        if (v && strcasecmp(v, value) == 0) {
            if (flag(&state->gpu[i], "lost"))
                return leave(fn, i, NVML_ERROR_GPU_IS_LOST);
            *device = handle_of(i);
            return leave(fn, i, NVML_SUCCESS);
        }
    }
    return leave(fn, NO_GPU, NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    return find_by(__func__, "uuid", uuid, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    return find_by(__func__, "pci.bus_id", pciBusId, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEVICE_CALL(device);
    REQUIRE(index);
    *index = (unsigned)gpu_index;
    DONE(NVML_SUCCESS);
}

/* -- identity ------------------------------------------------------------------------------- */

static nvmlReturn_t pci_info(const fake_section_t *gpu, nvmlPciInfo_t *pci)
{
    const char *bus_id = fake_get(gpu, "pci.bus_id");
    nvmlReturn_t rc;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!bus_id)
        return NVML_ERROR_NOT_SUPPORTED;
    if (value_error(bus_id, &rc))
        return rc;
    unsigned domain, bus, dev, function;
    if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &function) != 4
        || strlen(bus_id) >= NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE)
        return bad_value("pci.bus_id", bus_id);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             domain & 0xffff, bus & 0xff, dev & 0xff);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    unsigned v = 0;
    if (get_uint(gpu, "pci.device_id", &v) == NVML_SUCCESS)
        pci->pciDeviceId = v;
    if (get_uint(gpu, "pci.subsystem_id", &v) == NVML_SUCCESS)
        pci->pciSubSystemId = v;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE_CALL(device);
    DONE(pci_info(gpu, pci));
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE_CALL(device);
    DONE(pci_info(gpu, pci));
}

/* -- memory --------------------------------------------------------------------------------- */

/* memory.total, memory.reserved, memory.used (bytes); free is what is left. */
static nvmlReturn_t memory(const fake_section_t *gpu, unsigned long long *total,
                           unsigned long long *reserved, unsigned long long *used)
{
    nvmlReturn_t rc = get_ull(gpu, "memory.total", total);
    if (rc != NVML_SUCCESS)
        return rc;
    *reserved = *used = 0;
    rc = get_ull(gpu, "memory.reserved", reserved);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_SUPPORTED)
        return rc;
    rc = get_ull(gpu, "memory.used", used);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_SUPPORTED)
        return rc;
    if (*reserved + *used > *total)
        return bad_value("memory.used", fake_get(gpu, "memory.used"));
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem)
{
    DEVICE_CALL(device);
    REQUIRE(mem);
    unsigned long long total, reserved, used;
    rc = memory(gpu, &total, &reserved, &used);
    if (rc == NVML_SUCCESS) { /* v1: used includes what the driver reserves */
        mem->total = total;
        mem->used = reserved + used;
        mem->free = total - reserved - used;
    }
    DONE(rc);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *mem)
{
    DEVICE_CALL(device);
    REQUIRE(mem);
    if (mem->version != nvmlMemory_v2)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total, reserved, used;
    rc = memory(gpu, &total, &reserved, &used);
    if (rc == NVML_SUCCESS) {
        mem->total = total;
        mem->reserved = reserved;
        mem->used = used;
        mem->free = total - reserved - used;
    }
    DONE(rc);
}

/* -- temperature ---------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
    DEVICE_CALL(device);
    REQUIRE(temperature);
    if (temperature->version != nvmlTemperature_v1)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE((int)temperature->sensorType >= 0 && temperature->sensorType < NVML_TEMPERATURE_COUNT);
    if (temperature->sensorType != NVML_TEMPERATURE_GPU)
        DONE(NVML_ERROR_NOT_SUPPORTED);
    unsigned celsius = 0;
    rc = get_uint(gpu, "temperature.gpu", &celsius);
    if (rc == NVML_SUCCESS)
        temperature->temperature = (int)celsius;
    DONE(rc);
}

/* -- field values --------------------------------------------------------------------------- */

/* field.<id>[.<scope>] = "<type> <value>" (type: double uint ulong ulonglong slonglong sint
 * ushort) or "error <code>"; a field the state does not give is NVML_ERROR_NOT_SUPPORTED. */
static void field_value(const fake_section_t *gpu, nvmlFieldValue_t *out)
{
    static const char *const types[] = {"double", "uint", "ulong", "ulonglong", "slonglong",
                                        "sint", "ushort"};
    char key[FAKE_KEY_MAX];
    snprintf(key, sizeof key, "field.%u.%u", out->fieldId, out->scopeId);
    const char *v = fake_get(gpu, key);
    if (!v) {
        snprintf(key, sizeof key, "field.%u", out->fieldId);
        v = fake_get(gpu, key);
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    out->timestamp = (long long)now.tv_sec * 1000000LL + now.tv_nsec / 1000;
    out->latencyUsec = 0;
    out->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
    memset(&out->value, 0, sizeof out->value);
    if (!v) {
        out->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    nvmlReturn_t rc;
    if (value_error(v, &rc)) {
        out->nvmlReturn = rc;
        return;
    }
    char type[16], number[64];
    if (sscanf(v, "%15s %63s", type, number) != 2)
        goto bad;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        if (strcmp(type, types[t]) != 0)
            continue;
        char *end;
        errno = 0;
        out->valueType = (nvmlValueType_t)t;
        switch (t) {
        case NVML_VALUE_TYPE_DOUBLE: out->value.dVal = strtod(number, &end); break;
        case NVML_VALUE_TYPE_UNSIGNED_INT: out->value.uiVal = (unsigned)strtoul(number, &end, 0); break;
        case NVML_VALUE_TYPE_UNSIGNED_LONG: out->value.ulVal = strtoul(number, &end, 0); break;
        case NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: out->value.ullVal = strtoull(number, &end, 0); break;
        case NVML_VALUE_TYPE_SIGNED_LONG_LONG: out->value.sllVal = strtoll(number, &end, 0); break;
        case NVML_VALUE_TYPE_SIGNED_INT: out->value.siVal = (int)strtol(number, &end, 0); break;
        default: out->value.usVal = (unsigned short)strtoul(number, &end, 0); break;
        }
        if (errno || *end)
            goto bad;
        out->nvmlReturn = NVML_SUCCESS;
        return;
    }
bad:
    out->nvmlReturn = bad_value(key, v);
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    DEVICE_CALL(device);
    REQUIRE(values && valuesCount >= 0);
    for (int i = 0; i < valuesCount; i++)
        field_value(gpu, &values[i]);
    DONE(NVML_SUCCESS);
}

/* -- ECC, retired pages -------------------------------------------------------------------- */

/* ecc_sram.aggregate / ecc_sram.volatile "<uncorrectable parity> <uncorrectable SEC-DED>
 * <corrected>", ecc_sram.aggregate_by_unit "<l2> <sm> <pcie> <mcu> <other>",
 * ecc_sram.threshold_exceeded 0/1. A GPU without any ecc_sram.* key does not report the status
 * (pre-Ampere: NOT_SUPPORTED); a key left out of one that does reads 0. */
static nvmlReturn_t sram_uints(const fake_section_t *gpu, const char *key, unsigned long long *out,
                               int n)
{
    unsigned values[8] = {0};
    if (!fake_get(gpu, key)) {
        for (int i = 0; i < n; i++)
            out[i] = 0;
        return NVML_SUCCESS;
    }
    nvmlReturn_t rc = get_uints(gpu, key, values, n);
    for (int i = 0; rc == NVML_SUCCESS && i < n; i++)
        out[i] = values[i];
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetSramEccErrorStatus(nvmlDevice_t device, nvmlEccSramErrorStatus_t *status)
{
    DEVICE_CALL(device);
    REQUIRE(status);
    if (status->version != nvmlEccSramErrorStatus_v1)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (!fake_has_prefix(gpu, "ecc_sram."))
        DONE(NVML_ERROR_NOT_SUPPORTED);
    unsigned long long aggregate[3], volatile_[3], unit[5], exceeded[1];
    rc = sram_uints(gpu, "ecc_sram.aggregate", aggregate, 3);
    if (rc == NVML_SUCCESS)
        rc = sram_uints(gpu, "ecc_sram.volatile", volatile_, 3);
    if (rc == NVML_SUCCESS)
        rc = sram_uints(gpu, "ecc_sram.aggregate_by_unit", unit, 5);
    if (rc == NVML_SUCCESS)
        rc = sram_uints(gpu, "ecc_sram.threshold_exceeded", exceeded, 1);
    if (rc == NVML_SUCCESS) {
        status->aggregateUncParity = aggregate[0];
        status->aggregateUncSecDed = aggregate[1];
        status->aggregateCor = aggregate[2];
        status->volatileUncParity = volatile_[0];
        status->volatileUncSecDed = volatile_[1];
        status->volatileCor = volatile_[2];
        status->aggregateUncBucketL2 = unit[0];
        status->aggregateUncBucketSm = unit[1];
        status->aggregateUncBucketPcie = unit[2];
        status->aggregateUncBucketMcu = unit[3];
        status->aggregateUncBucketOther = unit[4];
        status->bThresholdExceeded = exceeded[0] != 0;
    }
    DONE(rc);
}

/* -- the NVLink fabric ------------------------------------------------------------------------ */

/* fabric "<state> <status> <cluster uuid> <clique id> <health mask> <health summary>"
 * (nvml_calls.fabric_value): nvmlGpuFabricInfo_v3_t's members, the UUID as 8-4-4-4-12 hex. */
typedef struct {
    unsigned char uuid[NVML_GPU_FABRIC_UUID_LEN];
    unsigned long long state, status, clique, mask, summary;
} fabric_t;

static int fabric_uuid(const char *text, unsigned char *out)
{
    size_t n = 0;
    for (const char *p = text; *p; p++) {
        if (*p == '-')
            continue;
        unsigned byte;
        if (n >= NVML_GPU_FABRIC_UUID_LEN || !isxdigit((unsigned char)p[0])
            || !isxdigit((unsigned char)p[1]) || sscanf(p, "%2x", &byte) != 1)
            return -1;
        out[n++] = (unsigned char)byte;
        p++;
    }
    return n == NVML_GPU_FABRIC_UUID_LEN ? 0 : -1;
}

static nvmlReturn_t get_fabric(const fake_section_t *gpu, fabric_t *f)
{
    const char *v = fake_get(gpu, "fabric");
    nvmlReturn_t rc;
    if (!v)
        return NVML_ERROR_NOT_SUPPORTED;
    if (value_error(v, &rc))
        return rc;
    char copy[FAKE_VALUE_MAX], *save = NULL, *word[7];
    snprintf(copy, sizeof copy, "%s", v);
    int words = 0;
    for (char *w = strtok_r(copy, " \t", &save); w && words < 7; w = strtok_r(NULL, " \t", &save))
        word[words++] = w;
    if (words != 6 || fabric_uuid(word[2], f->uuid) != 0)
        return bad_value("fabric", v);
    unsigned long long *number[] = {&f->state, &f->status, NULL, &f->clique, &f->mask, &f->summary};
    for (int i = 0; i < 6; i++) {
        char *end;
        if (!number[i])
            continue;
        errno = 0;
        *number[i] = strtoull(word[i], &end, 0);
        if (errno || *end || word[i][0] == '-' || *number[i] > 0xffffffffULL)
            return bad_value("fabric", v);
    }
    return f->state > 0xff || f->summary > 0xff ? bad_value("fabric", v) : NVML_SUCCESS;
}

/* the members every fabric struct has (the older one, v2, v3) */
#define FABRIC_COMMON(info, f)                                      \
    do {                                                            \
        memcpy((info)->clusterUuid, (f).uuid, sizeof (f).uuid);     \
        (info)->status = (nvmlReturn_t)(f).status;                  \
        (info)->cliqueId = (unsigned)(f).clique;                    \
        (info)->state = (nvmlGpuFabricState_t)(f).state;            \
    } while (0)

/* nvmlGpuFabricInfo_v2_t or _v3_t (the version says which; v2 has no healthSummary) */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info)
{
    DEVICE_CALL(device);
    REQUIRE(info);
    if (info->version != nvmlGpuFabricInfo_v3 && info->version != nvmlGpuFabricInfo_v2)
        DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    fabric_t f;
    rc = get_fabric(gpu, &f);
    if (rc == NVML_SUCCESS) {
        FABRIC_COMMON(info, f);
        info->healthMask = (unsigned)f.mask;
        if (info->version == nvmlGpuFabricInfo_v3)
            info->healthSummary = (unsigned char)f.summary;
    }
    DONE(rc);
}

/* the older, unversioned struct: no health mask or summary */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    DEVICE_CALL(device);
    REQUIRE(info);
    fabric_t f;
    rc = get_fabric(gpu, &f);
    if (rc == NVML_SUCCESS)
        FABRIC_COMMON(info, f);
    DONE(rc);
}

/* retired_pages.sbe / retired_pages.dbe: how many pages (their addresses are made up). */
static nvmlReturn_t retired(const fake_section_t *gpu, nvmlPageRetirementCause_t cause,
                            unsigned int *pageCount, unsigned long long *addresses,
                            unsigned long long *timestamps)
{
    const char *key = cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
                          ? "retired_pages.sbe"
                      : cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? "retired_pages.dbe"
                                                                                 : NULL;
    if (!key || !pageCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    nvmlReturn_t rc = get_uint(gpu, key, &n);
    if (rc != NVML_SUCCESS)
        return rc;
    if (*pageCount < n || (n && !addresses)) {
        *pageCount = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned i = 0; i < n; i++) {
        addresses[i] = 0x100000ULL * (cause + 1) + 0x1000ULL * i;
        if (timestamps)
            timestamps[i] = 1700000000ULL + i;
    }
    *pageCount = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                              unsigned int *pageCount, unsigned long long *addresses)
{
    DEVICE_CALL(device);
    DONE(retired(gpu, cause, pageCount, addresses, NULL));
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                                 unsigned int *pageCount, unsigned long long *addresses,
                                                 unsigned long long *timestamps)
{
    DEVICE_CALL(device);
    DONE(retired(gpu, cause, pageCount, addresses, timestamps));
}

/* -- processes ------------------------------------------------------------------------------ */

/* "process <pid> <used bytes|na>" lines; NVML's two-call protocol (size, then fill). */
static nvmlReturn_t processes(const fake_section_t *gpu, unsigned int *infoCount, void *infos,
                              int version)
{
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    while (fake_get_nth(gpu, "process", n))
        n++;
    if (*infoCount < n || (n && !infos)) {
        *infoCount = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned i = 0; i < n; i++) {
        const char *v = fake_get_nth(gpu, "process", i);
        unsigned pid;
        char used[32];
        if (sscanf(v, "%u %31s", &pid, used) != 2)
            return bad_value("process", v);
        unsigned long long bytes = strcmp(used, "na") == 0 ? (unsigned long long)NVML_VALUE_NOT_AVAILABLE
                                                           : strtoull(used, NULL, 0);
        if (version == 1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = pid;
            p->usedGpuMemory = bytes;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + i;
            p->pid = pid;
            p->usedGpuMemory = bytes;
            p->gpuInstanceId = 0xFFFFFFFFu; /* no MIG */
            p->computeInstanceId = 0xFFFFFFFFu;
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    DEVICE_CALL(device);
    DONE(processes(gpu, infoCount, infos, 3));
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos)
{
    DEVICE_CALL(device);
    DONE(processes(gpu, infoCount, infos, 2));
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos)
{
    DEVICE_CALL(device);
    DONE(processes(gpu, infoCount, infos, 1));
}

/* -- events --------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    SYSTEM_CALL();
    REQUIRE(set);
    struct nvmlEventSet_st *created = calloc(1, sizeof *created);
    if (!created)
        DONE(NVML_ERROR_MEMORY);
    created->magic = HANDLE_MAGIC;
    *set = created;
    DONE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    SYSTEM_CALL();
    REQUIRE(set && set->magic == HANDLE_MAGIC);
    set->magic = 0;
    free(set->delivered);
    free(set);
    DONE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set)
{
    DEVICE_CALL(device);
    REQUIRE(set && set->magic == HANDLE_MAGIC);
    unsigned long long supported = 0;
    rc = get_ull(gpu, "event_types", &supported);
    if (rc == NVML_SUCCESS && (eventTypes & ~supported))
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        set->registered[gpu_index] |= eventTypes;
    DONE(rc);
}

static int delivered(const struct nvmlEventSet_st *set, unsigned gpu, const char *id)
{
    for (size_t i = 0; i < set->delivered_count; i++)
        if (set->delivered[i].gpu == gpu && strcmp(set->delivered[i].id, id) == 0)
            return 1;
    return 0;
}

/* The next "xid <id> <code>" of a registered GPU this set has not returned yet: 1 when found. */
static int next_xid(struct nvmlEventSet_st *set, unsigned *gpu_out, unsigned long long *code_out)
{
    const fake_state_t *state = fake_state();
    for (unsigned gpu = 0; gpu < state->gpu_count; gpu++) {
        if (!(set->registered[gpu] & nvmlEventTypeXidCriticalError))
            continue;
        const char *v;
        for (size_t n = 0; (v = fake_get_nth(&state->gpu[gpu], "xid", n)); n++) {
            char id[32];
            unsigned long long code;
            if (sscanf(v, "%31s %llu", id, &code) != 2) {
                bad_value("xid", v);
                continue;
            }
            if (delivered(set, gpu, id))
                continue;
            if (set->delivered_count == set->delivered_capacity) {
                size_t capacity = set->delivered_capacity ? set->delivered_capacity * 2 : 16;
                delivered_t *grown = realloc(set->delivered, capacity * sizeof *grown);
                if (!grown)
                    return 0;
                set->delivered = grown;
                set->delivered_capacity = capacity;
            }
            delivered_t *d = &set->delivered[set->delivered_count++];
            d->gpu = gpu;
            snprintf(d->id, sizeof d->id, "%s", id);
            *gpu_out = gpu;
            *code_out = code;
            return 1;
        }
    }
    return 0;
}

static long long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000LL + t.tv_nsec / 1000000L;
}

/* Xid events of the state file each come once per event set, in file order, whenever they
 * appear (also when they were there before the set was made: a scenario's Xids happen "now"). */
static nvmlReturn_t wait_event(const char *fn, nvmlEventSet_t set, nvmlEventData_t *data,
                               unsigned int timeoutms, int with_instance_ids)
{
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        nvmlReturn_t rc = enter(fn, NO_GPU, 1, 0, NULL);
        if (rc == NVML_SUCCESS && (!set || set->magic != HANDLE_MAGIC || !data))
            rc = NVML_ERROR_INVALID_ARGUMENT;
        if (rc != NVML_SUCCESS)
            return leave(fn, NO_GPU, rc);
        unsigned gpu;
        unsigned long long code;
        if (next_xid(set, &gpu, &code)) {
            data->device = handle_of(gpu);
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = code;
            if (with_instance_ids) {
                data->gpuInstanceId = 0xFFFFFFFFu;
                data->computeInstanceId = 0xFFFFFFFFu;
            }
            return leave(fn, gpu, NVML_SUCCESS);
        }
        long long left = deadline - now_ms();
        if (left <= 0)
            return leave(fn, NO_GPU, NVML_ERROR_TIMEOUT);
        fake_unlock();
        sleep_ns(left * 1000000LL < POLL_NS ? left * 1000000LL : POLL_NS);
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_event(__func__, set, data, timeoutms, 1);
}

EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    /* v1's nvmlEventData_t ends after eventData: leave the instance ids alone */
    return wait_event(__func__, set, data, timeoutms, 0);
}

/* Remove a state file rendered into a temporary file, unless a call is in flight at exit. */
__attribute__((destructor)) static void unload(void)
{
    if (fake_trylock() != 0)
        return;
    fake_state_release();
    fake_unlock();
}
