"""Host emulation of the CUDA attention kernels (kernels/attention.cu).

The row/chunk kernels of the other .cu files are emulated by calling their
item functions (test_cuda_host_emulation.py).  The attention kernels are
thread-block kernels: shared memory, __syncthreads and warp shuffles.  Here
attention.cu itself is compiled by the host C++ compiler after a shim that
runs a launch the way a GPU would, one block at a time: each of the block's
threads is a cooperative fiber (ucontext) with its own threadIdx and
registers; __syncthreads is a barrier of the block's fibers and
__shfl_xor_sync a barrier-fenced exchange among the 32 fibers of a warp;
__shared__ arrays are shared by the fibers of the block.  A barrier that
not every thread of its group reaches (divergence) is reported as a
deadlock, not a hang.  Fibers are resumed in reverse order, so results that
depend on thread order show up; a launch's blocks may be run last to first
(``reverse_blocks``), so results that depend on block order show up too.

The device instructions of kernels/kv_attn.cuh are emulated as the PTX ISA
states them: ``mma.sync.m16n8k16`` and ``ldmatrix`` (x4, plain and .trans)
from their fragment layouts, every lane's registers exchanged through the
warp; ``cp.async`` with ``commit_group`` / ``wait_group``: a copy lands at
the wait that covers its group, its destination poisoned until then (a read
before the wait, or a refill of a buffer still being read, gives wrong
results); dynamic shared memory filled with garbage for every block; the
last-block atomics as plain operations (one block runs at a time).

Not covered: the device's own math library (exp2f, tanhf: the host libm's
are used), memory coalescing and speed.
"""
import ctypes
import shutil
import subprocess

from kvcore.backends.cuda import attention_kernels

CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def kernel_signature(lib, symbol):
    """The parameter codes a harness function ``symbol`` of ``lib`` writes
    (``int symbol(int *out)``, returning their count): 0 an integer, -1 a
    float, -2 a void pointer, else a pointer to elements of that many bytes."""
    f = getattr(lib, symbol)
    f.restype = ctypes.c_int
    buf = (ctypes.c_int * 64)()
    return tuple(buf[:f(buf)])

SHIM = r'''
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct kvemu_dim3 { unsigned x, y, z; };
static kvemu_dim3 threadIdx, blockIdx, blockDim, gridDim;

static inline unsigned __umulhi(unsigned a, unsigned b)
{
    return (unsigned)(((unsigned long long)a * b) >> 32);
}

/* cp.async (kva_copy16, kva_zero16): the 16 source bytes (or zeros) are
 * taken at issue and land in shared memory at the cp.async.wait_group that
 * covers their group (kvemu_cp_wait), as the PTX ISA allows; until then the
 * destination holds 0xFF bytes (a NaN in every float kind), so a kernel
 * that reads a copy before waiting for it, or refills a buffer another
 * thread still reads, gets wrong results here.  Copies whose source or
 * destination is off 16 bytes are counted (a fault on the GPU), and
 * copies never waited for by the end of the block. */
static long long kvemu_misaligned16 = 0, kvemu_copies16 = 0, kvemu_unwaited = 0;
struct KvemuCopy {
    unsigned char *dst;
    unsigned char data[16];
    long long group;
};
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

static inline float kvemu_half_to_float(unsigned short h)
{
    unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    return __uint_as_float(bits);
}

namespace kvemu {
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    unsigned tid, block;
    bool done;
    std::vector<KvemuCopy> copies; /* cp.async in flight */
    long long committed;           /* cp.async.commit_group count */
};
static std::vector<Fiber> fibers;
static ucontext_t sched;
static int cur;
static unsigned grid_n;
static void (*body)(void *);
static void *body_arg;
static std::vector<int> bar_count;
static std::vector<unsigned> bar_gen;
static bool progress;
static unsigned shfl_buf[1024];
static std::vector<unsigned char> dyn_smem; /* the launch's dynamic shared memory */
static unsigned char *dyn_base;

static void yield() { swapcontext(&fibers[cur].ctx, &sched); }

/* Barrier of `size` fibers, group 0 = the block, 1 + w = warp w. */
static void wait(int group, int size)
{
    unsigned gen = bar_gen[group];
    progress = true;
    if (++bar_count[group] == size) {
        bar_count[group] = 0;
        ++bar_gen[group];
        return;
    }
    while (bar_gen[group] == gen)
        yield();
}

/* Complete this thread's copies of groups < `upto` (all: -1). */
static void land(Fiber &f, long long upto)
{
    std::vector<KvemuCopy> left;
    for (auto &c : f.copies) {
        if (upto < 0 || c.group < upto)
            memcpy(c.dst, c.data, 16);
        else
            left.push_back(c);
    }
    f.copies.swap(left);
}

static bool reverse_blocks; /* run a grid's blocks last to first */

static void entry()
{
    Fiber &f = fibers[cur];
    for (unsigned i = 0; i < grid_n; ++i) {
        const unsigned b = reverse_blocks ? grid_n - 1 - i : i;
        f.block = b;
        blockIdx.x = b;
        if (f.tid == 0 && dyn_base) /* a new block finds garbage, not the last one's data */
            memset(dyn_base, 0xA7, dyn_smem.size() - 16);
        wait(0, (int)fibers.size());
        body(body_arg);
        kvemu_unwaited += (long long)f.copies.size();
        land(f, -1);
        f.committed = 0;
        wait(0, (int)fibers.size()); /* the next block reuses __shared__ */
    }
    f.done = true;
}

/* 0, or -1 when a barrier can never complete (divergent threads). */
static int run(unsigned grid, unsigned block, unsigned smem)
{
    dyn_smem.assign(smem ? smem + 16 : 0, 0);
    dyn_base = smem ? dyn_smem.data() + ((16 - (uintptr_t)dyn_smem.data() % 16) % 16) : nullptr;
    fibers.clear();
    fibers.resize(block);
    bar_count.assign(1 + (block + 31) / 32, 0);
    bar_gen.assign(1 + (block + 31) / 32, 0);
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    grid_n = grid;
    for (unsigned t = 0; t < block; ++t) {
        Fiber &f = fibers[t];
        f.tid = t;
        f.block = 0;
        f.done = false;
        f.copies.clear();
        f.committed = 0;
        f.stack.resize(1 << 17);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &sched;
        makecontext(&f.ctx, entry, 0);
    }
    unsigned alive = block;
    while (alive) {
        progress = false;
        for (int i = (int)block - 1; i >= 0; --i) {
            Fiber &f = fibers[i];
            if (f.done)
                continue;
            cur = i;
            threadIdx = {f.tid, 0, 0};
            blockIdx = {f.block, 0, 0};
            swapcontext(&sched, &f.ctx);
            if (f.done) {
                --alive;
                progress = true;
            }
        }
        if (!progress)
            return -1;
    }
    return 0;
}
} // namespace kvemu

static inline void __syncthreads() { kvemu::wait(0, (int)blockDim.x); }

static inline void __syncwarp(unsigned = 0xffffffffu)
{
    kvemu::wait(1 + (int)(threadIdx.x / 32), 32);
}

/* A warp exchange of a 4-byte value: lane t reads what lane `from(t)` posted. */
template <typename T, typename F> static inline T kvemu_exchange(T x, F from)
{
    static_assert(sizeof(T) == 4, "4-byte values");
    unsigned t = threadIdx.x, w = t / 32;
    memcpy(&kvemu::shfl_buf[t], &x, 4);
    kvemu::wait(1 + (int)w, 32);
    T y;
    memcpy(&y, &kvemu::shfl_buf[(t & ~31u) | (from(t & 31u) & 31u)], 4);
    kvemu::wait(1 + (int)w, 32);
    return y;
}

static inline float __shfl_xor_sync(unsigned, float x, int o)
{
    return kvemu_exchange(x, [o](unsigned lane) { return lane ^ (unsigned)o; });
}

template <typename T> static inline T __shfl_sync(unsigned, T x, int src)
{
    return kvemu_exchange(x, [src](unsigned) { return (unsigned)src; });
}

/* One block runs at a time: the atomics and fences of the last-block merge
 * are plain reads and writes here. */
static inline int atomicAdd(int *p, int v)
{
    int old = *p;
    *p = old + v;
    return old;
}
static inline void __threadfence() {}

static inline void *kvemu_dyn_smem() { return kvemu::dyn_base; }

__attribute__((noinline)) static void kvemu_cp_async16(void *dst, const void *src, int bytes)
{
    kvemu::Fiber &f = kvemu::fibers[kvemu::cur];
    if (((uintptr_t)dst | (bytes ? (uintptr_t)src : 0)) % 16)
        ++kvemu_misaligned16;
    KvemuCopy c;
    c.dst = (unsigned char *)dst;
    c.group = f.committed;
    if (bytes) {
        ++kvemu_copies16;
        memcpy(c.data, src, 16);
    } else {
        memset(c.data, 0, 16);
    }
    memset(dst, 0xFF, 16);
    f.copies.push_back(c);
}

static inline void kvemu_cp_commit() { ++kvemu::fibers[kvemu::cur].committed; }

/* cp.async.wait_group n: every committed group but the newest n has landed. */
static inline void kvemu_cp_wait(int n)
{
    kvemu::Fiber &f = kvemu::fibers[kvemu::cur];
    kvemu::land(f, f.committed - n);
}

/* ldmatrix.sync.aligned.m8n8.xN[.trans].shared.b16: lanes 8i .. 8i+7 post
 * the row addresses of matrix i (16 bytes each, 16-byte aligned); register
 * i of lane (g = lane / 4, c = lane % 4) gets elements (g, 2c), (g, 2c+1) of
 * matrix i, or with .trans (2c, g), (2c+1, g), the first in the low half. */
static const unsigned char *kvemu_ldm_row[1024];

static inline void kvemu_ldmatrix(unsigned *r, int n, bool trans, const void *row)
{
    unsigned t = threadIdx.x, w = t / 32, base = t & ~31u, lane = t & 31u;
    if ((uintptr_t)row % 16)
        ++kvemu_misaligned16;
    kvemu_ldm_row[t] = (const unsigned char *)row;
    kvemu::wait(1 + (int)w, 32);
    unsigned g = lane / 4, c = lane % 4;
    for (int i = 0; i < n; i++) {
        unsigned short e[2];
        for (unsigned k = 0; k < 2; k++) {
            unsigned rr = trans ? 2 * c + k : g, cc = trans ? g : 2 * c + k;
            memcpy(&e[k], kvemu_ldm_row[base + 8 * i + rr] + 2 * cc, 2);
        }
        r[i] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
    kvemu::wait(1 + (int)w, 32);
}

/* mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: d += A B for the warp,
 * from the PTX ISA's fragment layouts (kv_attn.cuh, kva_mma16816, lists
 * them).  Each lane posts its A (4 x 32 bits) and B (2 x 32 bits)
 * registers, then computes its 4 elements of D: the 16 products are exact
 * (double), summed exactly with c and rounded once toward zero to float
 * (the tensor cores truncate; their order and internal width are
 * unspecified): a pessimistic model, so the error the tests measure bounds
 * the hardware's. */
static unsigned kvemu_mma_a[1024][4], kvemu_mma_b[1024][2];

static inline double kvemu_mma_in(unsigned reg, unsigned k, bool bf16)
{
    unsigned short h = (unsigned short)(reg >> (16 * (k % 2)));
    return bf16 ? (double)__uint_as_float((unsigned)h << 16) : (double)kvemu_half_to_float(h);
}

static inline void kvemu_mma16816(bool bf16, float *d, const unsigned *a, const unsigned *b)
{
    unsigned t = threadIdx.x, w = t / 32, base = t & ~31u, lane = t & 31u;
    for (int i = 0; i < 4; i++)
        kvemu_mma_a[t][i] = a[i];
    kvemu_mma_b[t][0] = b[0];
    kvemu_mma_b[t][1] = b[1];
    kvemu::wait(1 + (int)w, 32);
    float r[4];
    for (unsigned i = 0; i < 4; i++) {
        unsigned row = lane / 4 + (i >= 2 ? 8 : 0), col = (lane % 4) * 2 + (i & 1);
        double sum = 0.0;
        for (unsigned k = 0; k < 16; k++) {
            /* A (row, k): lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8) */
            unsigned ra =
                kvemu_mma_a[base + 4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
            /* B (k, col): lane 4 col + (k % 8) / 2, register k >= 8 */
            unsigned rb = kvemu_mma_b[base + 4 * col + (k % 8) / 2][k >= 8];
            sum += kvemu_mma_in(ra, k, bf16) * kvemu_mma_in(rb, k, bf16);
        }
        double s = (double)d[i] + sum;
        float f = (float)s;
        if (fabs((double)f) > fabs(s)) /* rounded away from zero: one step back */
            f = nextafterf(f, 0.0f);
        r[i] = f;
    }
    kvemu::wait(1 + (int)w, 32);
    for (int i = 0; i < 4; i++)
        d[i] = r[i];
}
'''

HARNESS = r'''
template <typename... A, std::size_t... I>
static int kvemu_launch(void (*k)(A...), unsigned grid, unsigned block, unsigned smem, void **p,
                        std::index_sequence<I...>)
{
    struct Call {
        void (*k)(A...);
        std::tuple<A...> args;
    };
    Call c{k, std::tuple<A...>(*static_cast<A *>(p[I])...)};
    kvemu::body = [](void *v) {
        Call *call = static_cast<Call *>(v);
        std::apply(call->k, call->args);
    };
    kvemu::body_arg = &c;
    return kvemu::run(grid, block, smem);
}

/* The parameter list: 0 an integer, -1 a float, the pointee size for a
 * pointer (-2: void, q / out of a run-time kind). */
template <typename T> static int kvemu_code()
{
    if constexpr (std::is_pointer<T>::value && std::is_void<std::remove_cv_t<
                      std::remove_pointer_t<T>>>::value)
        return -2;
    else if constexpr (std::is_pointer<T>::value)
        return (int)sizeof(typename std::remove_pointer<T>::type);
    else if constexpr (std::is_floating_point<T>::value)
        return -1;
    else
        return 0;
}

extern "C" long long kvemu_take_misaligned16(void)
{
    long long n = kvemu_misaligned16;
    kvemu_misaligned16 = 0;
    return n;
}

extern "C" void kvemu_set_reverse_blocks(int on) { kvemu::reverse_blocks = on != 0; }

extern "C" long long kvemu_take_unwaited(void)
{
    long long n = kvemu_unwaited;
    kvemu_unwaited = 0;
    return n;
}

extern "C" long long kvemu_take_copies16(void)
{
    long long n = kvemu_copies16;
    kvemu_copies16 = 0;
    return n;
}

template <typename... A> static int kvemu_sig(void (*)(A...), int *out)
{
    int codes[] = {kvemu_code<A>()..., 0};
    for (std::size_t i = 0; i < sizeof...(A); ++i)
        out[i] = codes[i];
    return (int)sizeof...(A);
}
'''


class AttentionEmulation:
    """attention.cu compiled for the host; ``launch(name, grid, block, args)``."""

    def __init__(self, tmpdir):
        if CXX is None:
            raise RuntimeError("the attention emulation needs a C++17 compiler")
        self.names = attention_kernels.attention_names()
        parts = [SHIM, "#define KVCORE_HOST_EMULATION 1\n", attention_kernels.source(), HARNESS]
        for k, name in enumerate(self.names):
            parts.append(
                f'extern "C" int kvattn_{k}(unsigned grid, unsigned block, unsigned smem, '
                f'void **p) {{\n'
                f"    return kvemu_launch(&{name}, grid, block, smem, p,\n"
                f"        std::make_index_sequence<kvemu_nargs(&{name})>{{}});\n}}\n"
                f'extern "C" int kvattn_{k}_sig(int *out) {{ return kvemu_sig(&{name}, out); }}\n')
        parts.insert(3, "template <typename... A> constexpr std::size_t kvemu_nargs(void (*)(A...))"
                        " { return sizeof...(A); }\n")
        src = tmpdir / "kvcore_attention_emulation.cpp"
        src.write_text("\n".join(parts), encoding="utf-8")
        lib = tmpdir / "kvcore_attention_emulation.so"
        cmd = [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function",
               "-Wno-unknown-pragmas",
               "-shared", "-fPIC", str(src), "-o", str(lib)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
        self._lib = ctypes.CDLL(str(lib))
        for f in (self._lib.kvemu_take_misaligned16, self._lib.kvemu_take_copies16,
                  self._lib.kvemu_take_unwaited):
            f.restype = ctypes.c_longlong
        self._sigs, self._fns = {}, {}

    def signature(self, name):
        sig = self._sigs.get(name)
        if sig is None:
            sig = self._sigs[name] = kernel_signature(self._lib,
                                                      f"kvattn_{self.names.index(name)}_sig")
        return sig

    def launch(self, name, grid, block, params, smem=0):
        """Run ``name`` over ``grid`` blocks of ``block`` threads with
        ``smem`` bytes of dynamic shared memory; ``params`` a ctypes array
        of pointers to the arguments.  False on a deadlock; raises on a
        16-byte copy or ldmatrix row off its alignment (a fault on the GPU)
        and on copies a block never waited for."""
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self._lib, f"kvattn_{self.names.index(name)}")
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                           ctypes.POINTER(ctypes.c_void_p)]
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        ok = fn(grid, block, smem, params) == 0
        bad = self._lib.kvemu_take_misaligned16()
        if bad:
            raise AssertionError(f"{name}: {bad} 16-byte copies or ldmatrix rows were not "
                                 "16-byte aligned")
        unwaited = self._lib.kvemu_take_unwaited()
        if unwaited:
            raise AssertionError(f"{name}: {unwaited} cp.async copies were never waited for")
        return ok

    def reverse_blocks(self, on):
        """Run every later launch's blocks last to first (True) or first to
        last: a result that depends on the order the blocks ran in shows."""
        self._lib.kvemu_set_reverse_blocks(int(bool(on)))

    def take_copies16(self):
        """The 16-byte copies (kva_copy16) since the last call."""
        return int(self._lib.kvemu_take_copies16())
