/* zlib's crc32, computed by carry-less multiplication where the CPU has it: the checksum of FORMAT.md at memory speed.
 *
 * her_crc32(crc, buf, len) returns exactly what zlib's crc32_z(crc, buf, len) returns (CRC-32/ISO-HDLC, reflected
 * polynomial 0xEDB88320, chained from crc). zlib 1.2.13 computes it from tables, ~3 GB/s a core, slower than verify
 * reads. On x86-64 CPUs with PCLMULQDQ (and SSE4.1) the bulk of a buffer is instead folded by carry-less
 * multiplication (~8 GB/s, memory speed), the method of V. Gopal, E. Ozturk et al., "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction" (Intel, 2009), as zlib-ng, Chromium's zlib and Linux's
 * crc32-pclmul do it:
 *
 *   - four 128-bit lanes take the first 64 bytes (the running crc xored into the first 32 bits); each step moves
 *     every lane 512 bits further by multiplying its two 64-bit halves by x^(512+32) and x^(512-32) mod P and
 *     xoring in the next 16 bytes of the lane's stride: the remainder mod P is unchanged, the lane stays 128 bits;
 *   - the four lanes are folded into one (x^(128+32), x^(128-32)), which then takes the remaining 16-byte blocks;
 *   - 128 bits are folded to 64 (x^(128-32), x^64), and Barrett reduction (mu = x^64 div P) gives the 32-bit crc.
 *
 * Every constant is bit-reflected, as the data is, and shifted left by one: a reflected carry-less product comes out
 * one bit low. The last len % 16 bytes, short buffers and other CPUs or compilers go to zlib's crc32_z.
 */
#include "crc32.h"

#include <zlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define FOLD_MIN 64 /* shorter buffers: zlib's tables are as fast */

#define CLMUL __attribute__((target("pclmul,sse4.1")))

/* lane = lo * k[0] ^ hi * k[1] ^ next: one fold step of a 128-bit lane */
CLMUL static inline __m128i fold(__m128i lane, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(lane, k, 0x00), hi = _mm_clmulepi64_si128(lane, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* the crc register (not complemented: ~zlib's value) after len bytes of buf, len a multiple of 16 and >= 64 */
CLMUL static uint32_t crc_clmul(uint32_t crc, const unsigned char *buf, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4); /* x^(512-32), x^(512+32) mod P */
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0); /* x^(128-32), x^(128+32) mod P */
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);              /* x^64 mod P */
    const __m128i poly = _mm_set_epi64x(0x1f7011641, 0x1db710641);  /* mu = x^64 div P, and P */
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    const __m128i *p = (const __m128i *)buf; /* unaligned loads throughout */

    __m128i x1 = _mm_xor_si128(_mm_loadu_si128(p), _mm_cvtsi32_si128((int)crc));
    __m128i x2 = _mm_loadu_si128(p + 1), x3 = _mm_loadu_si128(p + 2), x4 = _mm_loadu_si128(p + 3);
    for (p += 4, len -= 64; len >= 64; p += 4, len -= 64) {
        x1 = fold(x1, k1k2, _mm_loadu_si128(p));
        x2 = fold(x2, k1k2, _mm_loadu_si128(p + 1));
        x3 = fold(x3, k1k2, _mm_loadu_si128(p + 2));
        x4 = fold(x4, k1k2, _mm_loadu_si128(p + 3));
    }
    x1 = fold(fold(fold(x1, k3k4, x2), k3k4, x3), k3k4, x4);
    for (; len >= 16; p++, len -= 16) x1 = fold(x1, k3k4, _mm_loadu_si128(p));

    /* 128 bits to 64: the low half times x^(128-32), then its low 32 bits times x^64 */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k3k4, 0x10));
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00));
    /* Barrett: q = (low 32 bits * mu) mod x^32, crc = the register xor q * P, in the upper 32 bits of the low half */
    __m128i q = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10), low32);
    x1 = _mm_xor_si128(x1, _mm_clmulepi64_si128(q, poly, 0x00));
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

/* 1 where crc_clmul can run, checked once (threads racing on the first call write the same value) */
static int have_clmul(void) {
    static int have = -1;
    if (have < 0) have = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    return have;
}

uint32_t her_crc32(uint32_t crc, const unsigned char *buf, size_t len) {
    if (len >= FOLD_MIN && have_clmul()) {
        size_t n = len & ~(size_t)15;
        crc = ~crc_clmul(~crc, buf, n);
        buf += n, len -= n;
    }
    return (uint32_t)crc32_z(crc, buf, len);
}

#else

uint32_t her_crc32(uint32_t crc, const unsigned char *buf, size_t len) { return (uint32_t)crc32_z(crc, buf, len); }

#endif
