/* zlib's crc32 at memory speed where the CPU can: see crc32.c. */
#ifndef HER_STORE_CRC32_H
#define HER_STORE_CRC32_H

#include <stddef.h>
#include <stdint.h>

/* exactly crc32_z(crc, buf, len) of zlib: the CRC-32 of buf continued from crc (0 to start) */
uint32_t her_crc32(uint32_t crc, const unsigned char *buf, size_t len);

#endif
