#!/usr/bin/env python3
"""Stamps clock64() at 15 points of FlashAttention-3's SM90 backward step, the same kind of
timeline as bwd_step_timeline.patch gives of ours, to compare phase lengths (measurement of the
peer only; nothing of it goes into our code). The leader thread of each MMA warp group in the
CTAs of key block 10, batch 0, heads 0 and 1 records steps 5 to 12 of its query loop into a
device array (plain stores: a printf in the kernel would make ptxas serialize its WGMMAs,
warning C7510), and a one-thread kernel launched after the backward prints "TL head group step
t0 ... t14". Check FA3's build log: this must add no C7510 to the backward kernels.

Usage, on the GPU machine: extract ../shared/peers/fa3-src.tar.xz into DEST, run this script on
DEST/fa3/hopper, then `bash .peers/build_fa3.sh DEST` (it builds the extracted tree; export
FLASH_ATTENTION_DISABLE_HDIM64=TRUE FLASH_ATTENTION_DISABLE_HDIM256=TRUE first for a d=128
build), then `python benchmarks/ncu_bwd_pair.py --which fa3 --fa3 LIB --hdim 128` (and
--causal). Points: 0 step start, 1 Q ready, 2 S issued, 3 dO ready, 4 dP issued, 5 S done,
6 P done, 7 dP done, 8 dS done, 9 dV issued, 10 dS barrier passed, 11 dQ issued (dV done),
12 dK issued (dQ done), 13 dQ handed to the dQ warp, 14 all GEMMs done.
"""

from __future__ import annotations

import sys
from pathlib import Path

# (anchor, text inserted, before or after the anchor); each anchor must occur exactly once
# from where the previous one was found on (they follow the step's order in the source).
STAMPS = [
    ("auto bwd_step = [&](int m_block, auto mask_fn) {",
     "\n            fa3tl_step = m_block - fa3tl_first - 4; FA3TL(0);", "after"),
    ("consumer_wait(pipeline_q, smem_pipe_read);", " FA3TL(1);", "after"),
    ("tSrQ(_, _, _, smem_pipe_read.index()), tSrK, tSrS);", " FA3TL(2);", "after"),
    ("consumer_wait(pipeline_do, smem_pipe_read_do_cur);", " FA3TL(3);", "after"),
    ("tdPrV, tdPrdP);", " FA3TL(4);", "after"),
    ("warpgroup_wait<1>();", " FA3TL(5);", "after"),
    ("warpgroup_wait<0>();", "FA3TL(6); ", "before"),
    ("warpgroup_wait<0>();", " FA3TL(7);", "after"),
    ("Tensor tdSadS = smem_thr_copy_PdS.retile_S(rdS);", "FA3TL(8); ", "before"),
    ("tdVrdO(_, _, _, smem_pipe_read_do_cur.index()), tdVrdV);", " FA3TL(9);", "after"),
    ("Tensor tdQrdQ = partition_fragment_C(", "FA3TL(10); ", "before"),
    ("tdQrdS_cur, tdQrK, tdQrdQ);", " FA3TL(11);", "after"),
    ("tdKrQ(_, _, _, smem_pipe_read.index()), tdKrdK);", " FA3TL(12);", "after"),
    ("static_cast<uint32_t>(BwdNamedBarriers::dQFullWG1) + warp_group_idx /*id*/);  // sdQ full, "
     "to be written to gmem\n                } else {", "", "after"),
    ("warpgroup_wait<0>();\n            pipeline_q.consumer_release(smem_pipe_read);",
     "FA3TL(14); ", "after_first_line"),
]

SETUP_ANCHOR = "int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);"
SETUP = """
        const int fa3tl_head = get<1>(block_coord);
        const bool fa3tl_lead = n_block == 10 && fa3tl_head < 2 && bidb == 0 &&
                                thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
        const int fa3tl_group = thread_idx / cutlass::NumThreadsPerWarpGroup;
        int fa3tl_step = -1;
        const int fa3tl_first = m_block_min;
#define FA3TL(i) do { if (fa3tl_lead && fa3tl_step >= 0 && fa3tl_step < 8) fa3tl_stamps[fa3tl_head][fa3tl_group][fa3tl_step][i] = clock64(); } while (0)
"""
PRINT_ANCHOR = "        if constexpr (Q_dO_same_stages) { smem_pipe_read_do = smem_pipe_read; }\n        ++work_idx;"
PRINT = "#undef FA3TL\n"
# The stamps' array and the kernel that prints them, before the mainloop's namespace; the
# launch after the backward's main kernel.
ARRAY_ANCHOR = "namespace flash {\n\nusing namespace cute;"
ARRAY = """static __device__ long long fa3tl_stamps[2][2][8][15];
static __global__ void fa3tl_print_kernel() {
    for (int h = 0; h < 2; ++h) for (int g = 0; g < 2; ++g) for (int t = 0; t < 8; ++t) {
        const long long* s = fa3tl_stamps[h][g][t];
        if (s[0] == 0 || s[14] == 0) continue;
        printf("TL %d %d %d %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\\n",
               h, g, t, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11],
               s[12], s[13], s[14]);
    }
}

"""
LAUNCH_ANCHOR = ("CHECK_CUTLASS(cutlass::kernel_launch<AttnKernel>(grid_dims, block_dims, smem_size, "
                 "stream, kernel_params, false /*launch_with_pdl*/));")
LAUNCH = "\n        fa3tl_print_kernel<<<1, 1, 0, stream>>>();"
DQ_HANDOFF = ("cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarpGroup + "
              "cutlass::NumThreadsPerWarp, static_cast<uint32_t>(BwdNamedBarriers::dQFullWG1) + "
              "warp_group_idx /*id*/);  // sdQ full, to be written to gmem")


def instrument(src: str) -> str:
    """The mainloop source with the stamps; raises if an anchor is missing or ambiguous."""
    def once(text: str, anchor: str) -> int:
        if text.count(anchor) != 1:
            raise SystemExit(f"anchor found {text.count(anchor)} times: {anchor[:70]!r}")
        return text.index(anchor)

    i = once(src, SETUP_ANCHOR) + len(SETUP_ANCHOR)
    src = src[:i] + SETUP + src[i:]
    start = src.index("auto bwd_step = [&](int m_block, auto mask_fn) {")
    head, body = src[:start], src[start:]
    pos = 0
    for anchor, text, where in STAMPS:
        if anchor.startswith("static_cast<uint32_t>(BwdNamedBarriers::dQFullWG1)"):
            j = body.index(DQ_HANDOFF, pos) + len(DQ_HANDOFF)
            body = body[:j] + " FA3TL(13);" + body[j:]
            pos = j
            continue
        j = body.index(anchor, pos)
        if where == "before":  # the next search starts at this anchor again
            body = body[:j] + text + body[j:]
            pos = j + len(text)
        elif where == "after_first_line":
            k = j + len("warpgroup_wait<0>();")
            body = body[:k] + " " + text + body[k:]
            pos = k + len(text)
        else:
            k = j + len(anchor)
            body = body[:k] + text + body[k:]
            pos = k + len(text)
    src = head + body
    i = once(src, PRINT_ANCHOR)
    src = src[:i] + PRINT + src[i:]
    i = once(src, ARRAY_ANCHOR)
    return src[:i] + ARRAY + src[i:]


def main(argv: list[str]) -> int:
    path = Path(argv[1]) / "mainloop_bwd_sm90_tma_gmma_ws.hpp"
    src = path.read_text()
    if "FA3TL" in src:
        print(f"{path}: already instrumented")
        return 0
    path.write_text(instrument(src))
    launch = Path(argv[1]) / "flash_bwd_launch_template.h"
    text = launch.read_text()
    if text.count(LAUNCH_ANCHOR) != 1:
        raise SystemExit(f"{launch}: the main kernel's launch not found once")
    i = text.index(LAUNCH_ANCHOR) + len(LAUNCH_ANCHOR)
    launch.write_text(text[:i] + LAUNCH + text[i:])
    print(f"{path}, {launch}: instrumented")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
