/* A cache in front of CPython's arena allocator, for the interpreter's frame stack.
 *
 * CPython 3.11+ keeps Python frames in 16 KiB stack chunks taken from the arena allocator (mmap).
 * A chunk is returned (munmap) as soon as the frame that opened it returns. A loop whose calls
 * go back and forth across a chunk's edge therefore maps and unmaps memory on every call, and each
 * unmap also stops the other cores to flush their TLBs. A decode step of the compiled model makes
 * such a call once or more per layer when the engine happens to run at an unlucky stack depth.
 *
 * This keeps up to CACHED_BLOCKS small blocks (frame chunks; pymalloc's arenas are larger and
 * pass through) and hands them back on the next request of the same size. Every call comes with
 * the GIL held, which serialises access to the cache.
 */
#include <Python.h>

#define CACHED_BLOCKS 16
#define LARGEST_CACHED (64 * 1024)

static PyObjectArenaAllocator underlying;
static void *blocks[CACHED_BLOCKS];
static size_t block_sizes[CACHED_BLOCKS];
static int cached;
static long long reused;  /* requests served from the cache */
static long long passed;  /* small requests that went to the underlying allocator */
static int installed;
static int enabled = 1;  /* off: every request passes through (for measurements and tests) */

static void *cached_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size <= LARGEST_CACHED) {
        for (int i = cached - 1; i >= 0; i--) {
            if (block_sizes[i] == size) {
                void *block = blocks[i];
                cached--;
                blocks[i] = blocks[cached];
                block_sizes[i] = block_sizes[cached];
                reused++;
                return block;
            }
        }
        passed++;
    }
    return underlying.alloc(underlying.ctx, size);
}

static void cached_free(void *ctx, void *block, size_t size) {
    (void)ctx;
    if (enabled && size <= LARGEST_CACHED && cached < CACHED_BLOCKS) {
        blocks[cached] = block;
        block_sizes[cached] = size;
        cached++;
        return;
    }
    underlying.free(underlying.ctx, block, size);
}

/* Put the cache in front of the current arena allocator; once per process (later calls do nothing). */
void frame_arena_install(void) {
    if (installed) return;
    PyObjectArenaAllocator mine = {NULL, cached_alloc, cached_free};
    PyObject_GetArenaAllocator(&underlying);
    PyObject_SetArenaAllocator(&mine);
    installed = 1;
}

int frame_arena_installed(void) { return installed; }

/* Off: the cached blocks go back now and every later request passes through; on again: cached again. */
void frame_arena_enable(int on) {
    enabled = on;
    while (!enabled && cached > 0) {
        cached--;
        underlying.free(underlying.ctx, blocks[cached], block_sizes[cached]);
    }
}

long long frame_arena_reused(void) { return reused; }
long long frame_arena_passed(void) { return passed; }
