/* ds4_quant.h -- GGUF super-block quantisations: Q2_K, Q4_K, IQ2_XXS (and Q8_0).
 *
 * Dequantisation (the specification, bit-exact with ggml's to_float) and a
 * deterministic generator of valid random blocks for synthetic models.  See
 * the comment at the top of ds4_quant.c for the block layouts in words.
 *
 * Type numbers and block sizes come from ds4_gpu.h (the backend contract
 * enumerates every tensor type ds4 reads).
 */
#ifndef DS4_QUANT_H
#define DS4_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "ds4_gpu.h"   /* DS4_TYPE_Q2_K/Q4_K/IQ2_XXS, DS4_QK_K, the block sizes */

#ifdef __cplusplus
extern "C" {
#endif

/* Q8_0 (ggml type 8, 32-element blocks of 34 bytes) is also accepted by the
 * functions below: it is the control type of the ggml oracle.  The name is
 * private so it cannot collide with ds4_gpu.h's DS4_TYPE_Q8_0. */
#define DS4_QUANT_Q8_0             8
#define DS4_QUANT_Q8_0_BLOCK       32
#define DS4_QUANT_Q8_0_BLOCK_BYTES 34

/* 1 for the 256-element super-block types of this module (Q2_K, Q4_K,
 * IQ2_XXS -- IQ2_XXS is an "i-quant" but shares the K super-block), else 0. */
int ds4_quant_is_kquant(int type);

/* Elements per block (256, or 32 for Q8_0) and bytes per block; 0 for an
 * unknown type. */
int64_t ds4_quant_block_elems(int type);
size_t  ds4_quant_block_bytes(int type);

/* Bytes of a row of n elements; 0 when the type is unknown, n <= 0, or n is
 * not a multiple of the type's block (256 for the super-block types). */
size_t ds4_quant_row_bytes(int type, int64_t n);

/* "Q2_K", "Q4_K", "IQ2_XXS", "Q8_0", or NULL. */
const char *ds4_quant_type_name(int type);

/* Dequantise n elements (a multiple of the block) of blocks at src into dst.
 * Equal bit for bit to ggml's to_float for the same type (same float
 * operations in the same order; exact f16 decode).  Unknown type or bad n:
 * nothing is written.  Every product involved is exact in float, so the only
 * rounding is the final subtraction of Q2_K/Q4_K: FMA contraction and
 * reassociation of the products cannot change a bit (see ds4_quant.c). */
void ds4_quant_dequant(int type, const void *src, float *dst, int64_t n);

/* Write one random VALID block of `type` (ds4_quant_block_bytes(type) bytes)
 * to out, drawn from the splitmix64 stream *state (advanced).  Deterministic
 * across platforms.  Valid means: every f16 scale is a finite, positive,
 * normal number, sized so dequantised values are O(0.01..0.1); Q2_K and Q4_K
 * take dmin = d and each sub-block's min = round(scale * the mean quant), so
 * values centre on zero; every other field is uniformly random over its full
 * range, which for these types is always in range (see ds4_quant.c). */
void ds4_quant_random_block(int type, uint64_t *state, uint8_t *out);

/* IEEE binary16 -> binary32, exact for every finite value; NaNs keep their
 * payload and come out quiet (as a hardware conversion and ggml give). */
float ds4_quant_f16(uint16_t h);

#ifdef __cplusplus
}
#endif

#endif /* DS4_QUANT_H */
