"""Warp-specialised Hopper (sm90) attention forward over a lowered MaskPlan (CuTe DSL).

One CTA of 384 threads: warpgroup 0 is the producer (one warp issues TMA loads; registers
lowered with ``setmaxnreg``), warpgroups 1 and 2 are consumers, each owning 64 of the 128
query rows of a work item (registers raised). The CTAs are persistent and take the lowered
work list's entries (``lower.work``) in list order as they free up: CTA ``c`` starts with
entry ``c``, then its producer draws ``grid + atomicAdd(counter, 1)`` (a global int32
counter, zero at launch) and hands each entry to the consumers through a shared-memory slot
per Q stage (:meth:`FlashFwdSm90.produce`), so the CTAs' shares balance by the real time of
the entries.

Per work item ``(b, hq, qt, m, n, nf, list0)`` (one row of ``lower.work``: the q-tile's kv
count ``n``, FULL count ``nf`` and first row ``list0`` of ``tiles`` ride in the entry, so one
round trip of loads starts an item) the producer loads the two 64-row Q halves into their own
stages (``Q_STAGES`` = 4: two items' halves, so the next item's Q loads while the current
one runs; a consumer gives its stage back after its last S GEMM), then K and V of every
kv-tile of the q-tile's kv list (``tiles[list0 + i, 0]``) into one shared-memory ring of
``KV_STAGES`` stages guarded by mbarriers (``PipelineTmaAsync``: full barriers count the TMA
bytes, empty barriers one arrive per consumer warp). The consumers run ``S = Q K^T`` with
wgmma from shared memory, the online softmax in registers, and ``O += P V`` with P from
registers. FULL kv-tiles (the first ``nf`` of the list) run without mask arithmetic;
PARTIAL ones hide every key their page does not show: the lowering stores each PARTIAL
entry's mask in thread order (``lower.pages``: one 64-bit word per consumer thread, its two
rows' 32 columns each), so a thread reads its word with one coalesced load and masks with
it directly (:func:`page_seen`); that load is issued right after the tile's GEMMs, before
the wait for S (:meth:`FlashFwdSm90.mask_seen`), so its latency runs under the GEMMs.
A row that sees no key ends with a zero sum: out 0, lse -inf. O leaves through shared
memory: ``stmatrix`` into the warpgroup's 64 x D tile, then one TMA store (lse: per element).

Intra-warpgroup overlap (software pipelining one kv-tile deep, per consumer warpgroup): the
S GEMM of entry ``i`` and the PV GEMM of entry ``i - 1`` are issued back to back as two
wgmma groups; the warpgroup waits for the first group only, masks and runs the softmax of
``S_i`` on the CUDA cores while the tensor cores finish ``P_{i-1} V_{i-1}``, then waits for
the second, rescales O and writes ``P_i`` over ``P_{i-1}`` (see :meth:`FlashFwdSm90.kv_steps`).
The two consumer warpgroups take turns issuing those GEMMs (ping-pong through the named
barriers ``SCHED_BARRIER + cw``), so the softmax of one runs while the GEMMs of the other do.
Registers per consumer thread: S 64, O 32 / 64 (head_dim 64 / 128), P 32 (16-bit), live
together; the 240 of ``setmaxnreg`` hold it without spills (ptxas, sm_90a).

Score modifiers (one compiled kernel each, :data:`~.lower.MODIFIERS`): a lone softcap takes
``tanh(s * scale / cap)`` before the mask and the softmax's exponent scale ``cap * log2 e``
(with one tanh and one exp2 per score on the special-function unit, :data:`EXP2_FMA_OF_4` of
the exp2 of FULL tiles run on the FMA pipe instead, :func:`exp2_fma`); ALiBi holds S in log2
units from its first step (``s * scale * log2 e + slope * log2 e * (kv - q)``, two FMAs that
both read S).
The ALiBi kernel reads its slopes and each K stage's kv-tile from shared memory (the producer
writes the kv-tile before the stage's full barrier): a global load among the consumers' GEMMs
makes ptxas serialise the wgmma of bf16 at head_dim 128 (C7512 / C7519).

Tensors (all with dynamic shapes and strides; one compiled kernel per (head_dim, dtype,
modifier)):
q ``(Nq, D, Hq, B)``, k ``(Nk, D, Hkv, B)``, v ``(D, Nk, Hkv, B)`` (views of our
``[B, H, N, D]`` tensors, D contiguous), out like q, lse ``(Nq, Hq, B)`` fp32.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync, warpgroup

from .exp2 import exp2_fma_ptx
from .lower import ALIBI_MAX_HEADS, BLOCK_M, BLOCK_N, MODIFIERS

WG_THREADS = 128
ROWS_PER_WG = 64
KV_STAGES = 4  # K and V tiles alternate in the ring: two kv-tiles in flight
#: Q stages: the two 64-row halves of two work items, so the producer loads the next item's Q
#: while the consumers still run the current one
Q_STAGES = 4
LOAD_REGS = 24
#: named barriers 1 and 2 order the GEMM issue of consumer warpgroups 0 and 1 (0 is
#: ``sync_threads``)
SCHED_BARRIER = 1
#: named barriers 3 and 4: the threads of consumer warpgroup 0 / 1 around its O tile in smem
EPI_BARRIER = 3
MMA_REGS = 240
SMEM_BYTES = 227 * 1024  # sm90's most shared memory per CTA
LOG2E = math.log2(math.e)
ACC = 4  # independent partial maxima / sums per row in the softmax
LN2 = math.log(2.0)
#: the softcap kernel's FULL tiles: of every 4 consecutive columns of a thread, how many take
#: their softmax exp2 on the FMA pipe (:func:`exp2_fma`) instead of the special-function unit,
#: which then runs one tanh and one exp2 per score
EXP2_FMA_OF_4 = 1


def pairwise(values: list, op):
    """``op`` over ``values`` (a power-of-two count) as a balanced tree, at trace time."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


EXP2_FMA_PTX = exp2_fma_ptx()


@cutlass.dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """``2^x`` on the FMA pipe (:mod:`.exp2`: Cody-Waite and a cubic; -inf gives +0.0,
    0 gives 1 exactly)."""
    from cutlass._mlir.dialects import llvm

    return Float32(
        llvm.inline_asm(
            Float32.mlir_type,
            [Float32(x).ir_value(loc=loc, ip=ip)],
            EXP2_FMA_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cutlass.dsl_user_op
def fma_f32(a, b, c, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` rounded once (``fma.rn.f32``), so that no product of ``a`` and ``b``
    exists on its own for the compiler to keep in a register across loop iterations."""
    from cutlass._mlir.dialects import math as mlir_math

    return Float32(
        mlir_math.fma(
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
            Float32(c).ir_value(loc=loc, ip=ip),
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def read_entry(work: cute.Tensor, tiles: cute.Tensor, item: Int32):
    """Work entry ``item``: ``(b, hq, qt, n, nf, list0)`` (the entry's mask index, column 3,
    is in its pages already), its columns read together (one memory round trip). What indexes
    the plan's tensors is clamped to their ranges: ``list0`` (the q-tile's first row of
    ``tiles``) and ``n`` so that rows ``list0 .. list0 + n - 1`` exist, ``nf`` to ``n``; a few
    integer instructions per item, none per kv-tile. (``b`` / ``hq`` / ``qt`` only place TMA
    boxes, which the TMA unit clips, and the lse stores, which the lowering builds from the
    call's own shape.)"""
    b, hq, qt = work[item, 0], work[item, 1], work[item, 2]
    n, nf, list0 = work[item, 4], work[item, 5], work[item, 6]
    list0 = cutlass.max(cutlass.min(list0, tiles.shape[0]), 0)
    n = cutlass.min(n, tiles.shape[0] - list0)
    nf = cutlass.min(nf, n)
    return b, hq, qt, n, nf, list0


@cute.jit
def page_seen(pages: cute.Tensor, page: Int32, thread: Int32):
    """The two ``seen`` words (bit ``c``: the thread's column ``c`` of its row ``r`` is
    visible) of consumer thread ``thread`` (0..255) from thread-order page ``page``
    (:mod:`.lower`): one 64-bit load, low half row 0, high half row 1. The one place the
    kernel reads a PARTIAL tile's mask; ``page`` is clamped to the pages there are."""
    page = cutlass.max(cutlass.min(page, pages.shape[0] - 1), 0)
    word = pages[page, thread]
    return Uint32(word), Uint32(word >> 32)


class FlashFwdSm90:
    """The kernel for one ``(head_dim, dtype)``; ``__call__`` is the ``cute.jit`` host side."""

    def __init__(self, head_dim: int, dtype, modifier: str = ""):
        """``modifier`` (:data:`MODIFIERS`): ``"softcap"``, the kernel that caps scores,
        ``s -> tanh(s * tanh_scale)`` before the mask and the softmax (whose exponent scale is
        then ``cap * log2 e``; :data:`EXP2_FMA_OF_4` of its exp2 on the FMA pipe); ``"alibi"``,
        the kernel that adds ``slopes[hq] * (kv_idx - q_idx)`` to the scaled score before the
        mask (indices in the plan's token order, as the other backends)."""
        assert head_dim in (64, 128)
        assert BLOCK_M == 2 * ROWS_PER_WG
        assert modifier in MODIFIERS, modifier
        self.head_dim = head_dim
        self.dtype = dtype
        self.softcap = modifier == "softcap"
        self.alibi = modifier == "alibi"
        self.block_n = BLOCK_N
        self.threads = 3 * WG_THREADS

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        work: cute.Tensor,
        tiles: cute.Tensor,
        pages: cute.Tensor,
        slopes: cute.Tensor,
        scale_log2: Float32,
        tanh_scale: Float32,
        num_ctas: Int32,
        counter: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """``counter``: the int32 ``[1]`` entry counter, zero at launch; ``slopes``: float32
        ``[Hq]`` (ALiBi's; read by the ``"alibi"`` kernel only)."""
        D, N = self.head_dim, self.block_n
        dt = self.dtype
        k_major = warpgroup.OperandMajorMode.K
        mn_major = warpgroup.OperandMajorMode.MN
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (ROWS_PER_WG, N)
        )
        # the same MMA twice: its first k-block overwrites S, the others accumulate (the flag
        # is set once per object, outside any loop, so no loop has to carry it)
        qk_mma_acc = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (ROWS_PER_WG, N)
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (ROWS_PER_WG, D),
            warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        row_major = utils.LayoutEnum.ROW_MAJOR  # K-major operands
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS_PER_WG, N, D), dt, Q_STAGES)
        sK_layout = sm90_utils.make_smem_layout_b(row_major, (ROWS_PER_WG, N, D), dt, KV_STAGES)
        sV_layout = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.COL_MAJOR, (ROWS_PER_WG, D, N), dt, KV_STAGES
        )
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.slice_(sQ_layout, (None, None, 0)), (ROWS_PER_WG, D)
        )
        tma_k, tK = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.slice_(sK_layout, (None, None, 0)), (N, D)
        )
        tma_v, tV = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.slice_(sV_layout, (None, None, 0)), (D, N)
        )
        # O leaves through shared memory: one 64 x D tile per consumer warpgroup (Q's layout)
        sO_layout = sm90_utils.make_smem_layout_a(row_major, (ROWS_PER_WG, N, D), dt, 2)
        tma_o, tO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.slice_(sO_layout, (None, None, 0)),
            (ROWS_PER_WG, D),
        )  # fmt: skip
        self.q_bytes = cute.size_in_bytes(dt, cute.slice_(sQ_layout, (None, None, 0)))
        self.kv_bytes = cute.size_in_bytes(dt, cute.slice_(sK_layout, (None, None, 0)))

        @cute.struct
        class Storage:
            q_bar: cute.struct.MemRange[cutlass.Int64, Q_STAGES * 2]
            kv_bar: cute.struct.MemRange[cutlass.Int64, KV_STAGES * 2]
            # per Q stage: the work entry whose Q half it holds, -1 for "no more work"
            q_item: cute.struct.MemRange[Int32, Q_STAGES]
            # the ALiBi kernel: per ring stage the kv-tile of the K tile it holds; the slopes
            # times log2 e
            kv_tile: cute.struct.MemRange[Int32, KV_STAGES]
            slopes: cute.struct.MemRange[Float32, ALIBI_MAX_HEADS]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sO_layout)], 1024]

        # 225 KB at head_dim 128 (Q 4 x 16, K/V ring 4 x 32, O 2 x 16 KB): under sm90's 227 KB
        assert Storage.size_in_bytes() <= SMEM_BYTES, Storage.size_in_bytes()
        self.storage = Storage
        self.kernel(
            qk_mma, qk_mma_acc, pv_mma, tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO, mLSE,
            work, tiles, pages, slopes, scale_log2, tanh_scale, sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout, counter,
        ).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        qk_mma_acc: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        tQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        tK: cute.Tensor,
        tma_v: cute.CopyAtom,
        tV: cute.Tensor,
        tma_o: cute.CopyAtom,
        tO: cute.Tensor,
        mLSE: cute.Tensor,
        work: cute.Tensor,
        tiles: cute.Tensor,
        pages: cute.Tensor,
        slopes: cute.Tensor,
        scale_log2: Float32,
        tanh_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        counter: cute.Tensor,
    ):
        D, N = self.head_dim, self.block_n
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)

        smem = utils.SmemAllocator()
        st = smem.allocate(self.storage)
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.q_bar.data_ptr(),
            num_stages=Q_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG_THREADS // 32),
            tx_count=self.q_bytes,
            defer_sync=True,
        )
        _, q_cons = q_pipe.make_participants()  # the producer drives q_pipe itself
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.kv_bar.data_ptr(),
            num_stages=KV_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * WG_THREADS // 32),
            tx_count=self.kv_bytes,
            defer_sync=True,
        )
        kv_prod, kv_cons = kv_pipe.make_participants()
        kv_tile = st.kv_tile.get_tensor(cute.make_layout(KV_STAGES))
        slopes_s = st.slopes.get_tensor(cute.make_layout(ALIBI_MAX_HEADS))
        if cutlass.const_expr(self.alibi):
            heads = cutlass.min(slopes.shape[0], ALIBI_MAX_HEADS)
            for h in cutlass.range(tidx, heads, self.threads):
                slopes_s[h] = slopes[h] * Float32(LOG2E)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sO = st.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V tiles live in the same ring as K tiles (same size), with V's swizzle
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            # ------------------------------------------------------------ producer
            cute.arch.setmaxregister_decrease(LOAD_REGS)
            if warp == 0:
                cpasync.prefetch_descriptor(tma_q)
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                self.produce(
                    q_pipe, kv_pipe, kv_prod, tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, work,
                    tiles, counter, st.q_item.get_tensor(cute.make_layout(Q_STAGES)),
                    kv_tile,
                )  # fmt: skip
        else:
            # ------------------------------------------------------------ consumers
            cute.arch.setmaxregister_increase(MMA_REGS)
            qk_mma.set(warpgroup.Field.ACCUMULATE, False)
            qk_mma_acc.set(warpgroup.Field.ACCUMULATE, True)
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            cw = wg - 1
            if cw == 0:  # consumer 0 issues first
                cute.arch.barrier_arrive(barrier_id=SCHED_BARRIER, number_of_threads=2 * WG_THREADS)
            wtid = tidx % WG_THREADS
            lane = tidx % 32
            warp_in_wg = wtid // 32
            qk_thr = qk_mma.get_slice(wtid)
            pv_thr = pv_mma.get_slice(wtid)
            tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
            tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
            tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
            s_shape = qk_thr.partition_shape_C((ROWS_PER_WG, N))
            o_shape = pv_thr.partition_shape_C((ROWS_PER_WG, D))
            q_len = tQ.shape[0]
            # the entry of the next Q stage of this warpgroup (-1: no more work), read after
            # the stage's wait; the wait at the top of the loop then finds the same phase
            # complete and returns at once
            q_item = st.q_item.get_tensor(cute.make_layout(Q_STAGES))
            if cw == 1:
                q_cons.advance()
            item = q_item[q_cons.wait().index]
            while item >= 0:
                b, hq, qt, n, nf, list0 = read_entry(work, tiles, item)
                row0 = qt * (2 * ROWS_PER_WG) + cw * ROWS_PER_WG + warp_in_wg * 16 + lane // 4
                qh = q_cons.wait()
                acc_o = pv_thr.make_fragment_C(o_shape)
                acc_o.fill(0.0)
                row_max = cute.make_rmem_tensor((2,), Float32)
                row_sum = cute.make_rmem_tensor((2,), Float32)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                corr = cute.make_rmem_tensor((2,), Float32)
                # S of the current tile, and P of the previous one (the register A operand of
                # its PV GEMM)
                acc_s = qk_thr.make_fragment_C(s_shape)
                rP = cute.make_rmem_tensor(acc_s.layout, self.dtype)
                # the item's tiles, software-pipelined one tile deep: S of tile 0 first, then
                # per tile i >= 1 the GEMMs S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight
                # together while the softmax of S_i runs, then the last PV alone
                ts = SimpleNamespace(
                    qh=qh, qk_mma=qk_mma, qk_mma_acc=qk_mma_acc, pv_mma=pv_mma, tSrQ=tSrQ,
                    tSrK=tSrK, tOrV=tOrV, acc_s=acc_s, acc_o=acc_o, row_max=row_max,
                    row_sum=row_sum, corr=corr, rP=rP, scale_log2=scale_log2, tiles=tiles,
                    tanh_scale=tanh_scale, slopes=slopes_s, hq=hq, kv_tile=kv_tile,
                    pages=pages, list0=list0, row0=row0, thread=cw * WG_THREADS + wtid,
                    lane=lane, cw=cw,
                )  # fmt: skip
                if n > 0:
                    kv_cons = self.first_tile(kv_cons, nf, ts)
                    kv_cons = self.kv_steps(False, Int32(1), nf, kv_cons, ts)
                    kv_cons = self.kv_steps(True, cutlass.max(nf, Int32(1)), n, kv_cons, ts)
                # every S GEMM has completed (each step waits for all its wgmma groups): the
                # Q stage goes back to the producer before the last PV GEMM and the epilogue
                qh.release()
                if n > 0:
                    kv_cons = self.last_pv(kv_cons, ts)
                if cw == 0:
                    q_cons.advance()
                q_cons.advance()
                # the ALiBi kernel's row max is in log2 units already
                lse_scale = Float32(1.0) if self.alibi else scale_log2
                self.epilogue(
                    acc_o, row_max, row_sum, lse_scale, pv_mma, tma_o, tO, sO, mLSE, b, hq, qt,
                    cw, row0, q_len, wtid, lane,
                )  # fmt: skip
                if cw == 1:
                    q_cons.advance()
                item = q_item[q_cons.wait().index]
            if warp_in_wg == 0:  # the last O tile has left shared memory before the CTA ends
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def produce(
        self, q_pipe, kv_pipe, kv_prod, tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, work,
        tiles, counter, q_item, kv_tile,
    ):  # fmt: skip
        """The producer warp: work entries in list order from the global
        ``counter`` (CTA ``c`` starts with entry ``c``, then takes ``grid + atomicAdd(counter,
        1)``, drawn when it has issued the last K/V load of its current entry).

        Per entry both Q stages are acquired by hand: wait for the stage to be empty, then the
        elected thread writes the entry's index into ``q_item[stage]`` and arrives on the
        stage's full barrier with its TMA bytes (``mbarrier.arrive`` has release semantics at
        CTA scope, the consumers' ``try_wait`` acquire: the index is visible to a consumer that
        saw the phase complete), then the TMA loads. Past the list the two stages get -1 and a
        plain arrive (no bytes: the phase completes at once), and the producer stops; each
        consumer warpgroup leaves its loop on reading -1 from its stage."""
        D = self.head_dim
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        num_work = work.shape[0]
        group = tQ.shape[2] // tK.shape[2]
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, Q_STAGES)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        item = bidx
        live = Int32(1)
        while live > 0:
            slot = Int32(-1)
            if item < num_work:
                slot = item
            # clamped: the entry's loads issue before the stage waits, also past the list
            at = cutlass.max(cutlass.min(item, num_work - 1), 0)
            b, hq, qt, n, _, list0 = read_entry(work, tiles, at)
            stage0 = q_state.index
            for half in cutlass.range_constexpr(2):  # noqa: B007 (the DSL refuses `_` here)
                q_pipe.sync_object_empty.wait(q_state.index, q_state.phase)
                bar = q_pipe.sync_object_full.get_barrier(q_state.index)
                with cute.arch.elect_one():
                    q_item[q_state.index] = slot
                    if slot >= 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.q_bytes)
                    else:
                        cute.arch.mbarrier_arrive(bar)
                q_state.advance()
            if slot >= 0:
                hk = hq // group
                gQ = cute.local_tile(tQ[None, None, hq, b], (ROWS_PER_WG, D), (None, 0))
                tQs, tQg = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1),
                    cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2),
                )  # fmt: skip
                for half in cutlass.range_constexpr(2):
                    # the pair of stages of one entry never wraps (Q_STAGES is even)
                    stage = stage0 + half
                    cute.copy(
                        tma_q, tQg[None, qt * 2 + half], tQs[None, stage],
                        tma_bar_ptr=q_pipe.sync_object_full.get_barrier(stage),
                    )  # fmt: skip
                kv_prod, kv_state = self.load_kv(
                    kv_pipe, kv_prod, kv_state, tma_k, tK, tma_v, tV, sK, sV, tiles, b, hk,
                    list0, n, kv_tile,
                )  # fmt: skip
                nxt = Int32(0)
                if lane == 0:
                    nxt = cute.arch.atomic_add(counter.iterator, Int32(1))
                item = grid + cute.arch.shuffle_sync(nxt, 0)
            else:
                live = Int32(0)

    @cute.jit
    def load_kv(
        self, kv_pipe, kv_prod, kv_state, tma_k, tK, tma_v, tV, sK, sV, tiles, b, hk, list0, n,
        kv_tile,
    ):  # fmt: skip
        """TMA loads of K and V of the ``n`` kv-tiles ``tiles[list0 + i, 0]`` of kv head ``hk``
        of batch row ``b`` into the ring (K then V per kv-tile). The ALiBi kernel also writes
        each K stage's kv-tile into ``kv_tile[stage]``: after the stage's empty wait, before
        the arrive on its full barrier (as for ``q_item``), so a consumer that saw the stage
        full reads it (``kv_state``: the ring's producer state, in step with ``kv_prod``'s)."""
        D, N = self.head_dim, self.block_n
        gK = cute.local_tile(tK[None, None, hk, b], (N, D), (None, 0))
        tKs, tKg = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1),
            cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2),
        )  # fmt: skip
        gV = cute.local_tile(tV[None, None, hk, b], (D, N), (0, None))
        tVs, tVg = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1),
            cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2),
        )  # fmt: skip
        for i in cutlass.range(n, unroll=1):
            kt = tiles[list0 + i, 0]
            if cutlass.const_expr(self.alibi):  # the K stage acquired by hand, as q_item's
                kv_pipe.sync_object_empty.wait(kv_state.index, kv_state.phase)
                bar = kv_pipe.sync_object_full.get_barrier(kv_state.index)
                with cute.arch.elect_one():
                    kv_tile[kv_state.index] = kt
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, self.kv_bytes)
                cute.copy(tma_k, tKg[None, kt], tKs[None, kv_state.index], tma_bar_ptr=bar)
                kv_prod.advance()
            else:
                h = kv_prod.acquire_and_advance()
                cute.copy(tma_k, tKg[None, kt], tKs[None, h.index], tma_bar_ptr=h.barrier)
            h = kv_prod.acquire_and_advance()
            cute.copy(tma_v, tVg[None, kt], tVs[None, h.index], tma_bar_ptr=h.barrier)
            kv_state.advance()
            kv_state.advance()
        return kv_prod, kv_state

    @cute.jit
    def qk_gemm(self, ts, acc_s, k_stage):
        """Issue S = Q K^T (64 x N per warpgroup) for the K tile in ring stage ``k_stage``."""
        for kb in cutlass.range_constexpr(cute.size(ts.tSrQ, mode=[2])):
            mma = ts.qk_mma if kb == 0 else ts.qk_mma_acc
            cute.gemm(
                mma, acc_s, ts.tSrQ[None, None, kb, ts.qh.index], ts.tSrK[None, None, kb, k_stage],
                acc_s,
            )  # fmt: skip

    @cute.jit
    def pv_gemm(self, ts, v_stage):
        """Issue O += P V with P from registers (``ts.rP``) and the V tile of ``v_stage``."""
        tOrP = cute.make_tensor(ts.rP.iterator, self.a_layout(self.block_n))
        for kb in cutlass.range_constexpr(self.block_n // 16):
            cute.gemm(
                ts.pv_mma, ts.acc_o, tOrP[None, None, kb], ts.tOrV[None, None, kb, v_stage],
                ts.acc_o,
            )  # fmt: skip

    @cute.jit
    def softmax(self, masked: cutlass.Constexpr, acc_s, seen, ts, col0):
        """(Mask,) online softmax of S in place (S becomes P), row max / sum updated,
        ``ts.corr[r]`` the factor that rescales the O of the old max. ``seen``: the rows'
        visibility words of the tile (:meth:`mask_seen`) when ``masked``, else None;
        ``col0``: the thread's first key column in the tile (:meth:`tile_col0`; the ALiBi
        kernel's, None otherwise). The ALiBi kernel holds S in log2 units from its first
        step on (scale and bias in one FMA), so its max, sum and exponents take no scale."""
        N = self.block_n
        # (row, col) view of the wgmma accumulator: per thread 2 rows x N/4 columns
        s_mn = cute.make_tensor(acc_s.iterator, self.mn_layout(N))
        if cutlass.const_expr(self.softcap):  # capped before the mask: tanh(-inf) is -1
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(N // 4):
                    s_mn[r, c] = cute.math.tanh(s_mn[r, c] * ts.tanh_scale, fastmath=True)
        if cutlass.const_expr(self.alibi):  # s * scale + slope (kv - q), in log2 units
            # the slope and the column are loaded here, not kept in registers across the
            # item: two more live registers serialise the wgmma of bf16 at head_dim 128
            slope = ts.slopes[ts.hq]
            for r in cutlass.range_constexpr(2):
                bias = slope * Float32(col0 - (ts.row0 + 8 * r))
                for c in cutlass.range_constexpr(N // 4):
                    # both steps read S: no bias term is made before the S GEMM's wait
                    x = fma_f32(s_mn[r, c], ts.scale_log2, bias)
                    s_mn[r, c] = fma_f32(Float32(8 * (c // 2) + c % 2), slope, x)
        unit = cutlass.const_expr(self.alibi)  # S in log2 units already
        if cutlass.const_expr(masked):
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(N // 4):
                    if (seen[r] & Uint32(1 << c)) == Uint32(0):
                        s_mn[r, c] = -Float32.inf
        # the row max and sum over a thread's N/4 scores run in ACC independent partial
        # chains (N/4/ACC dependent steps each, not N/4): with ping-pong one warp per SM
        # sub-partition is in its softmax at a time, so the latency of a chain is not hidden
        for r in cutlass.range_constexpr(2):
            part = [s_mn[r, a] for a in range(ACC)]
            for c in cutlass.range_constexpr(ACC, N // 4):
                part[c % ACC] = cute.arch.fmax(part[c % ACC], s_mn[r, c])
            mx = cute.arch.fmax(pairwise(part, cute.arch.fmax), ts.row_max[r])
            mx = cute.arch.warp_reduction_max(mx, threads_in_group=4)
            base = mx
            if mx == -Float32.inf:
                base = Float32(0.0)
            if cutlass.const_expr(unit):
                corr = cute.math.exp2(ts.row_max[r] - base, fastmath=True)
            else:
                corr = cute.math.exp2((ts.row_max[r] - base) * ts.scale_log2, fastmath=True)
            ts.row_max[r] = mx
            if cutlass.const_expr(unit):
                shift = base
            else:
                shift = base * ts.scale_log2
            part = [Float32(0.0)] * ACC
            for c in cutlass.range_constexpr(N // 4):
                if cutlass.const_expr(unit):
                    x = s_mn[r, c] - shift
                else:
                    x = s_mn[r, c] * ts.scale_log2 - shift
                # FULL tiles only: PARTIAL ones are not bound by the special-function unit
                if cutlass.const_expr(self.softcap and not masked and c % 4 >= 4 - EXP2_FMA_OF_4):
                    p = exp2_fma(x)
                else:
                    p = cute.math.exp2(x, fastmath=True)
                s_mn[r, c] = p
                part[c % ACC] = part[c % ACC] + p
            total = pairwise(part, lambda x, y: x + y)
            ts.row_sum[r] = ts.row_sum[r] * corr + total
            ts.corr[r] = corr

    @cute.jit
    def first_tile(self, kv_cons, nf: Int32, ts):
        """Entry 0 of the kv list: S = Q K^T, (mask when it is PARTIAL,) softmax, P into
        ``ts.rP``. O is still zero: no rescale."""
        kh = kv_cons.wait_and_advance()
        acc_s = ts.acc_s
        warpgroup.fence()
        self.qk_gemm(ts, acc_s, kh.index)
        warpgroup.commit_group()
        seen0, seen1 = Uint32(0), Uint32(0)
        if nf == 0:  # PARTIAL: its mask is read while the S GEMM runs
            seen0, seen1 = self.mask_seen(Int32(0), ts)
        warpgroup.wait_group(0)
        col0 = self.tile_col0(kh, ts)
        kh.release()
        if nf > 0:
            self.softmax(False, acc_s, None, ts, col0)
        else:
            self.softmax(True, acc_s, (seen0, seen1), ts, col0)
        # P as the A operand of the PV wgmma (16-bit: same element order as the accumulator)
        ts.rP.store(acc_s.load().to(self.dtype))
        return kv_cons

    @cute.jit
    def kv_steps(self, masked: cutlass.Constexpr, start: Int32, stop: Int32, kv_cons, ts):
        """Entries ``[start, stop)`` (``start >= 1``) of the q-tile's kv list, each overlapped
        with the PV GEMM of the entry before it. ``masked`` (a compile-time flag): the PARTIAL
        entries.

        Per entry ``i``: wait for V_{i-1} then K_i (the ring holds them in that order); issue
        S_i = Q K_i^T and O += P_{i-1} V_{i-1} (two wgmma groups); on PARTIAL entries read the
        tile's mask into the rows' ``seen`` words while both GEMMs run (global loads, off the
        softmax's critical path); wait for the first group only and release K_i; mask and
        softmax S_i while the PV GEMM runs; wait for it and
        release V_{i-1}; only then rescale O (its registers are the PV accumulator) and
        overwrite ``ts.rP`` with P_i (they were the PV operand)."""
        D = self.head_dim
        o_mn = cute.make_tensor(ts.acc_o.iterator, self.mn_layout(D))
        for i in cutlass.range(start, stop, unroll=1):
            vh = kv_cons.wait_and_advance()
            kh = kv_cons.wait_and_advance()
            acc_s = ts.acc_s
            # ping-pong: wait for the other warpgroup to have issued its GEMMs, issue ours,
            # let it go (its softmax then runs while our GEMMs do, and vice versa)
            cute.arch.barrier(barrier_id=SCHED_BARRIER + ts.cw, number_of_threads=2 * WG_THREADS)
            warpgroup.fence()
            self.qk_gemm(ts, acc_s, kh.index)
            warpgroup.commit_group()
            self.pv_gemm(ts, vh.index)
            warpgroup.commit_group()
            cute.arch.barrier_arrive(
                barrier_id=SCHED_BARRIER + 1 - ts.cw, number_of_threads=2 * WG_THREADS
            )
            seen = None
            if cutlass.const_expr(masked):  # the mask's loads do not wait for S
                seen = self.mask_seen(i, ts)
            warpgroup.wait_group(1)
            col0 = self.tile_col0(kh, ts)
            kh.release()
            self.softmax(masked, acc_s, seen, ts, col0)
            warpgroup.wait_group(0)
            vh.release()
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(D // 4):
                    o_mn[r, c] = o_mn[r, c] * ts.corr[r]
            ts.rP.store(acc_s.load().to(self.dtype))
        return kv_cons

    @cute.jit
    def last_pv(self, kv_cons, ts):
        """O += P V of the last entry of the kv list."""
        vh = kv_cons.wait_and_advance()
        warpgroup.fence()
        self.pv_gemm(ts, vh.index)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        vh.release()
        return kv_cons

    @staticmethod
    def mn_layout(n: int):
        """(row, col) view of a 64 x n wgmma accumulator ``((2, 2, n/8), 1, 1)``: row ``r``
        in {0, 1} is ``lane // 4 + 8 r``; col ``c`` is ``8 (c // 2) + 2 (lane % 4) + c % 2``."""
        return cute.make_layout((2, (2, n // 8)), stride=(2, (1, 4)))

    @staticmethod
    def a_layout(n: int):
        """The accumulator's registers as the wgmma A operand ``((2, 2, 2), 1, n/16)``."""
        return cute.make_layout(((2, 2, 2), 1, n // 16), stride=((1, 2, 4), 0, 8))

    @cute.jit
    def tile_col0(self, kh, ts):
        """The ALiBi kernel: the thread's first key column in the tile whose K stage ``kh``
        holds (``kt * N + 2 (lane % 4)``, ``kt`` from ``kv_tile``, read before the stage is
        released); None in the other kernels."""
        col0 = None
        if cutlass.const_expr(self.alibi):
            col0 = ts.kv_tile[kh.index] * self.block_n + 2 * (ts.lane % 4)
        return col0

    @cute.jit
    def mask_seen(self, i: Int32, ts):
        """The two ``seen`` words (one per row of the thread) of entry ``i`` of the q-tile's
        kv list: bit ``c`` says the thread's column ``c`` of the row is visible. One load of
        the entry's page index (``tiles`` column 1), then one of the thread's word of that
        page (:func:`page_seen`). Reads no S: issued before the S GEMM's wait."""
        return page_seen(ts.pages, ts.tiles[ts.list0 + i, 1], ts.thread)

    @cute.jit
    def epilogue(
        self, acc_o, row_max, row_sum, scale_log2, pv_mma, tma_o, tO, sO, mLSE, b, hq, qt, cw,
        row0, q_len, wtid, lane,
    ):  # fmt: skip
        """out = O / sum (0 where the sum is 0), lse = ln(sum) + max * scale (-inf there).

        O goes registers -> shared memory (``stmatrix``, this warpgroup's tile ``sO[.., cw]``)
        -> global memory (one TMA store issued by the warpgroup's first warp; rows past
        ``q_len`` are clipped by the TMA unit). The first warp waits for its previous store to
        have read the tile before the warpgroup barrier that opens the next write of it."""
        D = self.head_dim
        o_mn = cute.make_tensor(acc_o.iterator, self.mn_layout(D))
        for r in cutlass.range_constexpr(2):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            inv = Float32(0.0)
            lse = -Float32.inf
            if total > 0.0:
                inv = 1.0 / total
                lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
            for c in cutlass.range_constexpr(D // 4):
                o_mn[r, c] = o_mn[r, c] * inv
            row = row0 + 8 * r
            if row < q_len and lane % 4 == 0:
                mLSE[row, hq, b] = lse
        rO = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        rO.store(acc_o.load().to(self.dtype))
        warp_in_wg = wtid // 32
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=EPI_BARRIER + cw, number_of_threads=WG_THREADS)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        st_thr = cute.make_tiled_copy_C(st_atom, pv_mma).get_slice(wtid)
        cute.copy(st_atom, st_thr.retile(rO), st_thr.partition_D(sO[None, None, cw]))
        cute.arch.fence_view_async_shared()  # the smem writes, visible to the TMA unit
        cute.arch.barrier(barrier_id=EPI_BARRIER + cw, number_of_threads=WG_THREADS)
        if warp_in_wg == 0:
            gO = cute.local_tile(tO[None, None, hq, b], (ROWS_PER_WG, D), (None, 0))
            tOs, tOg = cpasync.tma_partition(
                tma_o, 0, cute.make_layout(1),
                cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2),
            )  # fmt: skip
            cute.copy(tma_o, tOs[None, cw], tOg[None, qt * 2 + cw])
            cute.arch.cp_async_bulk_commit_group()
