/* Where a ggml_tensor keeps its data pointer, sources, sizes and strides, for the custom graph nodes of
   fomoepy's C modules (_batched_experts, _dense_rows, _ggml_rounds, _row_attention): `o` is a node's
   userdata, whose data_offset, src_offset, ne_offset (and nb_offset, where used) are those fields' offsets
   in the Python bindings' ggml_tensor struct (tests/test_ggml_abi.py holds them to the library's), so no
   ggml header is needed. Macros, so that each module's userdata struct serves as it is laid out. */
#ifndef FOMOE_GGML_FIELDS_H
#define FOMOE_GGML_FIELDS_H

#include <stddef.h>
#include <stdint.h>

#define data_of(o, t) (*(void *const *)((const char *)(t) + (o)->data_offset))
#define src_of(o, t, i) (((const void *const *)((const char *)(t) + (o)->src_offset))[i])
#define ne_of(o, t, i) (((const int64_t *)((const char *)(t) + (o)->ne_offset))[i])
#define nb_of(o, t, i) (((const size_t *)((const char *)(t) + (o)->nb_offset))[i])

#endif
