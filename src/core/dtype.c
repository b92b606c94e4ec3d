/* dtype sizes and names, and the bf16 / f16 <-> f32 conversions (round to nearest even). */
#include "anneal/core.h"

#include <string.h>

static const size_t k_sizes[ANNEAL_DTYPE_COUNT] = {4, 2, 2, 4, 8, 2, 1, 1, 8};
static const char *const k_names[ANNEAL_DTYPE_COUNT] = {"f32", "bf16", "f16", "i32",
                                                         "i64", "u16",  "u8",  "i8", "f64"};

size_t anneal_dtype_size(anneal_dtype dt) {
    return (unsigned)dt < ANNEAL_DTYPE_COUNT ? k_sizes[dt] : 0;
}

const char *anneal_dtype_name(anneal_dtype dt) {
    return (unsigned)dt < ANNEAL_DTYPE_COUNT ? k_names[dt] : "?";
}

bool anneal_dtype_is_float(anneal_dtype dt) {
    return dt == ANNEAL_F32 || dt == ANNEAL_BF16 || dt == ANNEAL_F16;
}

bool anneal_dtype_parse(const char *name, anneal_dtype *out) {
    static const struct {
        const char *name;
        anneal_dtype dt;
    } names[] = {
        {"f32", ANNEAL_F32},   {"fp32", ANNEAL_F32},    {"float32", ANNEAL_F32}, {"float", ANNEAL_F32},
        {"bf16", ANNEAL_BF16}, {"bfloat16", ANNEAL_BF16},
        {"f16", ANNEAL_F16},   {"fp16", ANNEAL_F16},    {"float16", ANNEAL_F16}, {"half", ANNEAL_F16},
        {"f64", ANNEAL_F64},   {"fp64", ANNEAL_F64},    {"float64", ANNEAL_F64}, {"double", ANNEAL_F64},
        {"i32", ANNEAL_I32},   {"int32", ANNEAL_I32},   {"i64", ANNEAL_I64},     {"int64", ANNEAL_I64},
        {"u16", ANNEAL_U16},   {"uint16", ANNEAL_U16},  {"u8", ANNEAL_U8},       {"uint8", ANNEAL_U8},
        {"i8", ANNEAL_I8},     {"int8", ANNEAL_I8},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *out = names[i].dt;
            return true;
        }
    return false;
}

const char *anneal_precision_name(anneal_dtype dt) {
    switch (dt) {
    case ANNEAL_F32: return "fp32";
    case ANNEAL_BF16: return "bf16";
    case ANNEAL_F16: return "fp16";
    case ANNEAL_F64: return "fp64";
    default: return anneal_dtype_name(dt);
    }
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float anneal_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t anneal_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float anneal_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* subnormal: value = man * 2^-24 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t anneal_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;            /* NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u;           /* overflow (incl. rounding) -> inf */
    if (a < 0x38800000u) {                                 /* result subnormal or zero */
        /* Round a * 2^24 to nearest even integer: the subnormal mantissa. */
        float v = bits_f32(a) * 16777216.0f;
        uint32_t m = (uint32_t)v;
        float rem = v - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return sign | (uint16_t)m;
    }
    /* normal: rebias exponent, round mantissa to 10 bits (nearest even) */
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)((r - (112u << 23)) >> 13);
}

