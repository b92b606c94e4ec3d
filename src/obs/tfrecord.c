/* CRC-32C and TFRecord framing (see anneal/telemetry.h): the container TensorBoard
 * event files use. */
#include "anneal/telemetry.h"

/* Table of the reflected Castagnoli polynomial 0x82F63B78, built on first use. */
static uint32_t crc_table[256];
static int crc_ready;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
    __atomic_store_n(&crc_ready, 1, __ATOMIC_RELEASE);
}

/* Continues the CRC-32C crc over n bytes (crc 0 starts a new one). */
uint32_t anneal_crc32c(uint32_t crc, const void *data, size_t n) {
    if (!__atomic_load_n(&crc_ready, __ATOMIC_ACQUIRE)) crc_init(); /* idempotent: same table */
    const unsigned char *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* TFRecord's masked CRC of n bytes. */
uint32_t anneal_crc32c_masked(const void *data, size_t n) {
    uint32_t c = anneal_crc32c(0, data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* Header of a TFRecord of n bytes: the length and its masked CRC, little endian. */
void anneal_tfrecord_header(uint64_t n, unsigned char out[12]) {
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(n >> (8 * i));
    uint32_t c = anneal_crc32c_masked(out, 8);
    for (int i = 0; i < 4; i++) out[8 + i] = (unsigned char)(c >> (8 * i));
}
