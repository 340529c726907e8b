"""Timing-only variants of solution.py: deliberately wrong versions that
remove one piece of work, so that tools/ab_bench.py's A/B bounds what making
that piece free could gain. Each variant is a set of exact text edits, each
edit given as alternatives for the forms of the code it has met (a branch
that rewrites the code adds its form, so that the same variant applies to
the branch and to its base); an edit none of whose alternatives matches
exactly once stops with an error instead of writing a file that silently
times the unchanged kernels.

    python tools/timing_variants.py --list
    python tools/timing_variants.py [--source solution.py] [--out .ab] NAME[+NAME...] ...

writes OUT/timing_NAME.py for each NAME ("a+b" applies both a's and b's
edits), which ab_bench.py times unchecked (see its docstring):

    python tools/timing_variants.py wide_no_act_copy wide_no_dequant wide_no_act_copy+wide_no_dequant
    AB_SHAPES="5 6" OUT=$OUT tools/device_check.sh ab      (carry .ab)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# wgmma_e4m3_wide<kTokens>: wide_e4m3_mma's dispatcher over the two widths.
_E4M3_WIDE_DISPATCH = """template <int kTokens>
__device__ __forceinline__ void wgmma_e4m3_wide(float (&d)[kTokens / 8][4], const uint32_t (&a)[4], uint32_t b_descriptor,
                                                uint32_t accumulate) {
    if constexpr (kTokens == 144) wgmma_m64n144k32_e4m3(d, a, b_descriptor, accumulate);
    else wgmma_m64n64k32_e4m3(d, a, b_descriptor, accumulate);
}
"""


# A folded e4m3 A fragment as its real form would build it: per row and
# block, a magnitude table (e2m1 code -> e4m3 byte, the block's exponent
# shift added: two IMADs), then per four values a PRMT of the magnitudes and
# the sign bits spread to bit 7 of each byte (PRMT, SHF, LOP3s). The shift
# here is noise from the scale byte: the values are wrong, the instructions
# are what folding would cost. The block's scale byte in the low bits, its
# fp4 word and its A fragment, as the kernel names them.
def _e4m3_folded_fragment(indent: str, scale_byte: str, word: str, fragment: str) -> str:
    lines = ["for (int h = 0; h < 2; ++h) {",
             f"    const uint32_t shift = ({scale_byte} & 7u) * 0x08080808u;",
             "    const uint32_t lut_lo = 0x3C383000u + (shift & 0xFFFFFF00u), lut_hi = 0x58504840u + shift;",
             f"    const uint32_t word = {word};",
             "#pragma unroll",
             "    for (int half = 0; half < 2; ++half) {",
             "        const uint32_t codes = word >> (16 * half);",
             "        const uint32_t magnitudes = __byte_perm(lut_lo, lut_hi, codes & 0x7777u);",
             "        const uint32_t spread = __byte_perm(codes, 0u, 0x1100u);",
             f"        {fragment}[2 * half + h] = magnitudes | (spread & 0x80008000u) | (spread << 4 & 0x00800080u);",
             "    }",
             "}"]
    return "".join(line + "\n" if line.startswith("#") else indent + line + "\n" for line in lines)


_E4M3_FOLDED_BLOCK = (
    _e4m3_folded_fragment(" " * 12, "scales[h] >> (8 * block)", "words[h]", "a[0]")
    + "            wgmma_fence();\n"
      "            wgmma_e4m3_wide<kTokens>(acc, a[0], act_descriptor + W::act_offset(0, block * 4) / 16,\n"
      "                                     !first_of_tile || block > 0);\n")

# The plain configs' block (the 64-token wgmma stage 1 and, unused on sm_90,
# mma.sync's, whose MMAs then read the wrong registers): one e4m3 k32 MMA on
# a folded-style fragment instead of two bf16 k16 ones.
_E4M3_PLAIN_BLOCK = (
    "#pragma unroll\n"
    "                for (int mt = 0; mt < MT; ++mt) {\n"
    "                    (void)kWide;\n"
    + _e4m3_folded_fragment(" " * 20, "scales[mt][h][block / 4] >> (8 * (block % 4))", "w[mt][2 * q + h]",
                            "a[mt][0]")
    + "                }\n"
      "                if constexpr (S::kAsyncStages) {   // bf16 warpgroup MMAs\n"
      "                    wgmma_fence();\n"
      "                    wgmma_m64n64k32_e4m3(acc[0], a[0][0], act_descriptor + S::act_offset(0, block * 4) / 16, 1u);\n")

# The plain e4m3 per-block pass's rescale of a block's sums (compute_blocks_fp8, narrow scales).
_PLAIN_E4M3_RESCALE = ("                            acc[mt][nt][i] = fmaf(sum[mt][nt][i] * weight_factor[i >> 1], "
                       "act_factor[nt][i & 1],\n"
                       "                                                  acc[mt][nt][i]);")

# The no_mma variants' stand-in for a warpgroup MMA: the A fragment (four
# registers) kept live and the accumulator tile (tiles x 4 floats) made
# opaque, with no instruction of their own, so that neither the fragment's
# conversion nor the work after K on the sums is compiled away.
def _keep_live(fragment: str, accumulators: str, tiles: str, indent: str) -> str:
    # One braced statement: the MMA it replaces may be a loop's unbraced body.
    return (f'{indent}{{ asm volatile("" :: "r"({fragment}[0]), "r"({fragment}[1]), "r"({fragment}[2]), '
            f'"r"({fragment}[3]));\n'
            "#pragma unroll\n"
            f"{indent}for (int n8 = 0; n8 < {tiles}; ++n8)\n"
            "#pragma unroll\n"
            f'{indent}    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"({accumulators}[n8][i])); }}')


# name: (what it removes, [edit, ...]), an edit being alternatives (old, new), ...
VARIANTS = {
    "wide_no_act_copy": (
        "stage1_wide_kernel's loaders copy no activations (the consumers read stale shared memory)",
        [(("                for (int j = 0; j < kPasses; ++j)\n"
           "                    cp_async_16_or_zeros(base + act_dst",
           "                for (int j = 0; j < 0 * kPasses; ++j)\n"
           "                    cp_async_16_or_zeros(base + act_dst"),)]),
    "wide_half_act_copy": (
        "stage1_wide_kernel's loaders copy the activations of half the tile's tokens (the others read stale "
        "shared memory): the copy instructions and L2 bytes of one-byte (e4m3) activations",
        [(("                for (int j = 0; j < kPasses; ++j)\n"
           "                    cp_async_16_or_zeros(base + act_dst",
           "                for (int j = 0; j < kPasses / 2; ++j)\n"
           "                    cp_async_16_or_zeros(base + act_dst"),)]),
    "wide_no_dequant": (
        "both wide kernels' consumers give their MMAs the raw fp4 words (no conversion or scaling); "
        "stage2_wide_kernel<64>'s MMAs then serialise (ptxas C7512), so its stage 2 is no bound",
        [(("for (int h = 0; h < 2; ++h) bf16_fragment_half(a, h, words[h], scales[h][0], block, kWide);",
           "for (int h = 0; h < 2; ++h) a[0][h] = a[0][2 + h] = a[1][h] = a[1][2 + h] = words[h] ^ scales[h][0];"),)]),
    "wide_folded_no_convert": (
        "the folded wide consumers (both wide stages, every width) give their e4m3 MMAs the raw "
        "fp4 words and their scale words (no fold through the tables, no window test per word): what the conversion "
        "chain between a block's ldmatrix and its MMA costs",
        [(("            const uint2 bytes = rows.fold_checked(h, words[h], scales[h][block / 4], block % 4, "
           "outside[h]);",
           "            const uint2 bytes = make_uint2(words[h], words[h] ^ scales[h][block / 4]);"),)]),
    "plain_folded_no_convert": (
        "the plain e4m3 stage 1's folded pass (16 to 32 tokens) gives its MMAs the raw fp4 words and their "
        "scale words (no fold through the tables, no window test per word): what the conversion costs that kernel",
        [(("                        const uint2 bytes = folded_rows[mt].fold(h, w[mt][2 * q + h], "
           "scales[mt][h][block / 4],\n"
           "                                                                 block % 4);",
           "                        const uint2 bytes = make_uint2(w[mt][2 * q + h], w[mt][2 * q + h]\n"
           "                                                       ^ scales[mt][h][block / 4]);"),)]),
    "plain_e4m3_no_convert": (
        "the plain e4m3 per-block pass (the 8-token configs, and the folded kernels' redo) gives its MMAs the raw "
        "fp4 words (no E2M1 -> E4M3 conversion; the per-block rescale kept)",
        [(("                        a[mt][0] = fp4_even_to_e4m3(w[mt][2 * q]);\n"
           "                        a[mt][1] = fp4_even_to_e4m3(w[mt][2 * q + 1]);\n"
           "                        a[mt][2] = fp4_odd_to_e4m3(w[mt][2 * q]);\n"
           "                        a[mt][3] = fp4_odd_to_e4m3(w[mt][2 * q + 1]);",
           "                        a[mt][0] = a[mt][2] = w[mt][2 * q];\n"
           "                        a[mt][1] = a[mt][3] = w[mt][2 * q + 1];"),)]),
    "wide_s2_no_act_copy": (
        "stage2_wide_kernel loads no activations (its TMA boxes of the tile's rows, bf16 or folded; the consumers "
        "read stale shared memory): what re-reading a tile's intermediate rows from L2 for every row tile costs",
        [(("mbarrier_arrive_expecting(&full[slot], W::kWeightBytes + kActBytes);",
           "mbarrier_arrive_expecting(&full[slot], W::kWeightBytes);"),),
         # the folded box skipped too (the folded stage 2 then takes the bf16 loop, of no boxes)
         (("                if constexpr (kFolded)\n"
           "                    tma_load_2d(base + W::kActOffset, &inter_map, first_block * kScaleBlock, tile.row_start,\n"
           "                                &full[slot]);\n"
           "                else\n"
           "#pragma unroll\n"
           "                    for (int h = 0; h < 2; ++h)\n",
           "                if constexpr (kFolded && false)\n"
           "                    tma_load_2d(base + W::kActOffset, &inter_map, first_block * kScaleBlock, tile.row_start,\n"
           "                                &full[slot]);\n"
           "                else\n"
           "#pragma unroll\n"
           "                    for (int h = 0; h < 0; ++h)\n"),)]),
    "wide_no_copy_wait": (
        "stage1_wide_kernel's loaders mark a stage full once the next stage's copies are issued, without "
        "waiting for the stage's own copies to land, and its units never ask for the bf16 redo (the consumers "
        "may read bytes not yet copied): what the loaders' wait for their copies costs",
        [(("                    cp_async_wait<1>();\n"
           "                    fence_async_shared();\n"
           "                    mbarrier_arrive(&full[(s - 1) % kRing]);",
           "                    fence_async_shared();\n"
           "                    mbarrier_arrive(&full[(s - 1) % kRing]);"),),
         (("            if (out_of_window) *redo_tiles = num_tiles;\n",
           "\n"),)]),
    "wide_weights_from_l2": (
        "stage1_wide_kernel's loaders read every stage's weights from its unit's first K blocks, so that after "
        "a unit's first stage they come from L2, not HBM: what the weight stream's HBM access pattern costs",
        [(("tma_load_weights_2d(box, &weight_map, (unit.first_block + block0) * 16, row,",
           "tma_load_weights_2d(box, &weight_map, unit.first_block * 16, row,"),),
         (("tma_load_weights_3d(box, &weight_map, 0, unit.first_block + block0, row / 16,",
           "tma_load_weights_3d(box, &weight_map, 0, unit.first_block, row / 16,"),)]),
    "no_qa": (
        "the first kernel's Qa CTAs return at once (stale activations, an accumulator not zeroed): "
        "its time is then the routing CTA's",
        [(("    if constexpr (kFolded)\n        quantize_hidden_row_folded<kFp8>(",
           "    if (d_hidden > 0) return;\n    if constexpr (kFolded)\n        quantize_hidden_row_folded<kFp8>("),)]),
    "qa_no_zero": (
        "the first kernel's Qa writes no zeros into the fp32 accumulator (14.7 MB at 512 tokens; stage 2 "
        "then adds onto stale values): what zeroing it there costs that kernel",
        [(("    float4* zero = reinterpret_cast<float4*>(accumulator + (size_t)token * d_hidden_pad + k);\n"
           "    zero[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);\n"
           "    zero[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);\n",
           "    (void)accumulator;\n"),)]),
    "routing_only": (
        "the first kernel launched as its routing CTA alone (no Qa CTAs at all: stale activations, "
        "an accumulator not zeroed); against no_qa, what launching the Qa grid costs",
        [(("route_and_quantize<<<dim3(m + 1, (d_hidden_pad + kPrepareColumns - 1) / kPrepareColumns),",
           "route_and_quantize<<<dim3(1, 1),"),)]),
    "no_convert": (
        "the output conversion (convert_output_kernel, fp32 accumulator to bf16) not launched: the output "
        "is left unwritten; bounds what adding the conversion into stage 2's last adds could gain",
        [(("    launch_after_previous(convert_output_kernel,",
           "    if (d_hidden < 0) launch_after_previous(convert_output_kernel,"),)]),
    "plain_s2_no_adds": (
        "the plain stage 2 (stage2_kernel) adds nothing into the accumulator: each row tile still goes "
        "through y and the CTA barrier, its weighted adds (28% of the kernel's stall samples at bs=512 "
        "E=257) are skipped",
        [(("        add_weighted_rows<kBatch>(y, tile, lookup, row0 + row_tile * kRows, d_hidden, accumulator, "
           "d_hidden_pad,",
           "        if (d_hidden < 0) add_weighted_rows<kBatch>(y, tile, lookup, row0 + row_tile * kRows, d_hidden, "
           "accumulator, d_hidden_pad,"),)]),
    "wide_s2_no_adds": (
        "the wide stage 2 (stage2_wide_kernel, every width and form) adds nothing into the accumulator: each "
        "row tile still goes through y and its barriers, its weighted adds (2.06 M four-float atomic adds at "
        "bs=128 E=33) are skipped; with wide_folded_no_convert and wide_folded_no_mma, what the weight and "
        "activation stream alone costs that stage (31 us of its 39 at bs=128 E=33, H200, 2026-12-05)",
        [(("                add_weighted_rows<4>(y, tile, lookup, row_of(row_tile), d_hidden, accumulator, "
           "d_hidden_pad,\n",
           "                if (d_hidden < 0) add_weighted_rows<4>(y, tile, lookup, row_of(row_tile), d_hidden, "
           "accumulator, d_hidden_pad,\n"),),
         (("            add_weighted_rows<4>(y, tile, lookup, row_of(row_tile), d_hidden, accumulator, d_hidden_pad, "
           "warp,",
           "            if (d_hidden < 0) add_weighted_rows<4>(y, tile, lookup, row_of(row_tile), d_hidden, accumulator, "
           "d_hidden_pad, warp,"),)]),
    "s2_plain_stores": (
        "every stage 2's weighted adds (add_weighted_rows, plain and wide kernels) store their four floats "
        "instead of adding them atomically: the same addresses and bytes with no read-modify-write in L2; "
        "against wide_s2_no_adds, how much of what the adds cost is the atomics (wide_s2_no_adds saved "
        "21 us of stage 2's 76 at d512 and 37 of 230 at d2048, H100, 2026-12-05)",
        [(("    atomicAdd(reinterpret_cast<float4*>(dst), v);",
           "    *reinterpret_cast<float4*>(dst) = v;"),)]),
    "plain_e4m3_token_scaled": (
        "the plain e4m3 per-block pass (both stages of the 8-token configs, stage 2 of every e4m3 config) "
        "rescales each block's sums by the weight row's factor alone, one FFMA, and loads no activation "
        "scale factors: what folding the activations to one scale per token (applied after K) could give it",
        [((_PLAIN_E4M3_RESCALE,
           "                            acc[mt][nt][i] = fmaf(sum[mt][nt][i], weight_factor[i >> 1], acc[mt][nt][i]);"),)]),
    "plain_e4m3_no_rescale": (
        "the plain e4m3 per-block pass adds each block's sums unscaled (one FADD, no scale factors at all): "
        "a bound on folding both operands, whose MMAs would accumulate across blocks themselves",
        [((_PLAIN_E4M3_RESCALE, "                            acc[mt][nt][i] += sum[mt][nt][i];"),)]),
    "plain_no_act_copy": (
        "gemm_mainloop copies no activations by cp.async (the plain and e4m3 configs' stage 1, and their "
        "stage 2 where it does not load them by TMA; the consumers read stale shared memory)",
        [(("                if (kEveryThreadCopiesActs || tid + j * S::kThreads < S::kActCopies) {",
           "                if (false && (kEveryThreadCopiesActs || tid + j * S::kThreads < S::kActCopies)) {"),)]),
    "plain_bf16_no_dequant": (
        "the plain bf16 configs' warps give their MMAs the raw fp4 words (no conversion or scaling)",
        [(("                        bf16_fragment_half(a[mt], h, w[mt][2 * q + h], scales[mt][h][block / 4], "
           "block % 4, kWide);",
           "                        a[mt][0][h] = a[mt][0][2 + h] = a[mt][1][h] = a[mt][1][2 + h] =\n"
           "                            w[mt][2 * q + h] ^ scales[mt][h][block / 4];"),)]),
    "wide_e4m3_mma": (
        "both wide kernels take one e4m3 m64nNk32 MMA per scale block instead of two bf16 k16 ones, on A "
        "fragments built as folded e4m3 would be (a magnitude table per row and block, signs spread), B the "
        "same activation bytes (wrong values): what e4m3 MMAs on folded operands could give the wide tiles "
        "before their activations shrink to one byte",
        [(("    else wgmma_m64n64k16(d, a, b_descriptor, accumulate);\n}\n",
           "    else wgmma_m64n64k16(d, a, b_descriptor, accumulate);\n}\n" + _E4M3_WIDE_DISPATCH),),
         (("            for (int h = 0; h < 2; ++h) bf16_fragment_half(a, h, words[h], scales[h][0], block, kWide);\n"
           "            wgmma_fence();\n"
           "#pragma unroll\n"
           "            for (int step = 0; step < 2; ++step)\n"
           "                wgmma_wide<kTokens>(acc, a[step], act_descriptor + W::act_offset(0, block * 4 + 2 * step) / 16,\n"
           "                                    !first_of_tile || block > 0 || step > 0);\n",
           _E4M3_FOLDED_BLOCK.replace("scales[h] >>", "scales[h][0] >>")),)]),
    "plain_e4m3_mma": (
        "the plain configs' warps (the 64-token wgmma stage 1) take one e4m3 m64n64k32 MMA per scale block "
        "instead of two bf16 k16 ones, on A fragments built as folded e4m3 would be, B the same activation "
        "bytes (wrong values): what e4m3 MMAs on folded operands could give the 64-token stage 1",
        [(("#pragma unroll\n"
           "                for (int mt = 0; mt < MT; ++mt)\n"
           "#pragma unroll\n"
           "                    for (int h = 0; h < 2; ++h)\n"
           "                        bf16_fragment_half(a[mt], h, w[mt][2 * q + h], scales[mt][h][block / 4], block % 4, kWide);\n"
           "                if constexpr (S::kAsyncStages) {   // bf16 warpgroup MMAs\n"
           "                    // Both k16 steps of the block on the warpgroup, then wait\n"
           "                    // only for the previous block's: converting the next block\n"
           "                    // overlaps this one's MMAs.\n"
           "                    wgmma_fence();\n"
           "#pragma unroll\n"
           "                    for (int s = 0; s < 2; ++s)\n"
           "                        wgmma_m64n64k16(acc[0], a[0][s], act_descriptor + S::act_offset(0, block * 4 + 2 * s) / 16, 1u);\n",
           _E4M3_PLAIN_BLOCK),)]),
    "plain_folded_no_mma": (
        "the plain e4m3 stage 1's folded pass (16 to 32 tokens) issues no MMAs: each block's A fragment is "
        "still built, then only kept live, and the accumulators are opaque to the compiler (the epilogue's work "
        "stays); with plain_folded_no_convert, what the weight stream alone takes",
        [(("                    wgmma_e4m3_mma<WT * 8>(acc[mt], a[mt], act_descriptor + S::act_offset(0, 2 * block) "
           "/ 16, 1u);",
           _keep_live("a[mt]", "acc[mt]", "WT", " " * 20)),)]),
    "plain_e4m3_no_mma": (
        "the plain e4m3 per-block pass (both stages of the 8-token configs, stage 2 of every e4m3 config) "
        "issues no MMAs: the A fragments are built and kept live, each block's sums opaque, so the per-block "
        "rescale still runs; with plain_e4m3_no_convert, what the stream and the rescale take",
        [(("                    wgmma_e4m3<WT>(sums[q][mt], a[mt], act_descriptor + S::act_offset(0, 2 * block) / 16);",
           _keep_live("a[mt]", "sums[q][mt]", "WT", " " * 20)),)]),
    "wide_folded_no_mma": (
        "the folded wide consumers (both wide stages, every width) issue no MMAs: the A "
        "fragments are built and kept live, the accumulators opaque; with wide_folded_no_convert, what the "
        "weight stream alone takes",
        [(("        wgmma_e4m3_mma<kTokens>(acc, a, act_descriptor + W::act_offset(0, 2 * block) / 16,\n"
           "                                !first_of_tile || block > 0);",
           _keep_live("a", "acc", "kTokens / 8", " " * 8)),)]),
    "plain_half_act_copy": (
        "gemm_mainloop's cp.async activation copies halved (the plain and e4m3 configs' stage 1; the other "
        "half of the tile's activations is stale shared memory): the copy instructions and L2 bytes of "
        "one-byte (e4m3) activations",
        [(("            for (int j = 0; j < S::kActChunks; ++j)\n"
           "                if (kEveryThreadCopiesActs || tid + j * S::kThreads < S::kActCopies) {",
           "            for (int j = 0; j < (S::kActChunks + 1) / 2; ++j)\n"
           "                if (kEveryThreadCopiesActs || tid + j * S::kThreads < S::kActCopies) {"),)]),
    "wide_s1_no_epilogue": (
        "stage1_wide_kernel's one-slice units end with no SwiGLU, no Qa and no store (the sums kept live; "
        "inter is left unwritten, so read stage 1's span only): what a whole unit's epilogue costs the "
        "consumers (d2048; every wide shape where K is one slice)",
        [(("        // SwiGLU, then Qa per 32-column block through shared memory (as stage1_kernel).\n"
           "#pragma unroll\n"
           "        for (int nt = 0; nt < kTokens / 8; ++nt)\n"
           "#pragma unroll\n"
           "            for (int j = 0; j < 2; ++j)\n"
           "                h[(nt * 8 + 2 * t + j) * kStage1HStride + local_col] =\n"
           "                    unit.col0 + local_col < d_expert ? swiglu_bf16(acc[nt][j], acc[nt][2 + j]) : 0.0f;\n"
           "        named_barrier_sync(1, W::kConsumerWarps * 32);\n"
           "        quantize_h_rows_bf16<W::kConsumerWarps>(h, unit.tile.rows, warp, lane, unit.tile.row_start, "
           "unit.col0,\n"
           "                                                d_expert_pad, inter);\n"
           "        named_barrier_sync(1, W::kConsumerWarps * 32);   // h is free again\n",
           "#pragma unroll\n"
           "        for (int nt = 0; nt < kTokens / 8; ++nt)\n"
           "#pragma unroll\n"
           "            for (int i = 0; i < 4; ++i) asm volatile(\"\" : \"+f\"(acc[nt][i]));\n"),)]),
    "no_empty_fallbacks": (
        "the wide path's three fallback kernels, which leave at once unless a fold failed (folded_fallback_kernel, "
        "the bf16 stage-1 redo, the bf16 stage-2 redo), not launched, nor the down weights' fold check with them: "
        "what their places in the kernel chain cost the wide shapes, whose benchmark inputs never need them",
        [(("        launch_after_previous(folded_fallback_kernel, dim3(sm_count()), kFallbackThreads, 0, c.stream,\n",
           "        if (c.d_hidden < 0) launch_after_previous(folded_fallback_kernel, dim3(sm_count()), kFallbackThreads, "
           "0, c.stream,\n"),),
         (("        launch(stage1, W::kSharedBytes, gate_up_map(c, W::kStageBlocks), c.act.fallback_bytes(), nullptr, "
           "redo_tiles);\n",
           "        if (c.d_hidden < 0) launch(stage1, W::kSharedBytes, gate_up_map(c, W::kStageBlocks), "
           "c.act.fallback_bytes(), nullptr, redo_tiles);\n"),),
         (("        launch(stage2, W::threads(false), c.sorted_weights, c.stage2_redo, inter_map(c, kTokens));\n",
           "        if (c.d_hidden < 0) launch(stage2, W::threads(false), c.sorted_weights, c.stage2_redo, "
           "inter_map(c, kTokens));\n"),
          ("            launch(stage2, W::threads(false), c.sorted_weights, c.stage2_redo, bf16_acts);\n",
           "            if (c.d_hidden < 0) launch(stage2, W::threads(false), c.sorted_weights, c.stage2_redo, "
           "bf16_acts);\n"))]),
    "narrow_first_tiles_only": (
        "the narrow stages' CTAs (stage1_kernel, stage2_kernel) leave at once unless their tile is its expert's "
        "first: each crowded expert (the shared one's 22 tiles at bs=512 E=257, 16 at bs=128 E=257) costs "
        "one tile's consumer work; a bound on what wider tiles for crowded experts could gain",
        [(("    if (index >= *num_tiles) return false;\n"
           "    tile = tile_at(tiles, index);\n"
           "    return true;\n",
           "    if (index >= *num_tiles) return false;\n"
           "    tile = tile_at(tiles, index);\n"
           "    return index == 0 || tile_at(tiles, index - 1).expert != tile.expert;\n"),)]),
    "narrow_shared_first_tile_only": (
        "as narrow_first_tiles_only, for the shared expert alone (the last expert in the tile table): its "
        "repeated tiles leave at once, crowded routed experts keep theirs; against narrow_first_tiles_only, how "
        "much of that bound the shared expert on wide tiles (/work/notes/shared-expert-wide-sketch.md) could take",
        [(("    if (index >= *num_tiles) return false;\n"
           "    tile = tile_at(tiles, index);\n"
           "    return true;\n",
           "    if (index >= *num_tiles) return false;\n"
           "    tile = tile_at(tiles, index);\n"
           "    return tile.expert != tile_at(tiles, *num_tiles - 1).expert || index == 0\n"
           "           || tile_at(tiles, index - 1).expert != tile.expert;\n"),)]),
}


def apply(source: str, name: str) -> str:
    """source with the edits of every variant in name ("a+b")."""
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"timing_variants: no variant {part!r} (--list shows them)")
        for alternatives in VARIANTS[part][1]:
            matching = [(old, new) for old, new in alternatives if source.count(old) == 1]
            if len(matching) != 1:
                raise SystemExit(f"timing_variants: {part}: {len(matching)} of an edit's {len(alternatives)} forms "
                                 f"occur once in the source, not one; the first:\n{alternatives[0][0]}")
            old, new = matching[0]
            source = source.replace(old, new)
    return source


def main(argv):
    if "--list" in argv:
        for name, (what, _) in VARIANTS.items():
            print(f"{name:24s} {what}")
        return
    source_path, out, names = "solution.py", ".ab", []
    args = iter(argv)
    for arg in args:
        if arg == "--source":
            source_path = next(args)
        elif arg == "--out":
            out = next(args)
        elif arg.startswith("-"):   # --help among them: a name never starts with "-"
            raise SystemExit(__doc__)
        else:
            names.append(arg)
    if not names:
        raise SystemExit(__doc__)
    source = open(source_path).read()
    # Every variant made before any file is written: a name that does not
    # apply must not leave an empty timing_*.py for device_check.sh's ab to pick up.
    variants = {name: apply(source, name) for name in names}
    os.makedirs(out, exist_ok=True)
    for name, text in variants.items():
        path = os.path.join(out, f"timing_{name.replace('+', '_and_')}.py")
        with open(path, "w") as f:
            f.write(text)
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
