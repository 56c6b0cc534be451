/* Batch decoding of LZ4 image rows, without the GIL: the hot loop of sampling compressed images.
 *
 * A row of a sharded array encoded with numcodecs.lz4 is a little-endian int32 decoded size followed by one LZ4
 * block (FORMAT.md, Arrays). Decoding a batch row by row from Python costs more in interpreter overhead than in LZ4,
 * and holds the GIL between rows, so threads cannot share the work. These functions decode many rows per call with
 * the GIL released: her_store/reader.py splits a batch across its io_threads, each calling one of them.
 *
 *   pread_lz4(fds, offsets, nbytes, dst, out, row_nbytes) -> (index, errno, inblock)
 *       row i: nbytes[i] bytes at offsets[i] of file descriptor fds[i], decoded into row dst[i] of out. Rows that
 *       follow each other in one file (given in that order) are read with one pread: a sampled transition's two
 *       frames, t and t + 1, are then one disk read.
 *       A row with nbytes[i] < 0 (never written) fails: a gather asks only for rows that were written.
 *   map_lz4(maps, slots, offsets, nbytes, dst, out, row_nbytes) -> (index, errno, inblock)
 *       the same from mapped files (map_file): row i at maps[slots[i]][offsets[i] : offsets[i] + nbytes[i]], decoded
 *       straight from the page cache, without a system call per row (what a pread costs is most of a warm read). A
 *       map that turns out shorter than its file was (cut short in place: SIGBUS) fails its row with EIO.
 *   map_lz4_start(maps, slots, offsets, nbytes, dst, out, row_nbytes[, threads]) -> Task
 *       map_lz4 on threads of its own (1 by default), started before this returns; the caller meanwhile runs
 *       Python (the rest of a batch). Task.wait() decodes the rows the threads have not taken yet (threads and
 *       caller take 8 rows at a time: each does as much as it can), joins them and returns what map_lz4 would
 *       have (the first failing row found); Task.done() tells whether the threads are done.
 *   map_file(fd, offset, length[, random]) -> Mapping
 *       bytes offset .. offset + length of an open file, mapped read-only as a buffer; with random (the default)
 *       MADV_RANDOM: a page fault reads its page alone, else the kernel reads ahead as it sees fit (rows read in
 *       order). Unmapped when the last reference goes. It holds no file descriptor. Its drop_pages()
 *       lets its pages go from this process, so that the page cache can drop them (a cold start).
 *   take_rows(src, rows, first, skip, out, row_nbytes[, at]) -> (index, errno)
 *       an uncompressed array's gather: out[i] (or out[at[i]]) = row rows[i] - first of a mapped chunk (its row k at skip + k *
 *       row_nbytes), as numpy's take, but a page the file no longer has fails the row with EIO instead of SIGBUS.
 *   decode_lz4(src, offsets, nbytes, out, row_nbytes) -> (index, errno)
 *       the same, reading row i from src[offsets[i] : offsets[i] + nbytes[i]] (a shard fetched whole).
 *   encode_lz4(rows, row_nbytes, acceleration) -> list of bytes
 *       the writer's side: each row of rows encoded (size header + block), a bytes each. rows is a buffer of whole
 *       rows, each C-contiguous, taken at any stride (an env's frames in a StepWriter's (step, env, ...) buffer).
 *   encode_lz4_start(rows, row_nbytes, acceleration[, threads]) -> Task
 *       encode_lz4 on threads of its own, started before this returns, as map_lz4_start: the caller stages the
 *       episode's other fields meanwhile, and Task.wait() encodes the rows the threads have not taken yet and
 *       returns the list (or raises what encode_lz4 would). The rows are held until then: they must not change.
 *   shard_body(rows) -> bytearray
 *       the writer's shard: the rows' bytes (None: a row never written) and the shard index, in one pass; the last 4
 *       bytes are left for the index's crc32c.
 *
 *   crc32_runs(data, starts, ends, crcs) -> None
 *       verify's side: crcs[i] = zlib.crc32(data[starts[i] : ends[i]], crcs[i]) for every i (uint32 crcs, updated in
 *       place; int64 starts and ends), so that a chunk's episodes are checksummed in one call without the GIL.
 *   crc32_all(buffers, value=0) -> int
 *       zlib.crc32 over the buffers one after the other (an episode's encoded frames), without joining them.
 *   same_bytes(a, b) -> bool
 *       whether two C-contiguous buffers hold the same bytes: a StepWriter's check that an env's observation is its
 *       last step's next observation, without copying either.
 *   tree_set(sums, mins, nodes, values) -> None
 *       a priority tree's update (her_store.sampling.sum_tree): sums[nodes[i]] = values[i] and mins[nodes[i]] =
 *       values[i] (inf where 0), then every node above, each from its two children, up to the root (node 1). sums and
 *       mins are float64 of 2 * L nodes, L a power of two, leaves at L .. 2L - 1; nodes int64, values float64.
 *   tree_find(sums, u, out) -> None
 *       the walk of each u[i] from the root down to a leaf node (out[i], int64): left while u < the left subtree's sum
 *       (a subtree of sum 0 is never entered), less the left sum when going right.
 *   crc32(data, value=0) -> int
 *       zlib.crc32(data, value) for any C-contiguous bytes-like data, without the GIL above a few KiB: verify's and
 *       the writer's other checksums. Both crc32 functions use her_crc32 (crc32.c: carry-less multiplication where
 *       the CPU has it, at memory speed).
 *
 * The decoders return (-1, 0) when every row decoded to exactly row_nbytes, else the first failing row and an errno (0 when
 * the bytes are not one row's LZ4 block). Nothing is trusted: every range is checked against its source. pread_lz4 and
 * map_lz4 add the 512-byte blocks the calling thread read from the disk meanwhile (getrusage's ru_inblock: 0 when
 * every row was in the page cache), by which the reader chooses between them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>

#include "crc32.h"
#define LZ4_STATIC_LINKING_ONLY /* LZ4_compress_fast_extState_fastReset */
#include "lz4.h"

typedef struct {
    Py_buffer fds, offsets, nbytes, out, src;
    int have_src;
} Args;

static void release(Args *a) {
    if (a->fds.buf) PyBuffer_Release(&a->fds);
    if (a->offsets.buf) PyBuffer_Release(&a->offsets);
    if (a->nbytes.buf) PyBuffer_Release(&a->nbytes);
    if (a->out.buf) PyBuffer_Release(&a->out);
    if (a->have_src && a->src.buf) PyBuffer_Release(&a->src);
}

/* rows in the batch, after checking every buffer's size against it; -1 with an exception set otherwise */
static Py_ssize_t check(Args *a, Py_ssize_t row_nbytes, int with_fds) {
    Py_ssize_t n = a->offsets.len / 8;
    if (row_nbytes <= 0 || row_nbytes > INT32_MAX - 16) {
        PyErr_SetString(PyExc_ValueError, "row_nbytes must be positive and below 2 GiB");
        return -1;
    }
    if (a->offsets.len != n * 8 || a->nbytes.len != n * 8 || (with_fds && a->fds.len != n * 4)) {
        PyErr_SetString(PyExc_ValueError, "fds (int32), offsets and nbytes (int64) must hold one entry per row");
        return -1;
    }
    if (a->out.len < n * row_nbytes) {
        PyErr_SetString(PyExc_ValueError, "out is smaller than rows * row_nbytes");
        return -1;
    }
    return n;
}

/* decode one row's bytes (header + block) into dst; 0 when it is exactly one row */
static int decode_row(const char *raw, int64_t size, char *dst, Py_ssize_t row_nbytes) {
    if (size < 4) return -1;
    const unsigned char *h = (const unsigned char *)raw;
    uint32_t declared = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) | ((uint32_t)h[3] << 24);
    if ((int64_t)declared != row_nbytes || size - 4 > INT32_MAX) return -1;
    int got = LZ4_decompress_safe(raw + 4, dst, (int)(size - 4), (int)row_nbytes);
    return got == row_nbytes ? 0 : -1;
}

/* 512-byte blocks the calling thread has read from disks so far (0 where the system does not count them per thread) */
static long blocks_read(void) {
#ifdef RUSAGE_THREAD
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) == 0) return ru.ru_inblock;
#endif
    return 0;
}

#define RUN_BYTES (1 << 20) /* rows read in one pread: adjacent rows of one file, up to this many bytes */

static PyObject *pread_lz4(PyObject *self, PyObject *args) {
    Args a;
    memset(&a, 0, sizeof a);
    Py_buffer dst_rows;
    memset(&dst_rows, 0, sizeof dst_rows);
    Py_ssize_t row_nbytes;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*n", &a.fds, &a.offsets, &a.nbytes, &dst_rows, &a.out, &row_nbytes)) {
        release(&a);
        if (dst_rows.buf) PyBuffer_Release(&dst_rows);
        return NULL;
    }
    Py_ssize_t n = check(&a, row_nbytes, 1);
    if (n >= 0 && dst_rows.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "dst (int64) must hold one entry per row");
        n = -1;
    }
    const int64_t *dst_of = dst_rows.buf;
    Py_ssize_t out_rows = a.out.len / (row_nbytes > 0 ? row_nbytes : 1);
    for (Py_ssize_t i = 0; n >= 0 && i < n; i++) {
        if (dst_of[i] < 0 || dst_of[i] >= out_rows) {
            PyErr_SetString(PyExc_ValueError, "dst names a row outside out");
            n = -1;
        }
    }
    if (n < 0) {
        release(&a);
        PyBuffer_Release(&dst_rows);
        return NULL;
    }
    const int32_t *fds = a.fds.buf;
    const int64_t *offsets = a.offsets.buf, *nbytes = a.nbytes.buf;
    char *out = a.out.buf;
    Py_ssize_t failed = -1;
    int err = 0;
    const int64_t row_bound = (int64_t)row_nbytes + row_nbytes / 4 + 1024; /* above LZ4's bound for one row */
    long inblock = 0;
    Py_BEGIN_ALLOW_THREADS
    inblock = blocks_read();
    size_t cap = 0;
    char *tmp = NULL;
    Py_ssize_t i = 0;
    while (i < n && failed < 0) {
        /* a run: rows i..j-1 of one file, each starting where the previous ended (frames t and t + 1 of an
           episode, sorted next to each other by the caller), read with one pread */
        Py_ssize_t j = i;
        int64_t total = 0;
        while (j < n) {
            /* each entry is read once (here, and below from the decoded sizes' sum): another thread changing the
               caller's arrays meanwhile can make rows fail, never a read or write outside tmp or out */
            int64_t size = nbytes[j], at = offsets[j];
            if (size < 0 || at < 0 || size > row_bound) break;
            if (j > i && (fds[j] != fds[i] || at != offsets[i] + total || total + size > RUN_BYTES)) break;
            total += size;
            j++;
        }
        if (j == i) { /* row i itself is not a row to read */
            failed = i;
            break;
        }
        if ((size_t)total > cap) {
            char *grown = realloc(tmp, (size_t)total);
            if (!grown) {
                failed = i;
                err = ENOMEM;
                break;
            }
            tmp = grown;
            cap = (size_t)total;
        }
        int64_t done = 0;
        while (done < total) {
            ssize_t r = pread(fds[i], tmp + done, (size_t)(total - done), (off_t)(offsets[i] + done));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                err = r < 0 ? errno : EIO; /* a file shorter than its index says */
                break;
            }
            done += r;
        }
        int64_t at = 0;
        for (Py_ssize_t k = i; k < j; k++) {
            /* with a short read, the rows it did not reach fail, the ones before are decoded */
            int64_t size = nbytes[k], row = dst_of[k];
            if (size < 0 || at + size > done || row < 0 || row >= out_rows ||
                decode_row(tmp + at, size, out + row * row_nbytes, row_nbytes) != 0) {
                failed = k;
                if (size >= 0 && at + size <= done) err = 0;
                break;
            }
            at += size;
        }
        i = j;
    }
    free(tmp);
    inblock = blocks_read() - inblock;
    Py_END_ALLOW_THREADS
    release(&a);
    PyBuffer_Release(&dst_rows);
    return Py_BuildValue("(nil)", failed, failed >= 0 ? err : 0, inblock);
}

/* A read-only mapping of part of a file, as a buffer (map_file). */
typedef struct {
    PyObject_HEAD
    char *base;    /* the mapping, from a page boundary */
    size_t mapped; /* its length */
    size_t skip;   /* where the bytes asked for start in it */
    Py_ssize_t len;
} Mapping;

static void mapping_dealloc(Mapping *m) {
    if (m->base) munmap(m->base, m->mapped);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static int mapping_getbuffer(Mapping *m, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)m, m->base + m->skip, m->len, 1, flags);
}

static Py_ssize_t mapping_length(Mapping *m) { return m->len; }

static PyObject *mapping_drop_pages(Mapping *m, PyObject *unused) {
    if (madvise(m->base, m->mapped, MADV_DONTNEED) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef mapping_methods[] = {
    {"drop_pages", (PyCFunction)mapping_drop_pages, METH_NOARGS,
     "Unmap its pages from this process (MADV_DONTNEED), so that the page cache can let them go (a cold start)."},
    {NULL, NULL, 0, NULL},
};

static PyBufferProcs mapping_as_buffer = {(getbufferproc)mapping_getbuffer, NULL};
static PySequenceMethods mapping_as_sequence = {.sq_length = (lenfunc)mapping_length};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "her_store._kernels._frames.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_dealloc = (destructor)mapping_dealloc,
    .tp_as_buffer = &mapping_as_buffer,
    .tp_as_sequence = &mapping_as_sequence,
    .tp_methods = mapping_methods,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Bytes of a file mapped read-only (map_file), unmapped when the last reference goes.",
};

static PyObject *map_file(PyObject *self, PyObject *args) {
    int fd;
    long long offset, length;
    int random = 1;
    if (!PyArg_ParseTuple(args, "iLL|p", &fd, &offset, &length, &random)) return NULL;
    if (offset < 0 || length <= 0 || length > PY_SSIZE_T_MAX - 65536) {
        PyErr_SetString(PyExc_ValueError, "map_file needs offset >= 0 and a length of at least one byte");
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (offset > (long long)st.st_size || length > (long long)st.st_size - offset) {
        PyErr_SetString(PyExc_ValueError, "map_file: offset + length is past the end of the file");
        return NULL;
    }
    long page = sysconf(_SC_PAGESIZE);
    size_t skip = (size_t)(offset % page), mapped = skip + (size_t)length;
    void *base;
    Py_BEGIN_ALLOW_THREADS
    base = mmap(NULL, mapped, PROT_READ, MAP_SHARED, fd, (off_t)(offset - (long long)skip));
    /* advice only: its failure changes nothing read */
    if (base != MAP_FAILED && random) madvise(base, mapped, MADV_RANDOM);
    Py_END_ALLOW_THREADS
    if (base == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    Mapping *m = PyObject_New(Mapping, &MappingType);
    if (!m) {
        munmap(base, mapped);
        return NULL;
    }
    m->base = base, m->mapped = mapped, m->skip = skip, m->len = (Py_ssize_t)length;
    return (PyObject *)m;
}

/* map_lz4's work: its arguments, held (buffer exports) from parsing until released, and its result. Threads share
   a job's rows: each takes the next TAKE rows not taken yet until none are left or a row failed. */
typedef struct {
    Args a; /* offsets, nbytes, out */
    Py_buffer slots, dst;
    Py_buffer *views; /* the maps' buffers, `held` of them acquired */
    Py_ssize_t held, n, row_nbytes, out_rows;
    Py_ssize_t next;        /* the first row no thread has taken (atomic) */
    int stop;               /* set when a row failed (atomic) */
    pthread_mutex_t failing; /* guards failed and err */
    Py_ssize_t failed;      /* the first failing row found, -1 for none */
    int err;
    long inblock;           /* the blocks its threads read from disk (atomic) */
} MapJob;
#define TAKE 8

/* A mapped file that shrinks under its mapping (cut short in place by another process) raises SIGBUS at the first
   read of a page past its end, which would kill the process. A handler of ours turns such a fault into a failed row
   (EIO, as pread's short read): a fault (si_code > 0) of a thread decoding from mappings, at an address inside one of
   its maps, jumps back to its decode. Every decode from mappings first makes one of ours SIGBUS's handler where none
   is: the first in a process, and the first after another handler replaced ours (torch installs its own in each
   DataLoader worker, after the fork, over ours inherited from a parent that had decoded). Any other SIGBUS goes to
   the disposition that handler replaced: its handler is called, a default one ends the process, an ignored signal
   sent by a process stays ignored. Each time ours is installed over another handler it is a handler of the next
   level (a function of its own), so that the handler it replaced, which had replaced ours and may pass the signal
   on to the one it replaced (faulthandler's puts it back and raises the signal again), reaches ours of the level
   below, which passes it on below that; and if that handler's owner puts back ours of the level below (faulthandler
   disabled), the levels above are forgotten. A Python handler returns, so a fault outside a decode from mappings
   runs again and faults again forever (as numpy's copy did: Python cannot handle such a signal). */
static __thread __attribute__((tls_model("initial-exec"))) const MapJob *volatile bus_job; /* the job this thread decodes from mappings, or NULL */
static __thread __attribute__((tls_model("initial-exec"))) sigjmp_buf *bus_jump;
#define BUS_LEVELS 8
static struct sigaction bus_before[BUS_LEVELS]; /* the disposition ours of each level replaced */
static int bus_top = -1;                        /* the level of ours installed last, -1 before the first */

static int in_maps(const MapJob *j, const char *addr) {
    for (Py_ssize_t k = 0; k < j->held; k++) {
        const char *b = j->views[k].buf;
        if (addr >= b && addr < b + j->views[k].len) return 1;
    }
    return 0;
}

/* SIGBUS reaching ours of level `level` */
static void on_sigbus(int level, int sig, siginfo_t *info, void *ctx) {
    const MapJob *j = bus_job;
    if (j && info && info->si_code > 0 && in_maps(j, info->si_addr)) siglongjmp(*bus_jump, 1);
    const struct sigaction *before = &bus_before[level];
    if (before->sa_flags & SA_SIGINFO) {
        if (before->sa_sigaction) before->sa_sigaction(sig, info, ctx);
        return;
    }
    if (before->sa_handler != SIG_DFL && before->sa_handler != SIG_IGN) {
        before->sa_handler(sig);
        return;
    }
    if (before->sa_handler == SIG_IGN && info && info->si_code <= 0) return; /* sent by a process, ignored */
    struct sigaction dfl; /* the default: raised again, the signal ends the process once this handler returns */
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &dfl, NULL);
    raise(sig);
}

#define BUS_LEVEL(k) \
    static void on_sigbus_##k(int sig, siginfo_t *info, void *ctx) { on_sigbus(k, sig, info, ctx); }
BUS_LEVEL(0)
BUS_LEVEL(1)
BUS_LEVEL(2)
BUS_LEVEL(3)
BUS_LEVEL(4)
BUS_LEVEL(5)
BUS_LEVEL(6)
BUS_LEVEL(7)
static void (*const bus_handlers[BUS_LEVELS])(int, siginfo_t *, void *) = {
    on_sigbus_0, on_sigbus_1, on_sigbus_2, on_sigbus_3, on_sigbus_4, on_sigbus_5, on_sigbus_6, on_sigbus_7};

/* the level of ours that `sa` installs, or -1 when it is not ours */
static int bus_level(const struct sigaction *sa) {
    for (int k = 0; (sa->sa_flags & SA_SIGINFO) && k < BUS_LEVELS; k++) {
        if (sa->sa_sigaction == bus_handlers[k]) return k;
    }
    return -1;
}

/* make ours SIGBUS's handler where another disposition is (one system call when ours is), at the level above the
   last one installed (the top one, again, past BUS_LEVELS); of threads arming at once, one installs it and keeps
   what it replaced, the others find it */
static void bus_arm(void) {
    struct sigaction now, ours, replaced;
    if (sigaction(SIGBUS, NULL, &now) != 0) return;
    int k = bus_level(&now);
    if (k < 0) {
        k = bus_top + 1 < BUS_LEVELS ? bus_top + 1 : BUS_LEVELS - 1;
        bus_before[k] = now;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = bus_handlers[k];
        ours.sa_flags = SA_SIGINFO;
        sigemptyset(&ours.sa_mask);
        if (sigaction(SIGBUS, &ours, &replaced) != 0) return;
        if (bus_level(&replaced) < 0) bus_before[k] = replaced; /* (what another thread installed meanwhile) */
    }
    if (bus_top != k) bus_top = k;
}

/* guard the calling thread's reads from j's maps: a fault there jumps to `jump` (set by the caller's sigsetjmp) */
static void bus_guard(sigjmp_buf *jump, const MapJob *j) {
    bus_arm();
    bus_jump = jump;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    bus_job = j;
}

/* the next rows no run has taken of a job's n, `take` at a time from its counter: 1 and [*first, *end), or 0 */
static int take_next(Py_ssize_t *next, Py_ssize_t n, Py_ssize_t take, Py_ssize_t *first, Py_ssize_t *end) {
    *first = __atomic_fetch_add(next, take, __ATOMIC_RELAXED);
    if (*first >= n) return 0;
    *end = *first + take < n ? *first + take : n;
    return 1;
}

/* release every buffer a MapJob holds (with the GIL) */
static void map_job_release(MapJob *j) {
    for (Py_ssize_t i = 0; i < j->held; i++) {
        if (j->views[i].obj) PyBuffer_Release(&j->views[i]);
    }
    PyMem_Free(j->views);
    j->views = NULL, j->held = 0;
    release(&j->a);
    if (j->slots.buf) PyBuffer_Release(&j->slots);
    if (j->dst.buf) PyBuffer_Release(&j->dst);
    j->slots.buf = j->dst.buf = NULL;
}

/* parse and check map_lz4's arguments into j (zeroed); 0, or -1 with an exception set and nothing held */
static int map_job_parse(MapJob *j, PyObject *args) {
    PyObject *maps;
    if (!PyArg_ParseTuple(args, "O!y*y*y*y*w*n", &PyTuple_Type, &maps, &j->slots, &j->a.offsets, &j->a.nbytes, &j->dst,
                          &j->a.out, &j->row_nbytes)) {
        map_job_release(j);
        return -1;
    }
    Py_ssize_t n = check(&j->a, j->row_nbytes, 0), k = PyTuple_GET_SIZE(maps);
    if (n >= 0 && (j->slots.len != n * 4 || j->dst.len != n * 8)) {
        PyErr_SetString(PyExc_ValueError, "slots (int32) and dst (int64) must hold one entry per row");
        n = -1;
    }
    if (n >= 0 && !(j->views = PyMem_Calloc(k ? (size_t)k : 1, sizeof *j->views))) {
        PyErr_NoMemory();
        n = -1;
    }
    for (; n >= 0 && j->held < k; j->held++) { /* each map held (a buffer export) until every row is decoded */
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(maps, j->held), &j->views[j->held], PyBUF_SIMPLE) < 0) n = -1;
    }
    const int32_t *slots = j->slots.buf;
    const int64_t *dst_of = j->dst.buf;
    Py_ssize_t out_rows = j->a.out.len / (j->row_nbytes > 0 ? j->row_nbytes : 1);
    for (Py_ssize_t i = 0; n >= 0 && i < n; i++) {
        if (slots[i] < 0 || slots[i] >= k || dst_of[i] < 0 || dst_of[i] >= out_rows) {
            PyErr_SetString(PyExc_ValueError, "a slot names no map, or dst a row outside out");
            n = -1;
        }
    }
    if (n < 0) {
        map_job_release(j);
        return -1;
    }
    j->n = n, j->out_rows = out_rows, j->failed = -1;
    pthread_mutex_init(&j->failing, NULL);
    return 0;
}

/* row i of a job failed (errno err, 0 when its bytes are not one row's block): the smallest such row is kept */
static void map_job_fail(MapJob *j, Py_ssize_t i, int err) {
    pthread_mutex_lock(&j->failing);
    if (j->failed < 0 || i < j->failed) j->failed = i, j->err = err;
    pthread_mutex_unlock(&j->failing);
    __atomic_store_n(&j->stop, 1, __ATOMIC_RELAXED);
}

/* decode rows of a parsed job not taken yet by another thread, TAKE at a time (without the GIL) */
static void map_job_run(MapJob *j) {
    const int32_t *slots = j->slots.buf;
    const int64_t *offsets = j->a.offsets.buf, *nbytes = j->a.nbytes.buf, *dst_of = j->dst.buf;
    char *out = j->a.out.buf;
    long before = blocks_read();
    sigjmp_buf jump;
    volatile Py_ssize_t at_row = 0; /* the row being decoded, as SIGBUS finds it */
    if (sigsetjmp(jump, 1)) { /* a page of a mapped file past its end: the file shrank under its mapping */
        bus_job = NULL;
        map_job_fail(j, at_row, EIO);
        __atomic_add_fetch(&j->inblock, blocks_read() - before, __ATOMIC_RELAXED);
        return;
    }
    bus_guard(&jump, j);
    Py_ssize_t first, end;
    while (!__atomic_load_n(&j->stop, __ATOMIC_RELAXED) && take_next(&j->next, j->n, TAKE, &first, &end)) {
        for (Py_ssize_t i = first; i < end; i++) {
            at_row = i;
            /* each entry read once and checked as it is used: the caller's arrays may share memory with out, or be
               changed by another thread meanwhile; then rows fail, and nothing is read or written outside a buffer */
            int32_t slot = slots[i];
            int64_t size = nbytes[i], at = offsets[i], row = dst_of[i];
            const Py_buffer *v = slot >= 0 && slot < j->held ? &j->views[slot] : NULL;
            if (!v || row < 0 || row >= j->out_rows || size < 0 || at < 0 || at > v->len || size > v->len - at ||
                decode_row((const char *)v->buf + at, size, out + row * j->row_nbytes, j->row_nbytes) != 0) {
                map_job_fail(j, i, 0);
                break;
            }
        }
    }
    bus_job = NULL;
    __atomic_add_fetch(&j->inblock, blocks_read() - before, __ATOMIC_RELAXED);
}

/* take_rows(src, rows, first, skip, out, row_nbytes[, at]) -> (index, errno): out[i] (out[at[i]]) = row rows[i] - first
   of src, whose row k is bytes skip + k * row_nbytes .. (a mapped chunk of an uncompressed array). A row outside src,
   or an at outside out, fails (errno 0);
   a page the file no longer has (cut short in place under its mapping: SIGBUS) fails its row with EIO, where
   numpy's copy would have killed the process. The GIL is released, as numpy's take releases it: a cold row is a
   page fault, a disk read, and a store larger than RAM overlaps them across threads. */
static PyObject *take_rows(PyObject *self, PyObject *args) {
    Py_buffer src, rows, dst, at = {0};
    Py_ssize_t first, skip, row_nbytes;
    if (!PyArg_ParseTuple(args, "y*y*nnw*n|y*", &src, &rows, &first, &skip, &dst, &row_nbytes, &at)) return NULL;
    Py_ssize_t n = rows.len / 8, out_rows = row_nbytes > 0 ? dst.len / row_nbytes : 0;
    const int64_t *to = at.buf; /* out's row for each row (default: i) */
    int bad = row_nbytes <= 0 || rows.len != n * 8 || skip < 0 || skip > src.len;
    bad = bad || (to ? at.len != n * 8 : out_rows < n);
    if (bad) {
        PyBuffer_Release(&src), PyBuffer_Release(&rows), PyBuffer_Release(&dst);
        if (at.obj) PyBuffer_Release(&at);
        PyErr_SetString(PyExc_ValueError, "rows (and at) must be int64 (8 bytes an entry), out must hold them, "
                                          "row_nbytes > 0, skip within src");
        return NULL;
    }
    MapJob j; /* what the SIGBUS handler asks about: the one mapping read from */
    memset(&j, 0, sizeof j);
    j.views = &src, j.held = 1;
    const int64_t *want = rows.buf;
    char *out = dst.buf;
    const char *from = (const char *)src.buf + skip;
    int64_t have = ((int64_t)src.len - skip) / row_nbytes;
    volatile Py_ssize_t at_row = 0, failed = -1;
    volatile int err = 0;
    PyThreadState *saved = PyEval_SaveThread();
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1)) { /* a page of the file past its end: the file shrank under its mapping */
        bus_job = NULL;
        failed = at_row, err = EIO;
    } else {
        bus_guard(&jump, &j);
        for (Py_ssize_t i = 0; i < n; i++) {
            at_row = i;
            /* each entry read once and checked as it is used (rows and at may share memory with out) */
            int64_t r = want[i] - first, k = to ? to[i] : i;
            if (r < 0 || r >= have || k < 0 || k >= out_rows) {
                failed = i;
                break;
            }
            memcpy(out + k * row_nbytes, from + r * row_nbytes, (size_t)row_nbytes);
        }
        bus_job = NULL;
    }
    PyEval_RestoreThread(saved);
    PyBuffer_Release(&src), PyBuffer_Release(&rows), PyBuffer_Release(&dst);
    if (at.obj) PyBuffer_Release(&at);
    return Py_BuildValue("(ni)", (Py_ssize_t)failed, (int)err);
}

static PyObject *map_lz4(PyObject *self, PyObject *args) {
    MapJob j;
    memset(&j, 0, sizeof j);
    if (map_job_parse(&j, args) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    map_job_run(&j);
    Py_END_ALLOW_THREADS
    map_job_release(&j);
    pthread_mutex_destroy(&j.failing);
    return Py_BuildValue("(nil)", j.failed, j.err, j.inblock);
}

static PyObject *decode_lz4(PyObject *self, PyObject *args) {
    Args a;
    memset(&a, 0, sizeof a);
    a.have_src = 1;
    Py_ssize_t row_nbytes;
    if (!PyArg_ParseTuple(args, "y*y*y*w*n", &a.src, &a.offsets, &a.nbytes, &a.out, &row_nbytes)) {
        release(&a);
        return NULL;
    }
    Py_ssize_t n = check(&a, row_nbytes, 0);
    if (n < 0) {
        release(&a);
        return NULL;
    }
    const char *src = a.src.buf;
    int64_t src_len = (int64_t)a.src.len;
    const int64_t *offsets = a.offsets.buf, *nbytes = a.nbytes.buf;
    char *out = a.out.buf;
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *dst = out + i * row_nbytes;
        int64_t size = nbytes[i], at = offsets[i];
        if (size < 0 || at < 0 || at > src_len || size > src_len - at || decode_row(src + at, size, dst, row_nbytes) != 0) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    release(&a);
    return Py_BuildValue("(ni)", failed, 0);
}

/* the row count and row stride of a buffer whose first axis is rows of row_nbytes C-contiguous bytes each (a
   C-contiguous buffer, or rows taken at any stride from a larger array, 0 for one row repeated); 0, or -1 with an
   exception set */
static int row_layout(const Py_buffer *v, Py_ssize_t row_nbytes, Py_ssize_t *n, Py_ssize_t *stride) {
    if (row_nbytes <= 0 || row_nbytes > LZ4_MAX_INPUT_SIZE) {
        PyErr_SetString(PyExc_ValueError, "row_nbytes must be 1 .. LZ4_MAX_INPUT_SIZE");
        return -1;
    }
    if (v->ndim <= 1 && (v->strides == NULL || v->ndim == 0 || v->strides[0] == v->itemsize)) { /* flat bytes */
        if (v->len % row_nbytes != 0) goto not_rows;
        *n = v->len / row_nbytes, *stride = row_nbytes;
        return 0;
    }
    if (v->suboffsets != NULL) goto not_rows;
    Py_ssize_t inner = v->itemsize; /* the bytes of one row, checked C-contiguous from the last axis up */
    for (int k = v->ndim - 1; k >= 1; k--) {
        if (v->shape[k] > 1 && v->strides[k] != inner) goto not_rows;
        inner *= v->shape[k];
    }
    if (inner != row_nbytes) goto not_rows;
    *n = v->shape[0], *stride = v->strides[0];
    return 0;
not_rows:
    PyErr_SetString(PyExc_ValueError, "rows must hold whole rows of row_nbytes (1 .. LZ4_MAX_INPUT_SIZE) bytes, each "
                                      "C-contiguous");
    return -1;
}

/* Per thread, the buffer encode_lz4 packs encoded rows into, kept for its next call (up to SCRATCH_KEEP bytes; freed
   when the thread ends): a buffer allocated afresh each call faults in new pages, which the kernel zeroes, about as
   many bytes again as the rows encoded. */
#define SCRATCH_KEEP ((size_t)8 << 20)
typedef struct {
    char *buf;
    size_t cap;
} Scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ok;

static void scratch_free(void *p) {
    Scratch *s = p;
    free(s->buf);
    free(s);
}

static void scratch_init(void) { scratch_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

/* the calling thread's kept buffer, or NULL (then the caller allocates one of its own) */
static Scratch *scratch_of_thread(void) {
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_ok) return NULL;
    Scratch *s = pthread_getspecific(scratch_key);
    if (!s && (s = calloc(1, sizeof *s)) != NULL && pthread_setspecific(scratch_key, s) != 0) {
        free(s);
        s = NULL;
    }
    return s;
}

/* room for `need` bytes in *buf (of *cap bytes), growing it; 0, or -1 when out of memory (*buf unchanged) */
static int ensure(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t grown = *cap ? *cap : need;
    while (grown < need) grown *= 2;
    char *p = realloc(*buf, grown);
    if (!p) return -1;
    *buf = p, *cap = grown;
    return 0;
}

/* encode_lz4's work: the rows held (a buffer export) until released. Runs (threads, and the caller) share the rows
   as a MapJob's, a few at a time; each run packs the rows it encodes into a buffer of its own, and each row records
   which run packed it and where. */
#define MAX_THREADS 64
typedef struct {
    char *buf;
    size_t cap, used;
} Packed;

typedef struct {
    Py_buffer rows;
    Py_ssize_t n, stride, row_nbytes;
    int acceleration;
    Py_ssize_t next; /* the first row no run has taken (atomic) */
    int stop;        /* set when a row failed (atomic) */
    int failed;      /* why: 1 out of memory, 2 LZ4 failed (the first kept, atomic), 3 rows lost (a fork) */
    int runs;        /* runs started, each packing into packed[its number] (atomic) */
    Packed packed[MAX_THREADS + 1]; /* a task's threads and the one wait() that helps */
    int32_t *who;    /* per row: the run that packed it, -1 while none has */
    int64_t *at;     /* per row: where its bytes start in that run's buffer */
    int32_t *len;    /* per row: how many bytes (size header and block) */
} EncodeJob;

static void encode_job_release(EncodeJob *j) {
    if (j->rows.obj) PyBuffer_Release(&j->rows);
    j->rows.obj = NULL;
    for (int k = 0; k <= MAX_THREADS; k++) {
        /* rows lost to a fork: a run may have been growing its buffer then (the old one freed, the new one not
           recorded yet), so none of them is freed here */
        if (j->failed != 3) free(j->packed[k].buf);
        j->packed[k].buf = NULL;
    }
    free(j->who), free(j->at), free(j->len);
    j->who = NULL, j->at = NULL, j->len = NULL;
}

/* parse encode_lz4's arguments into j (zeroed); 0, or -1 with an exception set and nothing held */
static int encode_job_parse(EncodeJob *j, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "Oni", &obj, &j->row_nbytes, &j->acceleration)) return -1;
    if (PyObject_GetBuffer(obj, &j->rows, PyBUF_STRIDES) < 0) return -1;
    if (row_layout(&j->rows, j->row_nbytes, &j->n, &j->stride) < 0) {
        encode_job_release(j);
        return -1;
    }
    size_t n = j->n ? (size_t)j->n : 1;
    j->who = malloc(n * sizeof *j->who), j->at = malloc(n * sizeof *j->at), j->len = malloc(n * sizeof *j->len);
    if (!j->who || !j->at || !j->len) {
        encode_job_release(j);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < j->n; i++) j->who[i] = -1;
    return 0;
}

static void encode_job_fail(EncodeJob *j, int why) {
    int none = 0;
    __atomic_compare_exchange_n(&j->failed, &none, why, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    __atomic_store_n(&j->stop, 1, __ATOMIC_RELAXED);
}

/* encode rows of a parsed job not taken yet by another run, TAKE_ENCODE at a time (without the GIL); one LZ4 state
   serves every row of a run (a full reset per row would clear 16 KiB each time) */
#define TAKE_ENCODE 2 /* an episode's 50 frames or so: runs share them finely (a row costs microseconds to encode) */
static void encode_job_run(EncodeJob *j) {
    int me = __atomic_fetch_add(&j->runs, 1, __ATOMIC_RELAXED);
    if (me > MAX_THREADS) return; /* never: a task has at most MAX_THREADS threads and one helper */
    Packed *out = &j->packed[me];
    size_t bound = 4 + (size_t)LZ4_compressBound((int)j->row_nbytes);
    const char *src = j->rows.buf;
    LZ4_stream_t *state = NULL;
    Py_ssize_t first, end;
    while (!__atomic_load_n(&j->stop, __ATOMIC_RELAXED) && take_next(&j->next, j->n, TAKE_ENCODE, &first, &end)) {
        if (!state && (state = malloc(sizeof *state)) != NULL) LZ4_initStream(state, sizeof *state);
        /* room for the rows taken, and (rows up to a MiB) for a few more: a run most likely takes more */
        size_t more = bound <= ((size_t)1 << 20) ? 8 : 0;
        if (!state || ensure(&out->buf, &out->cap, out->used + ((size_t)(end - first) + more) * bound) < 0) {
            encode_job_fail(j, 1);
            break;
        }
        for (Py_ssize_t i = first; i < end; i++) {
            unsigned char *h = (unsigned char *)out->buf + out->used;
            uint32_t declared = (uint32_t)j->row_nbytes;
            h[0] = declared & 0xff, h[1] = (declared >> 8) & 0xff, h[2] = (declared >> 16) & 0xff, h[3] = (declared >> 24) & 0xff;
            int got = LZ4_compress_fast_extState_fastReset(state, src + i * j->stride, (char *)h + 4, (int)j->row_nbytes,
                                                           (int)(bound - 4), j->acceleration);
            if (got <= 0) {
                encode_job_fail(j, 2);
                free(state);
                return;
            }
            j->at[i] = (int64_t)out->used, j->len[i] = 4 + got;
            __atomic_store_n(&j->who[i], me, __ATOMIC_RELEASE); /* last: a row with a run is whole */
            out->used += 4 + (size_t)got;
        }
    }
    free(state);
}

/* the encoded rows, a bytes each (with the GIL); NULL with an exception set when a row failed or none encoded it */
static PyObject *encode_job_result(EncodeJob *j) {
    if (j->failed == 1) return PyErr_NoMemory();
    if (j->failed == 2) {
        PyErr_SetString(PyExc_RuntimeError, "LZ4 compression failed");
        return NULL;
    }
    PyObject *out = j->failed == 3 ? NULL : PyList_New(j->n);
    if (j->failed == 3) PyErr_SetString(PyExc_RuntimeError, "rows were left unencoded: the task's threads are gone (a fork)");
    for (Py_ssize_t i = 0; out && i < j->n; i++) {
        int32_t k = __atomic_load_n(&j->who[i], __ATOMIC_ACQUIRE);
        if (k < 0) { /* never taken (no run could take rows): not one of the rows is made up */
            PyErr_SetString(PyExc_RuntimeError, "rows were left unencoded");
            Py_CLEAR(out);
            break;
        }
        PyObject *row = PyBytes_FromStringAndSize(j->packed[k].buf + j->at[i], j->len[i]);
        if (!row) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, row);
    }
    return out;
}

static PyObject *encode_lz4(PyObject *self, PyObject *args) {
    EncodeJob j;
    memset(&j, 0, sizeof j);
    if (encode_job_parse(&j, args) < 0) return NULL;
    Scratch *kept = scratch_of_thread(); /* the calling thread packs into its kept buffer */
    if (kept) j.packed[0].buf = kept->buf, j.packed[0].cap = kept->cap, kept->buf = NULL, kept->cap = 0;
    Py_BEGIN_ALLOW_THREADS
    encode_job_run(&j);
    Py_END_ALLOW_THREADS
    PyObject *out = encode_job_result(&j);
    if (kept && j.packed[0].cap <= SCRATCH_KEEP) {
        kept->buf = j.packed[0].buf, kept->cap = j.packed[0].cap;
        j.packed[0].buf = NULL;
    }
    encode_job_release(&j);
    return out;
}

/* map_lz4 and encode_lz4 started on threads of their own (map_lz4_start, encode_lz4_start); wait() does the rows
   they have not taken yet, joins them, and returns what the call would have */
typedef struct {
    void (*run)(void *job);         /* take rows no run has taken yet (without the GIL) */
    void (*lost)(void *job);        /* its threads are gone (a forked child): rows may be undone */
    PyObject *(*result)(void *job); /* what wait() returns (with the GIL, the buffers still held) */
    void (*release)(void *job);     /* let the buffers go (with the GIL) */
} JobKind;

typedef struct {
    PyObject_HEAD
    const JobKind *kind;
    union {
        MapJob map;
        EncodeJob encode;
    } job;
    pthread_t threads[MAX_THREADS];
    int started;             /* threads to join */
    int running;             /* threads not done yet (atomic) */
    pthread_mutex_t joining; /* one wait() helps, joins and takes the result; the others wait for it to have */
    pid_t pid;               /* the process that started the threads (a forked child has none of them) */
    int held;                /* the job's buffers still held */
    int helped;              /* a wait() has taken rows (under joining): the next one must not, buffers may go */
    PyObject *result;        /* what the first wait() found, returned by the later ones (NULL: it raised) */
} Task;

static void map_kind_run(void *j) { map_job_run(j); }

static void map_kind_lost(void *p) {
    MapJob *j = p;
    if (j->failed < 0) j->failed = 0, j->err = ESRCH;
}

static PyObject *map_kind_result(void *p) {
    MapJob *j = p;
    return Py_BuildValue("(nil)", j->failed, j->err, j->inblock);
}

static void map_kind_release(void *p) {
    MapJob *j = p;
    map_job_release(j);
    pthread_mutex_destroy(&j->failing);
}

static void encode_kind_run(void *j) { encode_job_run(j); }
static void encode_kind_lost(void *j) { ((EncodeJob *)j)->failed = 3; }
static PyObject *encode_kind_result(void *j) { return encode_job_result(j); }
static void encode_kind_release(void *j) { encode_job_release(j); }

static const JobKind map_kind = {map_kind_run, map_kind_lost, map_kind_result, map_kind_release};
static const JobKind encode_kind = {encode_kind_run, encode_kind_lost, encode_kind_result, encode_kind_release};

static void *task_main(void *p) {
    Task *t = p;
    t->kind->run(&t->job);
    __atomic_sub_fetch(&t->running, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* (help with the rows and take the result, when help) join the threads and let the buffers go (with the GIL) */
static void task_help(Task *t) {
    __atomic_add_fetch(&t->running, 1, __ATOMIC_RELAXED); /* a run mid-way, as a thread's (a fork must tell) */
    t->kind->run(&t->job);
    __atomic_sub_fetch(&t->running, 1, __ATOMIC_RELEASE);
}

static void task_join(Task *t, int help) {
    int locked = 0;
    if (t->pid != getpid()) {
        /* a forked child: none of the parent's threads (nor its waiting one) is here, and the lock may be held by
           one of them. Rows a run had taken and not finished at the fork are lost; if none had, the rows not taken
           yet are done here. */
        t->started = 0;
        if (t->held && __atomic_load_n(&t->running, __ATOMIC_ACQUIRE) > 0) {
            t->kind->lost(&t->job);
        } else if (help && t->held && !t->helped) {
            Py_BEGIN_ALLOW_THREADS
            task_help(t);
            Py_END_ALLOW_THREADS
        }
        t->helped = 1;
        __atomic_store_n(&t->running, 0, __ATOMIC_RELEASE); /* no run of it is left here: done() */
    } else {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&t->joining);
        if (help && !t->helped) task_help(t);
        t->helped = 1;
        for (int k = 0; k < t->started; k++) pthread_join(t->threads[k], NULL);
        t->started = 0;
        Py_END_ALLOW_THREADS
        locked = 1;
    }
    if (t->held) {
        if (help) t->result = t->kind->result(&t->job); /* NULL with an exception: this wait() raises it */
        t->kind->release(&t->job);
        t->held = 0;
    } else if (help && !t->result) {
        PyErr_SetString(PyExc_RuntimeError, "the task failed, and its first wait() raised why");
    }
    if (locked) pthread_mutex_unlock(&t->joining);
}

static void task_dealloc(Task *t) {
    task_join(t, 0); /* its threads use buffers it holds: never let them go before they end */
    if (t->pid == getpid()) pthread_mutex_destroy(&t->joining);
    Py_XDECREF(t->result);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *task_wait(Task *t, PyObject *unused) {
    task_join(t, 1);
    Py_XINCREF(t->result);
    return t->result;
}

static PyObject *task_done(Task *t, PyObject *unused) {
    return PyBool_FromLong(__atomic_load_n(&t->running, __ATOMIC_ACQUIRE) == 0);
}

static PyMethodDef task_methods[] = {
    {"wait", (PyCFunction)task_wait, METH_NOARGS,
     "Do the rows its threads have not taken, wait for theirs, and return what the call would have (every wait())."},
    {"done", (PyCFunction)task_done, METH_NOARGS, "Whether its threads are done (without waiting)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TaskType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "her_store._kernels._frames.Task",
    .tp_basicsize = sizeof(Task),
    .tp_dealloc = (destructor)task_dealloc,
    .tp_methods = task_methods,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "map_lz4 or encode_lz4 under way on threads of their own (map_lz4_start, encode_lz4_start).",
};

/* a Task doing kind's job (parse parses the call's arguments but the last, the optional thread count: `given`
   of them when it is absent) on threads of its own, started before this returns */
static PyObject *task_start(PyObject *args, Py_ssize_t given, const JobKind *kind, int (*parse)(void *, PyObject *)) {
    Py_ssize_t n_args = PyTuple_GET_SIZE(args);
    int threads = 1;
    if (n_args == given + 1) {
        long asked = PyLong_AsLong(PyTuple_GET_ITEM(args, given));
        if (asked == -1 && PyErr_Occurred()) return NULL;
        if (asked < 1 || asked > MAX_THREADS) {
            PyErr_SetString(PyExc_ValueError, "threads must be 1 .. 64");
            return NULL;
        }
        threads = (int)asked;
    }
    PyObject *job_args = PyTuple_GetSlice(args, 0, n_args == given + 1 ? given : n_args);
    if (!job_args) return NULL;
    Task *t = PyObject_New(Task, &TaskType);
    if (!t) {
        Py_DECREF(job_args);
        return NULL;
    }
    memset(&t->job, 0, sizeof t->job);
    t->kind = kind;
    t->started = t->running = t->held = t->helped = 0;
    t->result = NULL;
    t->pid = getpid();
    pthread_mutex_init(&t->joining, NULL);
    int parsed = parse(&t->job, job_args);
    Py_DECREF(job_args);
    if (parsed < 0) {
        Py_DECREF(t);
        return NULL;
    }
    t->held = 1;
    for (int k = 0; k < threads; k++) { /* threads that cannot be had leave their rows to the others and wait() */
        __atomic_add_fetch(&t->running, 1, __ATOMIC_RELAXED);
        if (pthread_create(&t->threads[t->started], NULL, task_main, t) == 0) {
            t->started++;
        } else {
            __atomic_sub_fetch(&t->running, 1, __ATOMIC_RELAXED);
        }
    }
    return (PyObject *)t;
}

static int map_kind_parse(void *j, PyObject *args) { return map_job_parse(j, args); }
static int encode_kind_parse(void *j, PyObject *args) { return encode_job_parse(j, args); }

static PyObject *map_lz4_start(PyObject *self, PyObject *args) { return task_start(args, 7, &map_kind, map_kind_parse); }

static PyObject *encode_lz4_start(PyObject *self, PyObject *args) {
    return task_start(args, 3, &encode_kind, encode_kind_parse);
}

/* the bytes-like items of a list or tuple, as buffers (released by the caller); NULL items only when allow_none.
   Returns the item count, -1 with an exception set otherwise. */
static Py_ssize_t item_buffers(PyObject *items, Py_buffer **views, int allow_none, const char *name) {
    if (!PyList_Check(items) && !PyTuple_Check(items)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of bytes-like objects, got %s", name,
                     Py_TYPE(items)->tp_name);
        return -1;
    }
    PyObject *seq = PySequence_Fast(items, "");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (!*views) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (item == Py_None && allow_none) continue;
        if (PyObject_GetBuffer(item, &(*views)[i], PyBUF_C_CONTIGUOUS) < 0) {
            for (Py_ssize_t k = 0; k < i; k++)
                if ((*views)[k].obj) PyBuffer_Release(&(*views)[k]);
            PyMem_Free(*views);
            Py_DECREF(seq);
            PyErr_Format(PyExc_TypeError, "%s[%zd] is %s, not a C-contiguous bytes-like object%s", name, i,
                         Py_TYPE(item)->tp_name, allow_none ? " or None" : "");
            return -1;
        }
    }
    Py_DECREF(seq);
    return n;
}

static void release_items(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

/* crc32_all(buffers, value=0): zlib.crc32 of the buffers' bytes one after the other, without joining them */
static PyObject *crc32_all(PyObject *self, PyObject *args) {
    PyObject *items;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "O|I", &items, &value)) return NULL;
    Py_buffer *views;
    Py_ssize_t n = item_buffers(items, &views, 0, "buffers");
    if (n < 0) return NULL;
    uint32_t crc = value;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) crc = her_crc32(crc, views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS
    release_items(views, n);
    return PyLong_FromUnsignedLong(crc);
}

/* shard_body(rows) -> bytearray: a shard's bytes but the index's crc32c (FORMAT.md, Arrays): the rows' bytes in
   order (a None row is never written and takes none), then per row (offset, nbytes) as little-endian uint64, both
   2**64 - 1 for a None row, then 4 zero bytes for the crc32c, which the caller puts there */
static PyObject *shard_body(PyObject *self, PyObject *args) {
    PyObject *items;
    if (!PyArg_ParseTuple(args, "O", &items)) return NULL;
    Py_buffer *views;
    Py_ssize_t n = item_buffers(items, &views, 1, "rows");
    if (n < 0) return NULL;
    Py_ssize_t data = 0;
    for (Py_ssize_t i = 0; i < n; i++) data += views[i].obj ? views[i].len : 0;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, data + 16 * n + 4);
    if (!out) {
        release_items(views, n);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyByteArray_AS_STRING(out), *index = dst + data;
    Py_BEGIN_ALLOW_THREADS
    uint64_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t offset = UINT64_MAX, nbytes = UINT64_MAX;
        if (views[i].obj) {
            memcpy(dst + at, views[i].buf, (size_t)views[i].len);
            offset = at, nbytes = (uint64_t)views[i].len;
            at += nbytes;
        }
        for (int b = 0; b < 8; b++) {
            index[16 * i + b] = (unsigned char)(offset >> (8 * b));
            index[16 * i + 8 + b] = (unsigned char)(nbytes >> (8 * b));
        }
    }
    memset(index + 16 * n, 0, 4);
    Py_END_ALLOW_THREADS
    release_items(views, n);
    return out;
}

/* a C-contiguous buffer of integers of itemsize bytes (signed when is_signed), for crc32_runs; 0 or -1 (raised) */
static int int_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int is_signed, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = view->itemsize == itemsize && f[0] && !f[1] && strchr(is_signed ? "bhilq" : "BHILQ", f[0]) != NULL;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be %s%d integers (got format %s, itemsize %zd)", name,
                     is_signed ? "int" : "uint", (int)(8 * itemsize), view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *crc32_runs(PyObject *self, PyObject *args) {
    Py_buffer data, starts, ends, crcs;
    PyObject *s_obj, *e_obj, *c_obj;
    const char *error = NULL;
    if (!PyArg_ParseTuple(args, "y*OOO", &data, &s_obj, &e_obj, &c_obj)) return NULL;
    if (int_buffer(s_obj, &starts, 8, 1, 0, "starts") < 0) goto no_starts;
    if (int_buffer(e_obj, &ends, 8, 1, 0, "ends") < 0) goto no_ends;
    if (int_buffer(c_obj, &crcs, 4, 0, 1, "crcs") < 0) goto no_crcs;
    Py_ssize_t n = crcs.len / 4;
    /* the runs are copied, then checked and used from the copy: another thread (or crcs sharing memory with
       them) changing a bound after its check cannot send the loop outside data */
    int64_t *run = n ? malloc((size_t)n * 16) : NULL;
    uint32_t *crc = n ? malloc((size_t)n * 4) : NULL;
    if (starts.len != n * 8 || ends.len != n * 8)
        error = "starts, ends and crcs must hold one entry per run";
    else if (n && (!run || !crc)) {
        free(run);
        free(crc);
        PyBuffer_Release(&data);
        PyBuffer_Release(&starts);
        PyBuffer_Release(&ends);
        PyBuffer_Release(&crcs);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; !error && i < n; i++) {
        run[2 * i] = ((const int64_t *)starts.buf)[i], run[2 * i + 1] = ((const int64_t *)ends.buf)[i];
        crc[i] = ((const uint32_t *)crcs.buf)[i];
        if (run[2 * i] < 0 || run[2 * i] > run[2 * i + 1] || run[2 * i + 1] > data.len) error = "a run lies outside data";
    }
    if (!error) {
        const unsigned char *d = data.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) crc[i] = her_crc32(crc[i], d + run[2 * i], (size_t)(run[2 * i + 1] - run[2 * i]));
        Py_END_ALLOW_THREADS
        memcpy(crcs.buf, crc, (size_t)n * 4);
    }
    free(run);
    free(crc);
    PyBuffer_Release(&crcs);
no_crcs:
    PyBuffer_Release(&ends);
no_ends:
    PyBuffer_Release(&starts);
no_starts:
    PyBuffer_Release(&data);
    if (PyErr_Occurred()) return NULL;
    if (error) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define CRC_NOGIL_BYTES (8 << 10) /* smaller buffers keep the GIL: releasing it costs more than their crc */

static PyObject *crc32_buffer(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int value = 0; /* "I" masks to 32 bits, as zlib.crc32 does */
    if (!PyArg_ParseTuple(args, "y*|I", &data, &value)) return NULL;
    uint32_t crc;
    if (data.len > CRC_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = her_crc32(value, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = her_crc32(value, data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *same_bytes(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b)) return NULL;
    int same = a.len == b.len && memcmp(a.buf, b.buf, (size_t)a.len) == 0;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyBool_FromLong(same);
}

/* The priority tree of prioritized replay: see tree_set and tree_find above. */
static int tree_buffers(Py_buffer *sums, Py_ssize_t *leaf0, int *depth) {
    Py_ssize_t n = sums->len / (Py_ssize_t)sizeof(double);
    if (sums->len % (Py_ssize_t)sizeof(double) || n < 2 || (n & (n - 1))) {
        PyErr_SetString(PyExc_ValueError, "a priority tree is float64 of 2 * L nodes, L a power of two");
        return -1;
    }
    *leaf0 = n / 2;
    *depth = 0;
    for (Py_ssize_t k = *leaf0; k > 1; k >>= 1) (*depth)++;
    return 0;
}

static PyObject *tree_set(PyObject *self, PyObject *args) {
    Py_buffer sums, mins, nodes, values;
    if (!PyArg_ParseTuple(args, "w*w*y*y*", &sums, &mins, &nodes, &values)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t leaf0;
    int depth;
    if (tree_buffers(&sums, &leaf0, &depth) < 0) goto done;
    Py_ssize_t n = nodes.len / (Py_ssize_t)sizeof(int64_t);
    if (mins.len != sums.len || nodes.len % (Py_ssize_t)sizeof(int64_t) ||
        values.len != n * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "tree_set needs mins as sums, int64 nodes and one float64 value per node");
        goto done;
    }
    double *s = sums.buf, *m = mins.buf;
    const int64_t *at = nodes.buf;
    const double *v = values.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (at[i] < leaf0 || at[i] >= 2 * leaf0 || !(v[i] >= 0)) {
            PyErr_SetString(PyExc_ValueError, "tree_set needs leaf nodes (L .. 2L - 1) and values >= 0");
            goto done;
        }
    }
    int64_t *up = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (up == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        s[at[i]] = v[i];
        m[at[i]] = v[i] > 0 ? v[i] : INFINITY;
        up[i] = at[i];
    }
    /* level by level, parents from their children: each changed node's parent while the level above is wider than
     * the batch (a parent listed twice gets the same value twice), then whole levels up to the root: half the work
     * of walking each leaf to the root, whose upper levels every walk repeats */
    for (Py_ssize_t width = leaf0 / 2; width >= 1; width /= 2) {
        if (width <= n) {
            for (Py_ssize_t k = width; k < 2 * width; k++) {
                s[k] = s[2 * k] + s[2 * k + 1];
                m[k] = m[2 * k] < m[2 * k + 1] ? m[2 * k] : m[2 * k + 1];
            }
            continue;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t k = up[i] >> 1;
            s[k] = s[2 * k] + s[2 * k + 1];
            m[k] = m[2 * k] < m[2 * k + 1] ? m[2 * k] : m[2 * k + 1];
            up[i] = k;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(up);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sums);
    PyBuffer_Release(&mins);
    PyBuffer_Release(&nodes);
    PyBuffer_Release(&values);
    return result;
}

static PyObject *tree_find(PyObject *self, PyObject *args) {
    Py_buffer sums, u, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &sums, &u, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t leaf0;
    int depth;
    if (tree_buffers(&sums, &leaf0, &depth) < 0) goto done;
    Py_ssize_t n = u.len / (Py_ssize_t)sizeof(double);
    if (u.len % (Py_ssize_t)sizeof(double) || out.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "tree_find needs float64 values and one int64 out per value");
        goto done;
    }
    const double *s = sums.buf, *x = u.buf;
    int64_t *o = out.buf;
    double *r = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(double));
    if (r == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        r[i] = x[i];
        o[i] = 1;
    }
    /* all walks a level at a time: their loads are independent, so the memory system serves many at once (one walk
     * after another waits for each level's load in turn, a cache miss each in a large tree) */
    for (int d = 0; d < depth; d++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t k = o[i];
            double left = s[2 * k];
            if ((r[i] >= left && s[2 * k + 1] > 0) || left <= 0) {
                r[i] -= left;
                o[i] = 2 * k + 1;
            } else {
                o[i] = 2 * k;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(r);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sums);
    PyBuffer_Release(&u);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"crc32", crc32_buffer, METH_VARARGS, "zlib.crc32(data, value), by carry-less multiplication where the CPU has it."},
    {"crc32_runs", crc32_runs, METH_VARARGS, "zlib crc32 of many runs of one buffer, chained from given values."},
    {"encode_lz4", encode_lz4, METH_VARARGS, "Encode rows as LZ4 blocks with size headers (a bytes each), without the GIL."},
    {"crc32_all", crc32_all, METH_VARARGS, "zlib.crc32 of many buffers one after the other, without joining them."},
    {"shard_body", shard_body, METH_VARARGS, "A shard's rows and index in one buffer, 4 bytes left for the crc32c."},
    {"pread_lz4", pread_lz4, METH_VARARGS, "Read and decode LZ4 rows from files, without the GIL."},
    {"map_lz4", map_lz4, METH_VARARGS, "Decode LZ4 rows from mapped files, without the GIL."},
    {"map_lz4_start", map_lz4_start, METH_VARARGS, "map_lz4 started on threads of its own: a Task to wait() for."},
    {"encode_lz4_start", encode_lz4_start, METH_VARARGS, "encode_lz4 started on threads of its own: a Task to wait() for."},
    {"map_file", map_file, METH_VARARGS, "Map bytes of an open file read-only, as a buffer."},
    {"take_rows", take_rows, METH_VARARGS, "Copy rows of a mapped uncompressed chunk, a file cut short failing with EIO."},
    {"decode_lz4", decode_lz4, METH_VARARGS, "Decode LZ4 rows from one buffer, without the GIL."},
    {"same_bytes", same_bytes, METH_VARARGS, "Whether two C-contiguous buffers hold the same bytes (memcmp)."},
    {"tree_set", tree_set, METH_VARARGS, "Set leaves of a priority tree and every sum and minimum above them."},
    {"tree_find", tree_find, METH_VARARGS, "Walk values down a priority tree's sums to their leaf nodes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frames", "Batch LZ4 decoding of image rows.", -1, methods};

PyMODINIT_FUNC PyInit__frames(void) {
    if (PyType_Ready(&MappingType) < 0 || PyType_Ready(&TaskType) < 0) return NULL;
    return PyModule_Create(&module);
}
