/*
 * fake_nvml.c - a stand-in for libnvidia-ml.so.1 so that the real pynvml can
 * be tested on machines without a GPU (see docs/design.md, "Fake NVML").
 *
 * Build:  cc -shared -fPIC -O2 -Wall -Wextra -o libnvidia-ml.so.1 fake_nvml.c
 * Use:    LD_LIBRARY_PATH=<dir> FAKE_NVML_STATE=<file> python ...
 *         (LD_LIBRARY_PATH must be set before the process starts.)
 *
 * State file: every call re-reads $FAKE_NVML_STATE, so a test can change the
 * GPUs while a process has the library loaded. Write it atomically (temp file
 * + rename) so a call never sees half a file. A missing variable or file means
 * one GPU, no processes, no faults. One directive a line; '#' starts a comment:
 *
 *   gpus <n>                         GPUs 0..n-1 (default 1, at most 64):
 *                                    name "NVIDIA H200 (fake)",
 *                                    UUID GPU-fa4efa4e-0000-0000-0000-<12 hex of index>,
 *                                    141 GiB total memory
 *   proc <gpu> <pid> <used_bytes> compute|graphics
 *                                    listed by the compute or graphics process
 *                                    call, and counted in the GPU's used memory,
 *                                    ONLY while <pid> really exists and is not a
 *                                    zombie; entries for a GPU >= n are ignored
 *   fault init_failed                nvmlInit* returns NVML_ERROR_DRIVER_NOT_LOADED
 *                                    (what a host whose kernel module is gone gets)
 *   fault gpu_lost [<gpu>]           nvmlDeviceGetHandleByIndex and every call on a
 *                                    device handle return NVML_ERROR_GPU_IS_LOST, for
 *                                    all GPUs or just <gpu>; nvmlDeviceGetCount still
 *                                    succeeds, as it does on a real host
 *   fault insufficient_size <n>      the first <n> process-list calls whose buffer is
 *                                    non-empty and big enough still return
 *                                    NVML_ERROR_INSUFFICIENT_SIZE, with *infoCount one
 *                                    more than the buffer (processes "appeared"
 *                                    between the sizing call and this one). Calls used
 *                                    up are counted in "$FAKE_NVML_STATE.counter"
 *                                    (under flock), so the count spans calls, threads
 *                                    and processes; delete that file to start over.
 *   fault slow_ms <n>                every call except nvmlErrorString sleeps <n> ms
 *                                    before doing anything else
 *
 * An unparsable state file makes every call return NVML_ERROR_UNKNOWN (and
 * print why to stderr), so a broken test setup shows up instead of passing.
 *
 * Thread safety: each call parses its own private copy of the state; the only
 * shared mutable data are the init refcount (atomics) and the counter file
 * (flock). Handles point into a static array that is never written.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

/* Layouts match nvml.h and pynvml's ctypes structures. */
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2_VERSION ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* nvmlProcessInfo_v2_t and _v3_t (pynvml: c_nvmlProcessInfo_v3_t = _v2_t). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* nvmlProcessInfo_v1_t, used by the unversioned symbols of old drivers. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

#define MAX_GPUS 64
#define GPU_TOTAL_BYTES (141ULL << 30)
#define GPU_NAME "NVIDIA H200 (fake)"
#define DRIVER_VERSION "570.124.06"
#define NOT_AVAILABLE_UINT 0xFFFFFFFFu /* gpu/compute instance id without MIG */

struct nvmlDevice_st {
    char unused;
};
typedef struct nvmlDevice_st *nvmlDevice_t;
static struct nvmlDevice_st devices[MAX_GPUS]; /* handle i == &devices[i] */

enum proc_kind { KIND_COMPUTE, KIND_GRAPHICS };

struct proc {
    unsigned gpu;
    unsigned pid;
    unsigned long long used;
    enum proc_kind kind;
};

struct state {
    int bad; /* the file could not be parsed */
    unsigned gpus;
    int init_failed;
    int gpu_lost;          /* 1: some GPU(s) lost */
    long gpu_lost_index;   /* -1: all GPUs */
    long insufficient_n;   /* 0: off */
    long slow_ms;
    size_t nprocs, cap;
    struct proc *procs;
};

static int init_refcount; /* accessed only through __atomic builtins */

static void complain(const char *path, int line, const char *what)
{
    fprintf(stderr, "fake_nvml: %s:%d: %s\n", path, line, what);
}

static int parse_ulong(const char *s, unsigned long long max, unsigned long long *out)
{
    char *end;
    unsigned long long v;
    if (!s || *s == '-' || *s == '\0')
        return -1;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || *end != '\0' || v > max)
        return -1;
    *out = v;
    return 0;
}

/* Parses one directive; returns 0, or -1 with *why set. */
static int parse_line(struct state *st, char *line, const char **why)
{
    char *tok[6];
    int n = 0;
    char *save = NULL, *t;
    unsigned long long a, b, c;

    if ((t = strchr(line, '#')))
        *t = '\0';
    for (t = strtok_r(line, " \t\r\n", &save); t && n < 6; t = strtok_r(NULL, " \t\r\n", &save))
        tok[n++] = t;
    if (n == 0)
        return 0;
    *why = "bad directive";
    if (!strcmp(tok[0], "gpus") && n == 2) {
        if (parse_ulong(tok[1], MAX_GPUS, &a))
            return *why = "gpus wants 0..64", -1;
        st->gpus = (unsigned)a;
        return 0;
    }
    if (!strcmp(tok[0], "proc") && n == 5) {
        enum proc_kind kind;
        if (parse_ulong(tok[1], UINT_MAX, &a) || parse_ulong(tok[2], INT_MAX, &b) || b == 0 ||
            parse_ulong(tok[3], ULLONG_MAX, &c))
            return *why = "proc wants <gpu> <pid> <used_bytes> compute|graphics", -1;
        if (!strcmp(tok[4], "compute"))
            kind = KIND_COMPUTE;
        else if (!strcmp(tok[4], "graphics"))
            kind = KIND_GRAPHICS;
        else
            return *why = "proc kind must be compute or graphics", -1;
        if (st->nprocs == st->cap) {
            size_t cap = st->cap ? st->cap * 2 : 16;
            struct proc *p = realloc(st->procs, cap * sizeof *p);
            if (!p)
                return *why = "out of memory", -1;
            st->procs = p;
            st->cap = cap;
        }
        st->procs[st->nprocs++] = (struct proc){(unsigned)a, (unsigned)b, c, kind};
        return 0;
    }
    if (!strcmp(tok[0], "fault") && n >= 2) {
        if (!strcmp(tok[1], "init_failed") && n == 2) {
            st->init_failed = 1;
            return 0;
        }
        if (!strcmp(tok[1], "gpu_lost") && (n == 2 || n == 3)) {
            st->gpu_lost = 1;
            st->gpu_lost_index = -1;
            if (n == 3) {
                if (parse_ulong(tok[2], MAX_GPUS - 1, &a))
                    return *why = "gpu_lost wants an optional GPU index", -1;
                st->gpu_lost_index = (long)a;
            }
            return 0;
        }
        if (!strcmp(tok[1], "insufficient_size") && n == 3) {
            if (parse_ulong(tok[2], INT_MAX, &a))
                return *why = "insufficient_size wants a count", -1;
            st->insufficient_n = (long)a;
            return 0;
        }
        if (!strcmp(tok[1], "slow_ms") && n == 3) {
            if (parse_ulong(tok[2], 3600 * 1000, &a))
                return *why = "slow_ms wants milliseconds", -1;
            st->slow_ms = (long)a;
            return 0;
        }
        return *why = "unknown fault", -1;
    }
    return -1;
}

static void load_state(struct state *st)
{
    const char *path = getenv("FAKE_NVML_STATE");
    char line[512];
    int lineno = 0;
    FILE *f;

    memset(st, 0, sizeof *st);
    st->gpus = 1;
    st->gpu_lost_index = -1;
    if (!path || !*path || !(f = fopen(path, "re")))
        return; /* missing state: defaults */
    while (fgets(line, sizeof line, f)) {
        const char *why = NULL;
        lineno++;
        if (!strchr(line, '\n') && !feof(f)) {
            complain(path, lineno, "line too long");
            st->bad = 1;
            break;
        }
        if (parse_line(st, line, &why)) {
            complain(path, lineno, why);
            st->bad = 1;
            break;
        }
    }
    fclose(f);
}

static void free_state(struct state *st)
{
    free(st->procs);
    st->procs = NULL;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

/* The start of every call but nvmlErrorString: load the state, apply slow_ms. */
static nvmlReturn_t begin(struct state *st, int need_init)
{
    load_state(st);
    if (st->slow_ms > 0)
        sleep_ms(st->slow_ms);
    if (st->bad)
        return NVML_ERROR_UNKNOWN;
    if (need_init && __atomic_load_n(&init_refcount, __ATOMIC_ACQUIRE) <= 0)
        return NVML_ERROR_UNINITIALIZED;
    return NVML_SUCCESS;
}

static int gpu_is_lost(const struct state *st, unsigned idx)
{
    return st->gpu_lost && (st->gpu_lost_index < 0 || (unsigned long)st->gpu_lost_index == idx);
}

/* Maps a handle to its index, or returns an error for a foreign/lost one. */
static nvmlReturn_t device_index(const struct state *st, nvmlDevice_t dev, unsigned *idx)
{
    uintptr_t p = (uintptr_t)dev, base = (uintptr_t)devices;
    if (p < base || p >= base + sizeof devices)
        return NVML_ERROR_INVALID_ARGUMENT;
    *idx = (unsigned)((p - base) / sizeof devices[0]);
    /* A handle whose GPU has since left the state file: it fell off the bus. */
    if (*idx >= st->gpus || gpu_is_lost(st, *idx))
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

/* True while pid exists and is not a zombie ("the GPU empties on real exit"). */
static int pid_alive(unsigned pid)
{
    char path[64], buf[512], *paren;
    ssize_t n;
    int fd;

    if (pid == 0 || pid > INT_MAX)
        return 0; /* kill(0, ...) would mean our own process group */
    if (kill((pid_t)pid, 0) != 0 && errno != EPERM)
        return 0;
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno != ENOENT; /* no /proc to ask: trust kill() */
    n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    /* "pid (comm) S ...": comm may hold ')' and spaces, so use the last ')'. */
    paren = strrchr(buf, ')');
    if (paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'))
        return 0;
    return 1;
}

/*
 * Consumes one injected INSUFFICIENT_SIZE if any are left. The counter lives in
 * "$FAKE_NVML_STATE.counter", guarded by flock, so it holds across threads and
 * processes.
 */
static int take_insufficient(const struct state *st)
{
    const char *state = getenv("FAKE_NVML_STATE");
    char path[4096], buf[32];
    long used = 0;
    ssize_t n;
    int fd, hit = 0;

    if (st->insufficient_n <= 0 || !state)
        return 0;
    if (snprintf(path, sizeof path, "%s.counter", state) >= (int)sizeof path)
        return 0;
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        perror("fake_nvml: counter file");
        return 0;
    }
    if (flock(fd, LOCK_EX) == 0) {
        n = pread(fd, buf, sizeof buf - 1, 0);
        if (n > 0) {
            buf[n] = '\0';
            used = strtol(buf, NULL, 10);
        }
        if (used < st->insufficient_n) {
            hit = 1;
            n = snprintf(buf, sizeof buf, "%ld\n", used + 1);
            if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n)
                perror("fake_nvml: counter file");
        }
        flock(fd, LOCK_UN);
    }
    close(fd);
    return hit;
}

/* The NVML contract for nvmlDeviceGet*RunningProcesses*. */
static nvmlReturn_t list_procs(nvmlDevice_t dev, unsigned *count, void *infos, size_t stride,
                               int v1, enum proc_kind kind)
{
    struct state st;
    nvmlReturn_t ret;
    unsigned idx, needed = 0, i, j;
    unsigned char *alive = NULL;

    ret = begin(&st, 1);
    if (ret == NVML_SUCCESS)
        ret = device_index(&st, dev, &idx);
    if (ret == NVML_SUCCESS && !count)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && st.nprocs && !(alive = calloc(st.nprocs, 1)))
        ret = NVML_ERROR_MEMORY;
    if (ret != NVML_SUCCESS)
        goto out;
    /* Decide liveness once, so the count and the fill agree within a call. */
    for (i = 0; i < st.nprocs; i++) {
        const struct proc *p = &st.procs[i];
        if (p->gpu == idx && p->kind == kind && pid_alive(p->pid)) {
            alive[i] = 1;
            needed++;
        }
    }
    if (*count < needed) {
        *count = needed;
        ret = NVML_ERROR_INSUFFICIENT_SIZE;
        goto out;
    }
    if (needed == 0) {
        *count = 0;
        goto out;
    }
    if (!infos) {
        ret = NVML_ERROR_INVALID_ARGUMENT;
        goto out;
    }
    if (take_insufficient(&st)) {
        *count = *count + 1; /* "more processes appeared" */
        ret = NVML_ERROR_INSUFFICIENT_SIZE;
        goto out;
    }
    for (i = 0, j = 0; i < st.nprocs; i++) {
        unsigned char *slot;
        if (!alive[i])
            continue;
        slot = (unsigned char *)infos + (size_t)j++ * stride;
        if (v1) {
            nvmlProcessInfo_v1_t info = {st.procs[i].pid, st.procs[i].used};
            memcpy(slot, &info, sizeof info);
        } else {
            nvmlProcessInfo_t info = {st.procs[i].pid, st.procs[i].used, NOT_AVAILABLE_UINT,
                                      NOT_AVAILABLE_UINT};
            memcpy(slot, &info, sizeof info);
        }
    }
    *count = needed;
out:
    free(alive);
    free_state(&st);
    return ret;
}

/* ---- exported API ---- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    struct state st;
    nvmlReturn_t ret = begin(&st, 0);
    (void)flags;
    if (ret == NVML_SUCCESS && st.init_failed)
        ret = NVML_ERROR_DRIVER_NOT_LOADED;
    if (ret == NVML_SUCCESS)
        __atomic_add_fetch(&init_refcount, 1, __ATOMIC_ACQ_REL);
    free_state(&st);
    return ret;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    struct state st;
    nvmlReturn_t ret = begin(&st, 0);
    int cur = __atomic_load_n(&init_refcount, __ATOMIC_ACQUIRE);
    free_state(&st);
    if (ret != NVML_SUCCESS)
        return ret;
    /* Decrement only above zero, like NVML's refcounted init. */
    do {
        if (cur <= 0)
            return NVML_ERROR_UNINITIALIZED;
    } while (!__atomic_compare_exchange_n(&init_refcount, &cur, cur - 1, 0, __ATOMIC_ACQ_REL,
                                          __ATOMIC_ACQUIRE));
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* Copies s into buf as NVML does: INSUFFICIENT_SIZE when it (with NUL) won't fit. */
static nvmlReturn_t copy_string(char *buf, unsigned length, const char *s)
{
    size_t n = strlen(s);
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (length < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, s, n + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    struct state st;
    nvmlReturn_t ret = begin(&st, 1);
    free_state(&st);
    return ret != NVML_SUCCESS ? ret : copy_string(version, length, DRIVER_VERSION);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    struct state st;
    nvmlReturn_t ret = begin(&st, 1);
    if (ret == NVML_SUCCESS && !deviceCount)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS)
        *deviceCount = st.gpus;
    free_state(&st);
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    struct state st;
    nvmlReturn_t ret = begin(&st, 1);
    if (ret == NVML_SUCCESS && (!device || index >= st.gpus))
        ret = NVML_ERROR_INVALID_ARGUMENT;
    if (ret == NVML_SUCCESS && gpu_is_lost(&st, index))
        ret = NVML_ERROR_GPU_IS_LOST;
    if (ret == NVML_SUCCESS)
        *device = &devices[index];
    free_state(&st);
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct state st;
    unsigned idx;
    nvmlReturn_t ret = begin(&st, 1);
    if (ret == NVML_SUCCESS)
        ret = device_index(&st, device, &idx);
    free_state(&st);
    return ret != NVML_SUCCESS ? ret : copy_string(name, length, GPU_NAME);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct state st;
    unsigned idx = 0;
    char buf[64];
    nvmlReturn_t ret = begin(&st, 1);
    if (ret == NVML_SUCCESS)
        ret = device_index(&st, device, &idx);
    free_state(&st);
    if (ret != NVML_SUCCESS)
        return ret;
    /* Well-formed (hex, 8-4-4-4-12) so code that parses UUIDs accepts it. */
    snprintf(buf, sizeof buf, "GPU-fa4efa4e-0000-0000-0000-%012x", idx);
    return copy_string(uuid, length, buf);
}

/* total/used/free for one GPU: used is what its live listed processes hold. */
static nvmlReturn_t memory(nvmlDevice_t device, unsigned long long *total,
                           unsigned long long *used, unsigned long long *free_b)
{
    struct state st;
    unsigned idx;
    size_t i;
    nvmlReturn_t ret = begin(&st, 1);
    if (ret == NVML_SUCCESS)
        ret = device_index(&st, device, &idx);
    if (ret == NVML_SUCCESS) {
        unsigned long long u = 0;
        for (i = 0; i < st.nprocs; i++)
            if (st.procs[i].gpu == idx && pid_alive(st.procs[i].pid))
                u = (u + st.procs[i].used < u) ? ULLONG_MAX : u + st.procs[i].used;
        if (u > GPU_TOTAL_BYTES)
            u = GPU_TOTAL_BYTES;
        *total = GPU_TOTAL_BYTES;
        *used = u;
        *free_b = GPU_TOTAL_BYTES - u;
    }
    free_state(&st);
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem)
{
    unsigned long long t, u, f;
    nvmlReturn_t ret;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    ret = memory(device, &t, &u, &f);
    if (ret == NVML_SUCCESS)
        *mem = (nvmlMemory_t){t, f, u};
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *mem)
{
    unsigned long long t, u, f;
    nvmlReturn_t ret;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != NVML_MEMORY_V2_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    ret = memory(device, &t, &u, &f);
    if (ret == NVML_SUCCESS) {
        mem->total = t;
        mem->reserved = 0;
        mem->free = f;
        mem->used = u;
    }
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *n,
                                                            nvmlProcessInfo_t *infos)
{
    return list_procs(d, n, infos, sizeof *infos, 0, KIND_COMPUTE);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *n,
                                                            nvmlProcessInfo_t *infos)
{
    return list_procs(d, n, infos, sizeof *infos, 0, KIND_COMPUTE);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *n,
                                                         nvmlProcessInfo_v1_t *infos)
{
    return list_procs(d, n, infos, sizeof *infos, 1, KIND_COMPUTE);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned *n,
                                                             nvmlProcessInfo_t *infos)
{
    return list_procs(d, n, infos, sizeof *infos, 0, KIND_GRAPHICS);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned *n,
                                                             nvmlProcessInfo_t *infos)
{
    return list_procs(d, n, infos, sizeof *infos, 0, KIND_GRAPHICS);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned *n,
                                                          nvmlProcessInfo_v1_t *infos)
{
    return list_procs(d, n, infos, sizeof *infos, 1, KIND_GRAPHICS);
}
