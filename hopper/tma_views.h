// Global tensors as the SM90 kernels' TMA copies see them, forward and backward alike:
// (rows, d, heads, batch), batched with rows = seqlen, varlen with rows = all packed rows and a
// batch of 1 (sequences found by row offset), paged K/V with rows = page size and a batch of
// pages.
#pragma once

#include <cute/tensor.hpp>

#include "common/params.h"

namespace flash {

using namespace cute;

// TMA needs every stride to be a multiple of 16 bytes; a mode of extent 1 is never stepped, so
// any such stride serves for it.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t headdim) {
    return extent <= 1 ? headdim : stride;
}

// The (rows, d, heads, entries) tensor a TMA descriptor is built from.
template <class T>
auto tma_gmem(const void* ptr, int rows, int headdim, int heads, int entries,
              TensorStrides const& s) {
    return make_tensor(make_gmem_ptr(static_cast<T const*>(ptr)),
                       make_shape(rows, headdim, heads, entries),
                       make_stride(tma_stride(s.row, rows, headdim), _1{},
                                   tma_stride(s.head, heads, headdim),
                                   tma_stride(s.batch, entries, headdim)));
}

// A tile's view of a TMA tensor: (rows, d) of one head and batch entry, from row `row_offset`
// (a varlen sequence's first row).
template <class Tma>
__device__ auto tma_head_view(Tma const& tma, int rows, int headdim, int heads, int batch,
                              int head, int bidb, index_t row_offset) {
    Tensor m = tma.get_tma_tensor(make_shape(rows, headdim, heads, batch));
    return domain_offset(make_coord(int(row_offset), _0{}), m(_, _, head, batch == 1 ? 0 : bidb));
}

}  // namespace flash
