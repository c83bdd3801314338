"""CUDA backend: the numpy backend's interface on hand-written NVRTC kernels and CUDA graphs.

Weights stay on the device in their stored dtype (bf16, fp16 or fp32); activations, the
KV cache and every sum are fp32. Everything is allocated, compiled and captured in the
constructor (the node's configure): one CUDA graph for a decode step and one per prefill
bucket (up to 16, 32, 64, 128 tokens; longer prompts run in chunks). The call's token,
start position and length live in a small device ``state`` array, so a tick replays
graphs and allocates nothing on the device. No cuBLAS, no torch.
"""

from dataclasses import dataclass
import functools
from types import SimpleNamespace
from typing import Optional

import numpy as np

from rt_llm_node.backends import BackendError
from rt_llm_node.backends import check_capacity
from rt_llm_node.backends import check_kv_dtype
from rt_llm_node.backends import compact_slots
from rt_llm_node.backends import DECODE_STEPS
from rt_llm_node.backends import kv_slot_count
from rt_llm_node.backends import kv_slot_range
from rt_llm_node.backends import rollback_length
from rt_llm_node.backends import token_ids
from rt_llm_node.backends.cuda_kernels import ATT_MAX_SPLITS
from rt_llm_node.backends.cuda_kernels import CooperativeLauncher
from rt_llm_node.backends.cuda_kernels import DependentLauncher
from rt_llm_node.backends.cuda_kernels import GEOMETRY
from rt_llm_node.backends.cuda_kernels import KernelSet
from rt_llm_node.backends.cuda_kernels import MV_BATCH
from rt_llm_node.backends.numpy_backend import rope_tables
from rt_llm_node.model.quant import concat_rows

PREFILL_BUCKETS = (16, 32, 64, 128)
ARGMAX_BLOCKS = 64
STATE_RING = 64         # pinned upload slots for the run state
IDS_RING = 4            # and for prefill token ids
# state slots (the kernels get the same numbers from the loader's table)
FLAGS = GEOMETRY['STATE_FLAGS']
STATE_WORDS = 8


NULL = np.uint64(0)  # a null device pointer argument
MATMUL_WARPS = 4     # warps per block of the matmul kernels
# block sizes of the one-token quantized matmuls (qmatmul.cu, at most QMV_MAX_THREADS), the
# largest first: a matrix takes the largest whose grid covers at least QMV_FILL of the SMs.
# Large blocks stage the input vector in shared memory once an SM, not once a small block;
# a small matrix in large blocks leaves SMs idle, and a one-token matmul is bound by how
# many SMs stream (on the H200, SmolLM2's qkv in blocks of 512 ran on 30 SMs of 132).
QMV_THREADS = (512, 256, 128)
QMV_FILL = 0.5
QMV_DEEP_CPL = GEOMETRY['QMV_DEEP_CPL']   # the two-deep kernels' most chunks a lane a unit
# Scales and offsets that are all fp16 values exactly (Q8_0, Q4_0, Q4_1, on-load int8/int4)
# stored as fp16 (the _h kernels) or fp32. None: by the GPU. An integrated GPU (Jetson) shares
# the host's memory and its decode step is bound by the bytes it reads, so it takes the 17%
# fewer bytes of a u4 matrix; on discrete GPUs fp32 ones ran as fast or faster (H100 and H200,
# benchmarks/RESULTS.md). 0 or 1 forces one (sweeps).
HALF_SCALES = None
T16_UNITS = GEOMETRY['T16_UNITS']      # units (row pairs) of a 16-token prefill tile's block
T16_TOKENS = GEOMETRY['T16_TOKENS']
T16_MAX_WARPS = GEOMETRY['T16_MAX_WARPS']   # and at most this many warps (its launch bounds)
T16_WARPS_SM = 8     # a prefill tile grid's warps a multiprocessor that t16_warps aims at
T16_MIN_CHUNKS = 1   # and the 32-column chunks each warp keeps at least
VERIFY_NT = GEOMETRY['VERIFY_NT']      # tokens a block of the verify rows' float matmuls
ATT_QTILE, ATT_PQ = GEOMETRY['ATT_QTILE'], GEOMETRY['ATT_PQ']   # attn_partial's queries
ATT_THREADS, MASS_KEYS = GEOMETRY['ATT_THREADS'], GEOMETRY['MASS_KEYS']
PD_THREADS, PD_KEYS = GEOMETRY['PD_THREADS'], GEOMETRY['PD_KEYS']   # decode_persistent
PD_MAX_SHARED = 40 * 1024        # its dynamic shared memory: the largest input vector
# the staged one-token matmuls (matmul.cu, staged_body): a block's rows, norm and xhat in
# at most this much dynamic shared memory, so that the next kernel's blocks fit beside it;
# one or two blocks an SM, else the matrix stays on the streaming _t1 kernel
SP_THREADS, SP_MAX_SHARED, SP_MAX_BLOCKS_PER_SM = GEOMETRY['SP_THREADS'], 96 * 1024, 2
MAX_DYNAMIC_SHARED = 8           # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cuda.h
# the prefill's attn_partial: at most this many blocks beyond one a query tile (each tile's
# block then loops over its splits), so that a prefill near the start of the cache does
# not launch a block for every empty split of the whole capacity
ATT_PREFILL_BLOCKS = 2048
# attn_mass: warps a block (a warp sums every w-th row): a prefill's many rows, or the
# decode step's (a verify row repeats the decode step's sums, so the two agree)
MASS_WARPS_PREFILL, MASS_WARPS_DECODE = 32, 8
# a verify block's staged xhat (matmul.cu, matvec_body with NT > 1): its tokens' K floats in
# at most this much dynamic shared memory, so that three blocks of 128 threads still fit an
# SM; a block whose tokens' rows need more reads x from global memory as before
TV_MAX_SHARED = 72 * 1024
# the most tokens a verify pass takes (speculative_tokens' largest value and the token before)
VERIFY_MAX = 17
# decode_step='auto': decode-graph replays timed per candidate at configure, and the
# margin by which decode_persistent must beat the kernel step to be kept
TUNE_REPEATS, TUNE_CONTEXT, TUNE_MARGIN = 30, 256, 0.03


@dataclass(frozen=True)
class CudaOptions:
    """How the CUDA backend runs a forward; fixed when the backend is built.

    ``decode_step``: 'kernels' (a kernel per phase: five a layer), 'persistent' (the whole
    step as one cooperative launch, ``decode_persistent``; an error where the model's shape
    or the device cannot run it) or 'auto' (time both at construction, keep the persistent
    step only where it is at least TUNE_MARGIN faster). ``dependent_launch``: launch each
    kernel with programmatic dependent launch so it loads its weights while the previous one
    finishes (None: where the device has it, compute capability 9.0 and later).
    ``staged_decode``: run a decode step's matmuls as the ``*_sp`` kernels, which copy their
    rows into shared memory before waiting for the previous kernel (None: where dependent
    launch is on and all four of a layer's matmuls fit; True raises without dependent
    launch). ``device_id``: the CUDA device. ``kv_dtype``: the cache's ('native': fp32;
    'int8': codes with a scale per token and kv head, KV_DTYPES). ``verify_tokens``: the
    most tokens one speculative verify pass takes (a graph is captured for each count up to
    it; 0: no verify). A verify row runs the one-token kernels of a decode step (one row of
    blocks a token), so with verify on a decode step is 'kernels', unstaged: the step whose
    sums a verify row repeats bit for bit ('auto' and None resolve to it; 'persistent' or
    staged_decode True are an error). ``dataflow_lists``: with decode_step 'persistent', run
    the step's phases as that many per-block task lists instead (``decode_dataflow``, the
    plan of dataflow_plan.py; no grid-wide barrier; the same sums bit for bit); fewer lists
    than multiprocessors give a small device's latency structure on a large one. 0: off.
    Tests and benchmarks set it; the node's decode steps do not include it.
    """

    decode_step: str = 'auto'
    dependent_launch: Optional[bool] = None
    staged_decode: Optional[bool] = None
    device_id: int = 0
    kv_dtype: str = 'native'
    verify_tokens: int = 0
    dataflow_lists: int = 0

    def __post_init__(self):
        check_kv_dtype(self.kv_dtype)
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f'unknown decode step {self.decode_step!r} '
                             f'(choose from {", ".join(DECODE_STEPS)})')
        for name in ('dependent_launch', 'staged_decode'):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f'{name} must be None, True or False')
        if not 0 <= self.verify_tokens <= VERIFY_MAX:
            raise ValueError(f'verify_tokens must be 0 .. {VERIFY_MAX}, '
                             f'not {self.verify_tokens}')
        if self.dataflow_lists and (self.decode_step != 'persistent'
                                    or not 0 < self.dataflow_lists <= 4096):
            raise ValueError("dataflow_lists runs the persistent step's phases as task lists: "
                             "it needs decode_step 'persistent' and 1 .. 4096 lists")
        if self.verify_tokens and (self.decode_step == 'persistent' or self.staged_decode):
            raise ValueError('a verify pass repeats the per-kernel, unstaged decode step bit '
                             "for bit: verify_tokens needs decode_step 'kernels' or 'auto' "
                             'and staged_decode None or False')


def t16_warps(k, blocks, n_sm):
    """Warps of a prefill tile's block (tile16_body) for rows of K = k in a grid of ``blocks``.

    They split K in 32-column chunks: doubled from 4 (up to T16_MAX_WARPS) while the grid
    has fewer than T16_WARPS_SM warps a multiprocessor and each warp keeps at least
    T16_MIN_CHUNKS chunks. A grid of many blocks hides latency with its blocks (short ones
    end and others start while a block sums its share); one of few, with the warps that
    share each block's K. Measured on the H200 (docs/architecture.md, "Prefill").
    """
    chunks, warps = -(-k // 32), 4
    while (warps < T16_MAX_WARPS and blocks * warps < T16_WARPS_SM * n_sm
           and chunks >= T16_MIN_CHUNKS * 2 * warps):
        warps *= 2
    return warps


def attn_partial_shared(chunk, d):
    """Bytes of dynamic shared memory of an attn_partial block (attention.cu)."""
    return 4 * (chunk * (2 * d + 1) + ATT_QTILE * d + chunk * ATT_PQ + 2 * ATT_QTILE)


def staged_plan(units, k, weight_bytes, n_sm):
    """Plan a staged one-token matmul, or return None where it does not fit.

    (blocks, units a block, dynamic shared bytes) of a staged one-token matmul over ``units`` row
    pairs of length ``k``, or None where it does not fit (then the _t1 kernel streams it): the
    fewest blocks, n_sm or 2 n_sm, whose rows fit SP_MAX_SHARED.
    """
    if k % 8:
        return None
    for per_sm in range(1, SP_MAX_BLOCKS_PER_SM + 1):
        blocks = min(units, per_sm * n_sm)
        per_block = -(-units // blocks)
        shared = (2 * per_block + 1) * k * weight_bytes + 4 * k
        if shared <= SP_MAX_SHARED:
            return -(-units // per_block), per_block, shared
    return None


def tv_shared(tokens, k):
    """Return the dynamic shared memory of a verify matmul block of ``tokens`` over K = ``k``.

    Its staged xhat, or 0 (read from global memory) where the rows are not 16-byte chunks or
    it would not fit.
    """
    need = 4 * tokens * k
    return need if k % 8 == 0 and need <= TV_MAX_SHARED else 0


def matvec_split(units, k, mv_batch, n_sm, warps=MATMUL_WARPS):
    """Warps that share one unit (row pair) of a one-token matmul: 1, 2 or 4.

    Doubles while a warp's share of K is still a whole warp's width of 8-weight chunks and
    either a lane would need more than one batch of loads (only the first is in flight
    before the kernel waits for its predecessor) or the grid would not cover every SM.
    """
    chunks = k // 8 if k % 8 == 0 else k
    split = 1
    while (split < warps and chunks // (2 * split) >= 32
           and (-(-chunks // split) > 32 * mv_batch
                or -(-units * split // warps) < n_sm)):
        split *= 2
    return split


def qmatvec_plan(units, chunks, n_sm, resident, threads):
    """(grid, split) of a one-token quantized matmul (qmatmul.cu) over ``units`` row pairs.

    ``chunks``: 16-byte chunks a row (K / 16 for i8, K / 32 for u4); ``resident``: blocks
    of ``threads`` an SM. A unit's chunks go to 1, 2 or 4 warps: doubled while every warp
    keeps at least a chunk a lane and the warps still fit what is resident at once (so
    every SM streams, not a few warps of it); the grid is whole blocks of ``threads``
    covering units * split warps, at most what is resident.
    """
    warps = threads // 32
    capacity = warps * max(1, resident) * n_sm
    split = 1
    while split < 4 and chunks // (2 * split) >= 32 and units * 2 * split <= capacity:
        split *= 2
    blocks = -(-units * split // warps)
    return min(blocks, max(1, resident) * n_sm), split


def qmatvec_geometry(units, chunks, n_sm, resident):
    """Return (grid, split, threads) of a one-token quantized matmul.

    ``qmatvec_plan`` in the largest block size of QMV_THREADS whose grid covers QMV_FILL of
    the ``n_sm`` SMs (else the smallest); ``resident(threads)``: blocks of that size an SM holds.
    """
    for threads in QMV_THREADS:
        blocks, split = qmatvec_plan(units, chunks, n_sm, resident(threads), threads)
        if blocks >= QMV_FILL * n_sm:
            break
    return blocks, split, threads


def qmatvec_launch(name, units, chunks, n_sm, resident):
    """Return (kernel, grid, split, threads) of a one-token quantized matmul ``name``.

    ``qmatvec_geometry`` of ``name``, or of its two-deep twin (``name``_d2, two units of a
    warp in flight) where that plan leaves a warp more than one unit, each at most
    QMV_DEEP_CPL chunks a lane: there one unit alone would keep too few bytes in flight
    between waits. ``resident(kernel, threads)``: blocks of that size an SM holds.
    """
    def plan(kernel):
        return qmatvec_geometry(units, chunks, n_sm, lambda threads: resident(kernel, threads))

    deep = name + '_d2'
    blocks, split, threads = plan(deep)
    per_lane = -(-(chunks // split) // 32)
    if per_lane <= QMV_DEEP_CPL and units * split > blocks * (threads // 32):
        return deep, blocks, split, threads
    return (name, *plan(name))


def _device_errors():
    """Return the exception types of a failing CUDA call (driver, runtime, out of memory)."""
    from cupy.cuda.memory import OutOfMemoryError
    from cupy_backends.cuda.api.driver import CUDADriverError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    return (CUDADriverError, CUDARuntimeError, OutOfMemoryError)


def reports_device_errors(method):
    """Turn a CUDA fault inside ``method`` into a BackendError (the engine refuses on it)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except _device_errors() as exc:
            raise BackendError(f'CUDA error in {method.__name__}: {exc}') from exc
    return wrapper


def _i32(value):
    return np.int32(value)


def stores_half_scales():
    """Whether DeviceQuant keeps fp16-exact scales and offsets in fp16 (HALF_SCALES)."""
    if HALF_SCALES is not None:
        return bool(HALF_SCALES)
    import cupy as cp
    return bool(cp.cuda.Device().attributes.get('Integrated', 0))


def fits_half(values):
    """Whether every value of an fp32 array is an fp16 exactly (so fp16 storage loses nothing)."""
    with np.errstate(over='ignore'):   # past fp16's range: inf, which compares unequal
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


class DeviceQuant:
    """A matrix in a runtime integer format (model/quant.py) on the device.

    Scales and offsets go to the device as fp16 where ``half`` (default: stores_half_scales())
    and every one of them is an fp16 exactly (GGUF Q8_0, Q4_0 and Q4_1, and the on-load int8
    and int4 formats, store such scales), else as fp32: the kernels read the same fp32 values
    either way, and fp16 ones take half the bytes (a sixth of a u4 matrix's).
    """

    def __init__(self, cp, tensor, half=None):
        self.fmt = tensor.fmt                  # 'i8' or 'u4'
        self.rows, self.k = tensor.shape
        self.gshift = np.int32(int(tensor.group).bit_length() - 1)
        scales, offsets = tensor.scales, tensor.offsets
        exact = fits_half(scales) and (offsets is None or fits_half(offsets))
        half = (stores_half_scales() if half is None else half) and exact
        store = np.float16 if half else np.float32
        self.suffix = self.fmt + ('h' if half else '')   # the kernels' name suffix
        self.codes = cp.asarray(tensor.codes.view(np.uint8))
        self.scales = cp.asarray(scales.astype(store))
        self.offsets = None if offsets is None else cp.asarray(offsets.astype(store))
        self.nbytes = int(self.codes.nbytes + self.scales.nbytes
                          + (0 if self.offsets is None else self.offsets.nbytes))
        # the bytes with fp16-exact scales and offsets in fp16 (what an integrated GPU reads)
        self.half_nbytes = self.nbytes if half or not exact else int(
            self.codes.nbytes + (self.nbytes - self.codes.nbytes) // 2)
        self.chunk_cols = 16 if self.fmt == 'i8' else 32   # columns of a 16-byte load
        if tensor.group < self.chunk_cols:
            raise BackendError(f'the {self.fmt} kernels need groups of at least '
                               f'{self.chunk_cols} columns, not {tensor.group}')

    def args(self):
        """(codes, scales, offsets, gshift): the kernels' first weight arguments."""
        return self.codes, self.scales, NULL if self.offsets is None else self.offsets, \
            self.gshift


def upload(cp, tensors, quantized):
    """Put tensors (one, or several fused by rows) on the device.

    Float tensors as stored, or as fp32 values where the model also has quantized ones (its
    kernels are then built for fp32 floats); quantized ones as a DeviceQuant.
    """
    if all(t.dtype == 'QUANT' for t in tensors):
        return DeviceQuant(cp, tensors[0] if len(tensors) == 1 else concat_rows(tensors))
    if any(t.dtype == 'QUANT' for t in tensors):
        raise BackendError('a fused projection mixes quantized and float matrices')
    if quantized:
        return cp.asarray(np.concatenate([t.to_float32() for t in tensors]))
    return cp.asarray(np.concatenate([t.bits.reshape(t.shape) for t in tensors]))


class LayerBuffers:
    """One decoder layer's weights on the device, projections fused as in the numpy backend."""

    def __init__(self, cp, checkpoint, index, quantized=False):
        p = f'model.layers.{index}.'
        t = checkpoint.tensors
        cfg = checkpoint.config

        def up(*names):
            return upload(cp, [t[p + n] for n in names], quantized)
        self.attn_norm = up('input_layernorm.weight')                         # [hidden]
        self.mlp_norm = up('post_attention_layernorm.weight')                 # [hidden]
        self.wqkv = up('self_attn.q_proj.weight', 'self_attn.k_proj.weight',
                       'self_attn.v_proj.weight')                             # [q+2kv, hidden]
        self.bqkv = (up('self_attn.q_proj.bias', 'self_attn.k_proj.bias',
                        'self_attn.v_proj.bias') if cfg.attention_bias else None)  # [q+2kv]
        self.wo = up('self_attn.o_proj.weight')                               # [hidden, q]
        self.wgate_up = up('mlp.gate_proj.weight', 'mlp.up_proj.weight')     # [2*inter, hidden]
        self.wdown = up('mlp.down_proj.weight')                               # [hidden, inter]


class CudaBackend:
    """Decoder on the GPU with a preallocated KV cache (see ``rt_llm_node.backends``)."""

    name = 'cuda'

    def __init__(self, checkpoint, capacity, options=None):
        """Build the backend: upload, allocate, compile and capture.

        Upload ``checkpoint``, allocate a ``capacity``-token cache, compile, capture the graphs and
        (decode_step 'auto') pick the decode step: see ``CudaOptions``.
        """
        import cupy as cp
        self.cp = cp
        self.options = options = options or CudaOptions()
        cfg = checkpoint.config
        check_capacity(capacity, cfg)
        if (cfg.head_dim % 4 or cfg.head_dim > 256 or cfg.num_heads % cfg.num_kv_heads
                or cfg.num_heads > 64):
            raise BackendError(f'the CUDA kernels need head_dim a multiple of 4, <= 256, '
                               'at most 64 heads and whole GQA '
                               f'groups (head_dim {cfg.head_dim}, heads {cfg.num_heads}, '
                               f'kv heads {cfg.num_kv_heads})')
        dtypes = {t.dtype for t in checkpoint.tensors.values()}
        self.quantized = 'QUANT' in dtypes
        if self.quantized:   # floats (norms, biases, unquantized matrices) as fp32
            dtypes = {'F32'}
        if len(dtypes) != 1:
            raise BackendError(f'the CUDA backend needs one weight dtype, found {sorted(dtypes)}')
        self.config = cfg
        self.capacity = int(capacity)
        self.weight_dtype = dtypes.pop()
        self.kv_dtype = options.kv_dtype
        self.kv_int8 = options.kv_dtype == 'int8'
        self.verify_tokens = options.verify_tokens
        self.device = cp.cuda.Device(options.device_id)
        self.n_sm = self.device.attributes['MultiProcessorCount']
        with self.device:
            self._allocate(checkpoint)
            self.kernels = KernelSet(self.weight_dtype, options.device_id,
                                     kv_int8=self.kv_int8)
            if self.att_smem > 48 * 1024:
                from cupy_backends.cuda.api import driver
                driver.funcSetAttribute(self.kernels.functions['attn_partial'].ptr,
                                        MAX_DYNAMIC_SHARED, self.att_smem)
            if self.quantized:
                self._allow_quant_shared()
            if self.verify_tokens:   # a verify block's staged xhat (tv_shared)
                from cupy_backends.cuda.api import driver
                for name in ('matmul_qkv_rope_tv', 'matmul_residual_tv', 'matmul_swiglu_tv',
                             'matmul_store_tv'):
                    driver.funcSetAttribute(self.kernels.functions[name].ptr,
                                            MAX_DYNAMIC_SHARED, TV_MAX_SHARED)
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._queue = self.stream   # where _launch enqueues
            if self.verify_tokens:      # a fused pass's verify rows, and its fork and joins
                self.side_stream = cp.cuda.Stream(non_blocking=True)
                event = functools.partial(cp.cuda.Event, disable_timing=True)
                self._fused_events = (event(), event(), [event() for _ in range(cfg.num_layers)])
            self._resident = {}
            self._choose_launch(options.dependent_launch)
            verify = self.verify_tokens > 0
            self._staged = self._check_staged(False if verify else options.staged_decode)
            self._pd_args = self._df_args = None
            if options.decode_step == 'persistent':
                self._prepare_persistent()
            if options.dataflow_lists:
                self._prepare_dataflow(options.dataflow_lists)
            self._warm_up_and_capture()
            self.decode_tuning = (self._tune_decode()
                                  if options.decode_step == 'auto' and not verify else None)

    def _tune_decode(self):
        """Time both decode steps and keep the faster.

        decode_step 'auto': the decode graph's GPU time (median us of TUNE_REPEATS replays at
        TUNE_CONTEXT cached slots, CUDA events) as a kernel a phase and as decode_persistent, where
        it can run; keeps the faster, decode_persistent only by TUNE_MARGIN. Returns {'kernels':
        us, 'persistent': us or None, 'chosen': name}.
        """
        times = {'kernels': self._time_decode_graph(), 'persistent': None}
        if self.persistent_decode_problem() is None:
            self._prepare_persistent()
            self._recapture_decode()
            times['persistent'] = self._time_decode_graph()
            if times['persistent'] > (1 - TUNE_MARGIN) * times['kernels']:
                self.stream.synchronize()
                self._pd_args = None
                self._recapture_decode()
        times['chosen'] = self.decode_step
        return times

    def _recapture_decode(self):
        """Capture the decode graph again (construction only: the step was just chosen)."""
        self._write_state(token=0, start=0, n=1, mass_acc=0)
        self._enqueue_forward(1)
        self.stream.synchronize()
        self.graphs[1] = self._capture(1)

    def _time_decode_graph(self):
        """Time the decode graph's replay on the device.

        Median GPU us of a decode-graph replay at min(TUNE_CONTEXT, capacity - 1) cached slots
        (their contents do not change the work); leaves the cache empty.
        """
        cp = self.cp
        length = min(TUNE_CONTEXT, self.capacity - 1)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        with self.device:
            for i in range(TUNE_REPEATS + 3):   # the first three warm the caches
                self._write_state(token=0, start=length, n=1, mass_acc=0)
                start.record(self.stream)
                self.graphs[1].launch(self.stream)
                stop.record(self.stream)
                stop.synchronize()
                if i >= 3:
                    times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
            self.k.fill(0)
            self.v.fill(0)
            self.device.synchronize()
        self.length = 0
        self._logits_valid = False
        return float(np.median(times))

    @property
    def dependent_launch(self):
        """Whether the forward's kernels run with programmatic dependent launch."""
        return self._dependent is not None

    def _choose_launch(self, enabled):
        """Decide the launch mode, in this one place.

        None: dependent where the device has it. Below sm_90 the kernels' griddepcontrol waits
        compile to nothing, so asking for it there is an error, not a race.
        """
        if enabled is None:
            enabled = self.kernels.arch >= 90
        if enabled and self.kernels.arch < 90:
            raise BackendError('programmatic dependent launch needs compute capability 9.0, '
                               f'this device has {self.kernels.arch / 10:.1f}')
        self._dependent = DependentLauncher() if enabled else None

    def _resident_blocks(self, name, threads=32 * MATMUL_WARPS, shared=0):
        """Blocks of kernel ``name`` that fit on one multiprocessor at once (0: none does).

        Default geometry: a matmul's 128 threads, no dynamic shared memory.
        """
        key = (name, threads, shared)
        if key not in self._resident:
            from cupy_backends.cuda.api import driver
            self._resident[key] = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                self.kernels.functions[name].ptr, threads, shared)
        return self._resident[key]

    def _weight_arrays(self, per_token):
        """List the weight buffers on the device (``per_token``: those a decode reads whole)."""
        arrays = [self.final_norm, self.lm_head]
        if not per_token:
            arrays.append(self.embed)
        for layer in self.layers:
            arrays += [layer.attn_norm, layer.mlp_norm, layer.wqkv, layer.bqkv, layer.wo,
                       layer.wgate_up, layer.wdown]
        unique = {id(a): a for a in arrays if a is not None}
        return list(unique.values())

    def kv_bytes_per_token(self):
        """Cache bytes one token takes over every layer (keys, values, their scales)."""
        arrays = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.kv_int8 else [])
        return int(sum(a[:, 0].nbytes for a in arrays))

    def weight_bytes(self):
        """Device bytes of the weights (codes, scales and offsets of quantized ones)."""
        return int(sum(a.nbytes for a in self._weight_arrays(per_token=False)))

    def bytes_per_token(self, half_scales=False):
        """Weight bytes one decode step reads.

        Every matrix but the embedding, of which it reads a row (the LM head, tied or not, is
        read whole). ``half_scales``: as if fp16-exact scales and offsets were stored in fp16
        (stores_half_scales on an integrated GPU).
        """
        row = self.embed.nbytes // self.config.vocab_size
        return int(sum(getattr(a, 'half_nbytes', a.nbytes) if half_scales else a.nbytes
                       for a in self._weight_arrays(per_token=True)) + row)

    def scale_storage(self):
        """How the quantized matrices' scales are stored: 'fp16', 'fp32', 'fp16+fp32' or '-'."""
        kinds = sorted({'fp16' if a.suffix.endswith('h') else 'fp32'
                        for a in self._weight_arrays(per_token=False) if hasattr(a, 'suffix')})
        return '+'.join(kinds) or '-'

    def _allow_quant_shared(self):
        """Let the one-token quantized kernels stage the widest input vector in shared memory."""
        cfg = self.config
        widest = max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
        need = 4 * (2 * widest + widest // 16)
        if need > 48 * 1024:
            from cupy_backends.cuda.api import driver
            for name, function in self.kernels.functions.items():
                if name.startswith('qmatvec_'):
                    driver.funcSetAttribute(function.ptr, MAX_DYNAMIC_SHARED, need)

    def _check_staged(self, wanted):
        if self.quantized:
            if wanted:
                raise BackendError('staged_decode reads float weights only (this model has '
                                   'quantized ones)')
            return False
        if wanted is None:
            wanted = self._dependent is not None and all(self.staged_matmuls().values())
        if not wanted:
            return False
        if self._dependent is None:
            raise BackendError('staged_decode needs programmatic dependent launch (compute '
                               'capability 9.0 and dependent_launch on)')
        from cupy_backends.cuda.api import driver
        for name in ('matmul_qkv_rope_sp', 'matmul_residual_sp', 'matmul_swiglu_sp'):
            driver.funcSetAttribute(self.kernels.functions[name].ptr, MAX_DYNAMIC_SHARED,
                                    SP_MAX_SHARED)
        return True

    @property
    def staged_decode(self):
        """Whether a decode step's matmuls that fit shared memory run staged (``*_sp``)."""
        return self._staged

    def staged_matmuls(self):
        """Return the staging plan of each matmul of a decode step.

        {matmul: (blocks, units a block, shared bytes) or None} of a decode step: which of a
        layer's matmuls run staged, whether or not staged_decode is on.
        """
        wbytes = 4 if self.weight_dtype == 'F32' else 2
        return {name: staged_plan(units, k, wbytes, self.n_sm)
                for name, (units, k) in self._layer_matmuls().items()}

    def _layer_matmuls(self):
        """Return the shape of each matmul of one layer.

        {matmul: (units, K)} of one layer: the row pairs (units) each kernel computes (a SwiGLU
        unit is one gate row and its up row) and the length of each row.
        """
        cfg = self.config
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        return {'qkv': ((cfg.q_size + 2 * cfg.kv_size) // 2, hid),
                'o': ((hid + 1) // 2, cfg.q_size), 'gate_up': (inter, hid),
                'down': ((hid + 1) // 2, inter)}

    def persistent_decode_problem(self):
        """Why decode_persistent cannot run this model here, or None when it can."""
        cfg = self.config
        if self.quantized:
            return 'it reads float weights only (this model has quantized ones)'
        if self.kv_int8:
            return 'it reads an fp32 KV cache only (kv_dtype is int8)'
        if cfg.head_dim not in (32, 64, 128):
            return f'head_dim {cfg.head_dim} is not 32, 64 or 128'
        widths = (cfg.hidden_size, cfg.q_size, cfg.intermediate_size)
        if any(w % 8 for w in widths):
            return f'hidden, q and intermediate sizes {widths} are not multiples of 8'
        if 4 * max(widths) > PD_MAX_SHARED:
            return (f'a {max(widths)}-wide input vector does not fit {PD_MAX_SHARED} B of '
                    'shared memory')
        if not self.device.attributes.get('CooperativeLaunch', 1):
            return 'the device has no cooperative launch'
        if self._resident_blocks('decode_persistent', PD_THREADS, self._pd_shared()) < 1:
            return 'decode_persistent does not fit on a multiprocessor'
        return None

    def _pd_shared(self):
        cfg = self.config
        return 4 * max(cfg.hidden_size, cfg.q_size, cfg.intermediate_size)

    @property
    def decode_step(self):
        """The decode step in use: 'dataflow' or 'persistent' (one launch) or 'kernels'."""
        if self._df_args is not None:
            return 'dataflow'
        return 'persistent' if self._pd_args is not None else 'kernels'

    def _prepare_dataflow(self, lists):
        """Plan decode_dataflow's task lists for ``lists`` blocks and pack its arguments."""
        from rt_llm_node.backends import dataflow_plan
        from rt_llm_node.backends import launch_args
        resident = self._resident_blocks('decode_dataflow', PD_THREADS, self._pd_shared())
        if resident < 1:
            raise BackendError('decode_dataflow does not fit on a multiprocessor')
        if lists > self.n_sm * resident:
            raise BackendError(f'{lists} task lists cannot all be resident on {self.n_sm} '
                               'multiprocessors')
        cp = self.cp
        plan = dataflow_plan.build(self.config, lists, self.capacity,
                                   weight_bytes=4.0 if self.weight_dtype == 'F32' else 2.0)
        queues = dataflow_plan.assign(plan, 'greedy')
        tasks = dataflow_plan.pack(plan, queues)
        self.dataflow_plan = (plan, queues)   # for dataflow_plan.dump when a step stalls
        self._df_tasks = cp.asarray(tasks)
        self._df_ready = cp.zeros(len(plan.ready) + 1, np.uint32)   # + the blocks out
        n_lm = sum(t.op == 'lm_head' for t in plan.tasks)
        packed = launch_args.pack(launch_args.DATAFLOW_ARGS, {
            'tasks': self._df_tasks.data.ptr, 'ready': self._df_ready.data.ptr,
            'max_len': tasks.shape[1], 'n_ready': len(plan.ready), 'n_lm': n_lm})
        self._df_args = cp.asarray(np.frombuffer(packed, np.uint8))
        self._df_lists = lists

    def _prepare_persistent(self):
        """Pack decode_persistent's arguments (the step then runs as one launch)."""
        problem = self.persistent_decode_problem()
        if problem:
            raise BackendError(f'persistent decode not possible: {problem}')
        from rt_llm_node.backends import launch_args
        cp, cfg, cap = self.cp, self.config, self.capacity
        ptr = lambda a: 0 if a is None else a.data.ptr   # noqa: E731
        layers = b''.join(launch_args.pack(launch_args.DECODE_LAYER, {
            'attn_norm': ptr(layer.attn_norm), 'wqkv': ptr(layer.wqkv), 'bqkv': ptr(layer.bqkv),
            'wo': ptr(layer.wo), 'mlp_norm': ptr(layer.mlp_norm),
            'wgate_up': ptr(layer.wgate_up), 'wdown': ptr(layer.wdown), 'k': ptr(self.k[i]),
            'v': ptr(self.v[i]), 'scores': ptr(self.scores_dec[i]), 'ml': ptr(self.ml_dec[i])})
            for i, layer in enumerate(self.layers))
        self._pd_layers = cp.asarray(np.frombuffer(layers, np.uint8))
        self._pd_bar = cp.zeros(2, np.uint32)   # grid_sync: arrivals, blocks out
        n_splits = -(-cap // PD_KEYS)
        assert self.part_ml.size >= cfg.num_heads * n_splits * 2
        assert self.part_o.size >= cfg.num_heads * n_splits * cfg.head_dim
        packed = launch_args.pack(launch_args.DECODE_ARGS, {
            'layers': ptr(self._pd_layers), 'embed': ptr(self.embed),
            'final_norm': ptr(self.final_norm), 'lm_head': ptr(self.lm_head),
            'cos_t': ptr(self.cos), 'sin_t': ptr(self.sin), 'x': ptr(self.x), 'q': ptr(self.q),
            'attn_out': ptr(self.attn_out), 'act': ptr(self.act), 'part_ml': ptr(self.part_ml),
            'part_o': ptr(self.part_o), 'logits': ptr(self.logits_buf), 'mass': ptr(self.mass),
            'counters': ptr(self.counters), 'bar': ptr(self._pd_bar),
            'hidden': cfg.hidden_size, 'inter': cfg.intermediate_size,
            'n_heads': cfg.num_heads, 'n_kv': cfg.num_kv_heads, 'head_dim': cfg.head_dim,
            'cap': cap, 'vocab': cfg.vocab_size, 'n_layers': cfg.num_layers,
            'n_splits': n_splits, 'eps': cfg.rms_norm_eps, 'scale': 1.0 / np.sqrt(cfg.head_dim)})
        self._pd_args = cp.asarray(np.frombuffer(packed, np.uint8))
        self._cooperative = CooperativeLauncher()

    # -- set-up (configure time) ---------------------------------------------------
    def _allocate(self, checkpoint):
        cp, cfg, cap = self.cp, self.config, self.capacity
        t = checkpoint.tensors

        def up(name):
            return upload(cp, [t[name]], self.quantized)
        self.embed = up('model.embed_tokens.weight')                          # [vocab, hidden]
        self.lm_head = self.embed if cfg.tie_word_embeddings else up('lm_head.weight')
        self.final_norm = up('model.norm.weight')                             # [hidden]
        self.layers = [LayerBuffers(cp, checkpoint, i, self.quantized)
                       for i in range(cfg.num_layers)]
        # prefill reads a quantized matrix dequantized into this, one matmul at a time
        sizes = [w.rows * w.k for layer in self.layers for w in
                 (layer.wqkv, layer.wo, layer.wgate_up, layer.wdown)
                 if isinstance(w, DeviceQuant)]
        self.dequantized = cp.zeros(max(sizes), np.float32) if sizes else None
        cos, sin = rope_tables(np.arange(-cap, cap), cfg.rope.inv_freq(cfg.head_dim))
        self.cos, self.sin = cp.asarray(cos), cp.asarray(sin)                 # [2*cap, d/2]
        shape = (cfg.num_layers, cap, cfg.num_kv_heads, cfg.head_dim)
        f32 = np.float32
        n_max = PREFILL_BUCKETS[-1]
        kv = np.int8 if self.kv_int8 else f32
        self.k, self.v = cp.zeros(shape, kv), cp.zeros(shape, kv)             # KV cache
        self.k_tmp, self.v_tmp = cp.zeros(shape, kv), cp.zeros(shape, kv)     # compaction
        if self.kv_int8:   # a scale per slot and kv head; the call's keys and values in fp32
            self.k_scale, self.v_scale, self.k_scale_tmp, self.v_scale_tmp = (
                cp.zeros(shape[:3], f32) for _ in range(4))
            stage = (n_max, cfg.num_kv_heads, cfg.head_dim)
            self.k_stage, self.v_stage = cp.zeros(stage, f32), cp.zeros(stage, f32)
        else:
            self.k_scale = self.v_scale = self.k_scale_tmp = self.v_scale_tmp = None
            self.k_stage = self.v_stage = None
        # keys per attention split: the split's keys and values fit 32 KiB of shared memory
        d = cfg.head_dim
        self.chunk = 64 if d <= 64 else 32 if d <= 128 else 16
        self.att_smem = attn_partial_shared(self.chunk, d)
        self.n_splits = (cap + self.chunk - 1) // self.chunk
        if self.n_splits > ATT_MAX_SPLITS:   # the merge keeps a weight per split in shared memory
            raise BackendError(f'kv capacity {cap} needs {self.n_splits} attention splits '
                               f'of {self.chunk}; the kernels take at most {ATT_MAX_SPLITS}')
        rows = max(1, self.verify_tokens)   # queries of an attn_decode launch
        self.counters = cp.zeros(rows * cfg.num_heads, np.int32)   # its splits done a head
        self.state = cp.zeros(STATE_WORDS, np.int32)
        self.ids = cp.zeros(n_max, np.int32)                                  # [n_max]
        self.x = cp.zeros((n_max, cfg.hidden_size), f32)                      # residual stream
        self.q = cp.zeros((n_max, cfg.q_size), f32)
        self.attn_out = cp.zeros((n_max, cfg.q_size), f32)
        self.act = cp.zeros((n_max, cfg.intermediate_size), f32)
        # attention scores, then probabilities: prefill reuses one layer's, decode keeps all
        self.scores = cp.zeros((cfg.num_heads, n_max, cap), f32)
        self.scores_dec = cp.zeros((cfg.num_layers, cfg.num_heads, cap), f32)  # raw scores
        self.ml_dec = cp.zeros((cfg.num_layers, cfg.num_heads, 2), f32)  # their softmax M, L
        self.part_ml = cp.zeros((cfg.num_heads * n_max, self.n_splits, 2), f32)
        self.part_o = cp.zeros((cfg.num_heads * n_max, self.n_splits, cfg.head_dim), f32)
        self.mass, self.mass_tmp = cp.zeros(cap, f32), cp.zeros(cap, f32)
        self.logits_buf = cp.zeros(cfg.vocab_size, f32)
        self.allowed = cp.zeros(cfg.vocab_size, np.int32)
        self.keep = cp.zeros(cap, np.int32)
        self.part_v = cp.zeros(ARGMAX_BLOCKS, f32)
        self.part_i = cp.zeros(ARGMAX_BLOCKS, np.int32)
        # pinned host buffers: uploads from a ring of slots, one stream sync per wrap
        self.state_ring = self._pinned((STATE_RING, STATE_WORDS), np.int32)
        self.ids_ring = self._pinned((IDS_RING, n_max), np.int32)
        self.rings = [0, 0]
        self.host_allowed = self._pinned(cfg.vocab_size, np.int32)
        self.host_keep = self._pinned(cap, np.int32)
        self.host_flags = self._pinned(2, np.int32)
        self.host_mass = self._pinned(cap, f32)
        self.host_logits = self._pinned(cfg.vocab_size, f32)
        # the buffers a forward runs on (_enqueue_forward's lane)
        self.lane = SimpleNamespace(state=self.state, ids=self.ids, x=self.x, q=self.q,
                                    attn_out=self.attn_out, act=self.act, part_ml=self.part_ml,
                                    part_o=self.part_o, counters=self.counters,
                                    k_stage=self.k_stage, v_stage=self.v_stage)
        self._allocate_verify()
        self.length = 0
        self._logits_valid = False

    def _allocate_verify(self):
        """Buffers of the verify pass: each row's logits, scores, softmax sums, mass, argmax.

        A row more than a pass takes: a fused pass (``prefill_verify``) keeps its prefill's
        last token in row 0 and its verify rows after it. And the side lane, the activations,
        run state and ids of a fused pass's verify rows, which run beside its prefill.
        """
        cp, cfg, cap = self.cp, self.config, self.capacity
        self._rows = None      # the last verify's (start, rows kept) while its rows count
        self._row = None       # the row whose logits and mass are current (else the buffers)
        self.verify_rows = rows = self.verify_tokens + 1 if self.verify_tokens else 0
        if not rows:
            return
        f32, i32 = np.float32, np.int32
        k = self.verify_tokens
        self.side_lane = SimpleNamespace(
            state=cp.zeros(STATE_WORDS, i32), ids=cp.zeros(k, i32),
            x=cp.zeros((k, cfg.hidden_size), f32), q=cp.zeros((k, cfg.q_size), f32),
            attn_out=cp.zeros((k, cfg.q_size), f32),
            act=cp.zeros((k, cfg.intermediate_size), f32),
            part_ml=cp.zeros((cfg.num_heads * k, self.n_splits, 2), f32),
            part_o=cp.zeros((cfg.num_heads * k, self.n_splits, cfg.head_dim), f32),
            counters=cp.zeros(k * cfg.num_heads, i32),
            k_stage=cp.zeros((k, cfg.num_kv_heads, cfg.head_dim), f32) if self.kv_int8 else None,
            v_stage=cp.zeros((k, cfg.num_kv_heads, cfg.head_dim), f32) if self.kv_int8 else None)
        self.host_side_flags = self._pinned(2, i32)
        self.logits_rows = cp.zeros((rows, cfg.vocab_size), f32)
        self.scores_ver = cp.zeros((rows, cfg.num_layers, cfg.num_heads, cap), f32)
        self.ml_ver = cp.zeros((rows, cfg.num_layers, cfg.num_heads, 2), f32)
        self.mass_rows = cp.zeros((rows, cap), f32)
        # argmax_rows' input: offsets [rows], counts [rows], then the allowed ids of every row
        self.verify_in = cp.zeros(2 * rows + rows * cfg.vocab_size, i32)
        self.verify_in[rows:2 * rows] = -1
        self.verify_part_v = cp.zeros(rows * ARGMAX_BLOCKS, f32)
        self.verify_part_i = cp.zeros(rows * ARGMAX_BLOCKS, i32)
        self.verify_counters = cp.zeros(rows, i32)
        self.verify_out = cp.zeros(rows, i32)
        self.host_verify_in = self._pinned(2 * rows + rows * cfg.vocab_size, i32)
        self.host_verify_out = self._pinned(rows, i32)
        self.host_rows_mass = self._pinned((rows, cap), f32)
        self._rows_mass_valid = False

    def _pinned(self, shape, dtype):
        count = int(np.prod(shape))
        memory = self.cp.cuda.alloc_pinned_memory(count * np.dtype(dtype).itemsize)
        return np.frombuffer(memory, dtype, count).reshape(shape)

    def _copy(self, dst_ptr, src_ptr, nbytes, kind):
        self.cp.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, self.stream.ptr)

    def _to_device(self, device_array, host_array, count=None):
        count = host_array.size if count is None else count
        self._copy(device_array.data.ptr, host_array.ctypes.data, count * host_array.itemsize,
                   self.cp.cuda.runtime.memcpyHostToDevice)

    def _to_host(self, host_array, device_array, count=None):
        """Copy and wait (the one place where a call waits for the GPU)."""
        count = host_array.size if count is None else count
        self._copy(host_array.ctypes.data, device_array.data.ptr, count * host_array.itemsize,
                   self.cp.cuda.runtime.memcpyDeviceToHost)
        self.stream.synchronize()
        self.rings = [0, 0]

    def _ring_slot(self, which, ring):
        index = self.rings[which]
        if index == len(ring):     # every slot may still be in flight: wait once
            self.stream.synchronize()
            index = 0
        self.rings[which] = index + 1
        return ring[index]

    def _launch(self, name, grid, block, *args, shared=0, dependent=False):
        """Launch a kernel on the stream being enqueued.

        ``_queue``: the backend's stream, or the side stream while a fused pass enqueues its
        verify rows. ``dependent``: it may start before the previous kernel of the forward
        ends (it waits for its results with griddepcontrol.wait).
        """
        function = self.kernels.functions[name]
        if dependent and self._dependent is not None:
            self._dependent(function, grid, block, args, shared, self._queue)
        else:
            function(grid, block, args, shared_mem=shared, stream=self._queue)

    def _enqueue_one_launch(self, lane):
        """Enqueue a decode step as one cooperative launch (decode_dataflow or _persistent)."""
        if self._df_args is not None:
            self._cooperative(self.kernels.functions['decode_dataflow'], (self._df_lists,),
                              (PD_THREADS,), (lane.state, self._pd_args, self._df_args),
                              self._pd_shared(), self.stream)
        else:
            self._cooperative(self.kernels.functions['decode_persistent'], (self.n_sm,),
                              (PD_THREADS,), (lane.state, self._pd_args), self._pd_shared(),
                              self.stream)

    def _enqueue_forward(self, n_max, verify=False, lane=None, row=0, fused=False,
                         at_attention=None):
        """Every kernel of one forward over up to n_max tokens (lane.state says how many).

        ``verify``: a verify pass, each token a row of its own run by the decode step's
        kernels (one-token matmuls with a row of blocks a token, attn_decode with a query a
        token), every row's logits kept and their arg-maxes taken, into the verify buffers
        from row ``row`` on. ``lane``: the activations, run state and token ids it uses (the
        backend's own, or the side lane of a fused pass). ``fused``: a prefill whose last
        token's logits, attention mass and greedy token go to row 0 of the verify buffers
        (``prefill_verify``). ``at_attention(i)``: called before layer i's attention is
        enqueued, once that layer's keys and values are.
        """
        cfg, cap = self.config, self.capacity
        lane = lane or self.lane
        decode = n_max == 1 and not verify
        if decode and self.decode_step != 'kernels':
            return self._enqueue_one_launch(lane)
        one = decode or verify            # the one-token kernels
        tiles = (n_max + T16_TOKENS - 1) // T16_TOKENS
        sfx = '_tv' if verify else '_t1' if decode else '_t16'
        # rows of blocks of a one-token kernel: one, or (verify) VERIFY_NT tokens a row of
        # the float kernels (_tv) and one a token of the quantized ones
        ty = -(-n_max // VERIFY_NT) if verify else 1
        qty = n_max if verify else 1
        hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        eps = np.float32(cfg.rms_norm_eps)
        warps = MATMUL_WARPS
        block = (32 * warps,)
        mv_batch = MV_BATCH[self.weight_dtype]

        def xshared(k, norm=True):
            """Dynamic shared memory of a matmul over K = k: a verify block's staged xhat.

            Only where the matmul normalizes its input (q/k/v, gate/up, the LM head): the
            staging pays for itself by the normalization it saves each row pair; a plain x
            (o, down) is read as fast from global memory.
            """
            return tv_shared(min(n_max, VERIFY_NT), k) if verify and norm else 0

        def mm(units, k, kernel, one_token=one, rows=ty, norm=True):
            """(grid, split) of a matmul over ``units`` row pairs of length ``k``.

            The one-token (_t1) kernels may split K, the 16-token tiles never do; a one-token grid
            is at most what is resident (its blocks stride over the row groups), ``rows`` rows
            of it (a verify pass: one a token); ``norm``: the matmul normalizes its input (a
            verify block then stages xhat, xshared, which may leave fewer blocks resident).
            """
            if not one_token:   # tile16_body: token tiles, then T16_UNITS units a block
                return (tiles, (units + T16_UNITS - 1) // T16_UNITS), _i32(1)
            split = matvec_split(units, k, mv_batch, self.n_sm)
            blocks = (units * split + warps - 1) // warps
            suffix = '_tv' if verify else '_t1'
            resident = max(1, self._resident_blocks(kernel + suffix, 32 * warps,
                                                    xshared(k, norm))) * self.n_sm
            return (min(blocks, resident), rows), _i32(split)

        def tblock(k, grid):
            """Return the block of a matmul over K = k: 4 warps, or a prefill tile's t16_warps."""
            return block if one else (32 * t16_warps(k, grid[0] * grid[1], self.n_sm),)

        def launch(name, grid, block, *args, shared=0):   # every kernel after the first
            self._launch(name, grid, block, *args, shared=shared, dependent=True)
        wbytes = 4 if self.weight_dtype == 'F32' else 2

        def staged(units, k):
            """staged_plan of a decode matmul when staged_decode is on, else None."""
            return (staged_plan(units, k, wbytes, self.n_sm) if decode and self._staged
                    else None)

        def quant_matmul(kind, units, w, tail, last_only=0):
            """Enqueue a matmul on a quantized matrix ``w``.

            One token: qmatvec_<epilogue>_<fmt>[_d2] (``tail``: its arguments after the weight's
            rows and K: x, norm_w, eps, out or the q/k/v ones). A prefill: dequantize into
            the fp32 buffer, then the 16-token kernel on it, launched after the dequantization
            has finished (its blocks read weights before they wait).
            """
            epilogue = kind[len('matmul_'):]
            if one or last_only:
                has_norm = tail[1] is not NULL
                shared = 4 * (w.k + w.k // 16 + (w.k if has_norm else 0))
                name, blocks, split, threads = qmatvec_launch(
                    f'qmatvec_{epilogue}_{w.suffix}', units, w.k // w.chunk_cols, self.n_sm,
                    lambda kernel, threads: self._resident_blocks(kernel, threads, shared))
                extra = (_i32(units), _i32(last_only)) if epilogue != 'qkv_rope' else ()
                if epilogue == 'qkv_rope':
                    tail = tail[:3] + (_i32(units),) + tail[3:]
                launch(name, (blocks, 1 if last_only else qty), (threads,), lane.state,
                       *w.args(), _i32(w.rows), _i32(w.k), *tail, *extra, _i32(split),
                       shared=shared)
                return
            chunks = w.rows * w.k // w.chunk_cols
            launch(f'qdequant_{w.suffix}', (min(-(-chunks // 256), 8 * self.n_sm),), (256,),
                   *w.args(), _i32(w.rows), _i32(w.k), self.dequantized)
            grid, split = mm(units, w.k, kind)
            if epilogue == 'qkv_rope':
                args = (lane.state, self.dequantized, _i32(w.rows), _i32(w.k), *tail[:3],
                        _i32(units), *tail[3:], split)
            else:
                args = (lane.state, self.dequantized, _i32(w.rows), _i32(w.k), *tail,
                        _i32(units), _i32(0), split)
            self._launch(kind + sfx, grid, tblock(w.k, grid), *args)

        def matmul(kind, units, k, *args):
            """Return the residual or swiglu matmul.

            The staged kernel where it fits, else the _t1 or 16-token one. args: W, rows, K, x,
            norm_w, eps, out.
            """
            if isinstance(args[0], DeviceQuant):
                quant_matmul(kind, units, args[0], args[3:])
                return
            plan = staged(units, k)
            if plan is not None:
                blocks, per_block, shared = plan
                launch(kind + '_sp', (blocks,), (SP_THREADS,), lane.state, *args,
                       _i32(units), _i32(per_block), shared=shared)
            else:
                norm = args[4] is not NULL
                grid, split = mm(units, k, kind, norm=norm)
                launch(kind + sfx, grid, tblock(k, grid), lane.state, *args, _i32(units), _i32(0),
                       split, shared=xshared(k, norm))
        if isinstance(self.embed, DeviceQuant):   # decode: the token from state, else ids
            self._launch(f'qembed_gather_{self.embed.suffix}', (n_max,), (256,), lane.state,
                         lane.ids, *self.embed.args(), _i32(hid), lane.x,
                         _i32(1 if decode else 0))
        else:
            self._launch('embed_gather', (n_max,), (256,), lane.state, lane.ids, self.embed,
                         lane.x, _i32(hid), _i32(1 if decode else 0))
        if verify:   # each row's raw scores and softmax sums, as decode_step keeps one's
            scores, row_ml = self.scores_ver[row], self.ml_ver[row]
            score_stride, ml_stride = self.scores_ver[0].size, self.ml_ver[0].size
        else:
            scores, row_ml, score_stride, ml_stride = self.scores_dec, self.ml_dec, 0, 0
        qkv_rows = cfg.q_size + 2 * cfg.kv_size
        shapes = self._layer_matmuls()
        qkv_units = shapes['qkv'][0]
        for i, layer in enumerate(self.layers):
            kc, vc = self.k[i], self.v[i]
            ksc, vsc = ((self.k_scale[i], self.v_scale[i]) if self.kv_int8 else (NULL, NULL))
            # the int8 cache: q/k/v write the call's keys and values to the staging rows
            kw, vw = (lane.k_stage, lane.v_stage) if self.kv_int8 else (kc, vc)
            qkv_args = (lane.state, layer.wqkv, _i32(qkv_rows), _i32(hid), lane.x,
                        layer.attn_norm, eps, _i32(qkv_units),
                        layer.bqkv if layer.bqkv is not None else NULL, lane.q, kw, vw,
                        self.cos, self.sin, _i32(cfg.num_heads), _i32(cfg.num_kv_heads),
                        _i32(d), _i32(cap))
            plan = staged(*shapes['qkv'])
            if isinstance(layer.wqkv, DeviceQuant):
                quant_matmul('matmul_qkv_rope', qkv_units, layer.wqkv, qkv_args[4:7]
                             + qkv_args[8:])
            elif plan is not None:
                blocks, per_block, shared = plan
                launch('matmul_qkv_rope_sp', (blocks,), (SP_THREADS,), *qkv_args,
                       _i32(per_block), shared=shared)
            else:
                grid, split = mm(*shapes['qkv'], 'matmul_qkv_rope')
                launch('matmul_qkv_rope' + sfx, grid, tblock(hid, grid), *qkv_args, split,
                       shared=xshared(hid))
            if self.kv_int8:
                launch('kv_quantize', (n_max,), (32 * min(cfg.num_kv_heads, 8),), lane.state,
                       lane.k_stage, lane.v_stage, kc, vc, ksc, vsc, _i32(cfg.num_kv_heads),
                       _i32(d))
            if at_attention is not None:
                at_attention(i)
            scale = np.float32(1.0 / np.sqrt(d))
            if one:   # the last split of each head merges them (no attn_combine)
                launch('attn_decode', (cfg.num_heads, self.n_splits, qty), (128,),
                       lane.state, lane.q, kc, vc, ksc, vsc, scores[i], lane.part_ml,
                       lane.part_o, lane.attn_out, row_ml[i], lane.counters,
                       _i32(cfg.num_heads),
                       _i32(cfg.num_kv_heads), _i32(d), _i32(cap), _i32(self.n_splits),
                       _i32(self.chunk), scale, _i32(score_stride), _i32(ml_stride))
            else:
                tiles_h = cfg.num_heads * -(-n_max // ATT_QTILE)
                split_blocks = min(self.n_splits, max(1, -(-ATT_PREFILL_BLOCKS // tiles_h)))
                launch('attn_partial', (tiles_h, split_blocks), (ATT_THREADS,),
                       lane.state, lane.q, kc, vc, ksc, vsc, self.scores, lane.part_ml,
                       lane.part_o, _i32(n_max), _i32(cfg.num_heads),
                       _i32(cfg.num_kv_heads), _i32(d), _i32(cap), _i32(self.n_splits),
                       _i32(self.chunk), scale, shared=self.att_smem)
                launch('attn_combine', (cfg.num_heads * n_max,), (128,), lane.state,
                       lane.part_ml, lane.part_o, lane.attn_out, self.scores,
                       _i32(n_max), _i32(cfg.num_heads), _i32(d), _i32(cap),
                       _i32(self.n_splits), _i32(self.chunk))
                self._enqueue_mass(lane.state, self.scores, cfg.num_heads * n_max, n_max,
                                   first=i == 0, out=self.mass_rows[0] if fused else None)
            matmul('matmul_residual', *shapes['o'], layer.wo, _i32(hid),
                   _i32(cfg.q_size), lane.attn_out, NULL, eps, lane.x)
            matmul('matmul_swiglu', *shapes['gate_up'], layer.wgate_up, _i32(2 * inter),
                   _i32(hid), lane.x, layer.mlp_norm, eps, lane.act)
            matmul('matmul_residual', *shapes['down'], layer.wdown, _i32(hid),
                   _i32(inter), lane.act, NULL, eps, lane.x)
        if one:
            self._enqueue_mass(lane.state, scores, cfg.num_layers * cfg.num_heads, 1,
                               first=True, row_ml=row_ml, rows=qty if verify else 0,
                               out=self.mass_rows[row:] if verify else self.mass)
        vocab_units = (cfg.vocab_size + 1) // 2
        # the LM head: the last token's logits, or (verify) every row's
        logits, last_only = ((self.logits_rows[row:], 0) if verify else
                             (self.logits_rows[0] if fused else self.logits_buf, 1))
        if isinstance(self.lm_head, DeviceQuant):
            quant_matmul('matmul_store', vocab_units, self.lm_head,
                         (lane.x, self.final_norm, eps, logits), last_only=last_only)
        else:
            grid, split = mm(vocab_units, hid, 'matmul_store', one_token=True)
            launch('matmul_store' + ('_tv' if verify else '_t1'), grid, block,
                   lane.state, self.lm_head, _i32(cfg.vocab_size), _i32(hid), lane.x,
                   self.final_norm, eps, logits, _i32(vocab_units), _i32(last_only), split,
                   shared=xshared(hid))
        if verify or fused:   # each row's greedy token among its allowed ids (a fused
            # prefill: its last token's, row 0)
            r, a = self.verify_rows, ARGMAX_BLOCKS * row
            launch('argmax_rows', (ARGMAX_BLOCKS, n_max if verify else 1), (256,), lane.state,
                   self.logits_rows[row:], self.verify_in[2 * r:], self.verify_in[row:r],
                   self.verify_in[r + row:2 * r], _i32(cfg.vocab_size), self.verify_part_v[a:],
                   self.verify_part_i[a:], self.verify_counters[row:], self.verify_out[row:])

    def _enqueue_mass(self, state, probs, n_rows, n_max, first, row_ml=None, rows=0, out=None):
        """mass[t] (+)= the probabilities of ``n_rows`` rows (stride capacity) at key t.

        With ``row_ml`` the rows hold raw scores and their softmax max and sum. ``rows`` > 0
        (a verify pass): that many tokens' rows, each summed into its own mass row of ``out``.
        """
        warps = MASS_WARPS_DECODE if row_ml is not None else MASS_WARPS_PREFILL
        self._launch('attn_mass', (-(-self.capacity // MASS_KEYS), max(1, rows)), (32 * warps,),
                     state, probs, NULL if row_ml is None else row_ml,
                     self.mass if out is None else out, _i32(n_max), _i32(n_rows),
                     _i32(self.capacity), _i32(1 if first else 0),
                     _i32(n_rows * self.capacity if rows else 0), dependent=True)

    def _enqueue_fused(self, n_max, k):
        """Enqueue a prefill of up to n_max tokens and a verify of k rows after it, side by side.

        The prefill runs on the backend's stream as ``prefill`` would (its last token's logits,
        mass and greedy token into row 0 of the verify buffers); the verify rows run on the
        side stream with the side lane's buffers, as ``verify`` would run them after that
        prefill (rows 1 .. k), each layer's attention after the prefill has written that
        layer's keys and values. Nothing else is shared: each pass's sums are its own alone.
        """
        main, side = self.stream, self.side_stream
        fork, join, ready = self._fused_events
        fork.record(main)
        side.wait_event(fork)
        self._enqueue_forward(n_max, fused=True, at_attention=lambda i: ready[i].record(main))
        self._queue = side
        try:
            self._enqueue_forward(k, verify=True, lane=self.side_lane, row=1,
                                  at_attention=lambda i: side.wait_event(ready[i]))
        finally:
            self._queue = main
        join.record(side)
        main.wait_event(join)

    def _capture(self, n_max, verify=False, fused=0):
        """Capture one forward as a CUDA graph (``fused``: with a verify of that many rows)."""
        stream = self.stream
        with stream:
            stream.begin_capture()
            try:
                if fused:
                    self._enqueue_fused(n_max, fused)
                else:
                    self._enqueue_forward(n_max, verify)
            finally:
                graph = stream.end_capture()
        graph.upload(stream)
        return graph

    def _warm_up_and_capture(self):
        # run every forward once directly (loads the module, checks launches), then capture
        self.graphs = {}
        for n_max in (1,) + PREFILL_BUCKETS:
            n = min(n_max, self.capacity)
            self._write_state(token=0, start=0, n=n, mass_acc=0)
            self._enqueue_forward(n_max)
            self.stream.synchronize()
            self.graphs[n_max] = self._capture(n_max)
        self.verify_graphs = {}
        for n in range(1, min(self.verify_tokens, self.capacity) + 1):
            self._write_state(token=0, start=0, n=n, mass_acc=0)
            self._enqueue_forward(n, verify=True)
            self.stream.synchronize()
            self.verify_graphs[n] = self._capture(n, verify=True)
        self.fused_graphs = {}
        for n_max in PREFILL_BUCKETS:
            for k in self.verify_graphs:
                n = min(n_max, self.capacity - k)
                if n < 2:
                    continue
                self._write_fused_state(n, k)
                self._enqueue_fused(n_max, k)
                self.stream.synchronize()
                self.fused_graphs[n_max, k] = self._capture(n_max, fused=k)
        for n_max, graph in self.graphs.items():   # and replay each once
            self._write_state(token=0, start=0, n=min(n_max, self.capacity), mass_acc=0)
            graph.launch(self.stream)
        for n, graph in self.verify_graphs.items():
            self._write_state(token=0, start=0, n=n, mass_acc=0)
            graph.launch(self.stream)
        for (n_max, k), graph in self.fused_graphs.items():
            self._write_fused_state(min(n_max, self.capacity - k), k)
            graph.launch(self.stream)
        self.stream.synchronize()
        self.k.fill(0)
        self.v.fill(0)
        self.length = 0
        self._logits_valid = False

    # -- the calls -----------------------------------------------------------------
    def _write_state(self, token, start, n, mass_acc, state=None):
        slot = self._ring_slot(0, self.state_ring)
        slot[:5] = (token, start, n, mass_acc, 0)
        self._to_device(self.state if state is None else state, slot, 5)

    def _write_fused_state(self, n, k, start=0, mass_acc=0):
        """Write a fused pass's run states: n prefill tokens from ``start``, k rows after them."""
        self._write_state(0, start, n, mass_acc)
        self._write_state(0, start + n, k, 0, self.side_lane.state)

    def _token_ids(self, ids):
        return token_ids(ids, self.length, self.capacity, self.config.vocab_size)

    @reports_device_errors
    def prefill(self, token_ids):
        """Run token_ids: [n] at the next n positions, writing their keys and values."""
        ids = self._token_ids(token_ids)
        if len(ids) == 1:
            return self.decode(int(ids[0]))
        biggest = PREFILL_BUCKETS[-1]
        for first in range(0, len(ids), biggest):
            chunk = ids[first:first + biggest].astype(np.int32)
            n_max = next(b for b in PREFILL_BUCKETS if b >= len(chunk))
            slot = self._ring_slot(1, self.ids_ring)
            slot[:len(chunk)] = chunk
            self._to_device(self.ids, slot, len(chunk))
            self._write_state(0, self.length, len(chunk), 1 if first else 0)
            self.graphs[n_max].launch(self.stream)
            self.length += len(chunk)
        self._rows = self._row = None
        self._logits_valid = True

    @reports_device_errors
    def decode(self, token_id):
        """Run one token at the next position (replays the decode graph)."""
        token = int(self._token_ids([token_id])[0])
        self._write_state(token, self.length, 1, 0)
        self.graphs[1].launch(self.stream)
        self.length += 1
        self._rows = self._row = None
        self._logits_valid = True

    @reports_device_errors
    def verify(self, token_ids, allowed):
        """Run ``token_ids`` [k] in one pass, each row exactly as its decode() call would.

        The numpy backend's contract: each row runs the decode step's sums in the same order
        (the _tv matmuls, VERIFY_NT tokens a block, and a block row a token for the rest), so the
        cache and each row's logits and attention mass equal those of k decode() calls bit
        for bit. ``allowed[i]``:
        sorted permitted ids after row i, or None. Returns int64 [k], the greedy token after
        each row (argmax_rows, on the device). ``rollback`` into the rows makes that row's
        logits and mass current; ``row_mass(i)`` is row i's mass. k is at most
        ``verify_tokens``.
        """
        ids = self._token_ids(token_ids)
        n, v = len(ids), self.verify_tokens
        if not 1 <= n <= v:
            raise BackendError(f'a verify pass takes 1 .. {v} tokens on this backend '
                               f'(verify_tokens), not {n}')
        if len(allowed) != n:
            raise BackendError(f'verify got {len(allowed)} allowed sets for {n} rows')
        self._settle_rows()   # the rows of an earlier verify are no longer the last call's
        self._upload_allowed(allowed)
        slot = self._ring_slot(1, self.ids_ring)
        slot[:n] = ids
        self._to_device(self.ids, slot, n)
        self._write_state(0, self.length, n, 0)
        self.verify_graphs[n].launch(self.stream)
        self._copy(self.host_verify_out.ctypes.data, self.verify_out.data.ptr, 4 * n,
                   self.cp.cuda.runtime.memcpyDeviceToHost)
        self._finish()   # waits, and raises on non-finite logits
        self._rows, self._row = (self.length, n), n - 1
        self._rows_mass_valid = False
        self.length += n
        self._logits_valid = True
        return self.host_verify_out[:n].astype(np.int64)

    def _upload_allowed(self, allowed):
        """Each row's allowed ids into argmax_rows' input (rows 0 ..)."""
        host, vocab, r = self.host_verify_in, self.config.vocab_size, self.verify_rows
        at = 2 * r
        for i, ok in enumerate(allowed):   # offsets, counts (-1: every id), the ids
            host[i] = at - 2 * r
            if ok is None:
                host[r + i] = -1
                continue
            ok = np.asarray(ok, dtype=np.int64).reshape(-1)
            if not 0 < len(ok) <= vocab:
                raise BackendError(f'verify row {i} allows {len(ok)} ids (1 .. {vocab})')
            if ok.min() < 0 or ok.max() >= vocab:
                raise BackendError(f'verify row {i} allows ids outside the vocabulary')
            host[r + i] = len(ok)
            host[at:at + len(ok)] = ok
            at += len(ok)
        self._to_device(self.verify_in, host, at)

    @reports_device_errors
    def prefill_verify(self, prefill_ids, drafts, allowed):
        """Run ``prefill(prefill_ids)`` and a verify of ``drafts`` after it as one fused pass.

        The backends' contract (``rt_llm_node.backends``): returns int64 [k + 1], the greedy
        token after the prefill (among ``allowed[0]``) and after each of the k drafts verified
        (among ``allowed[i + 1]``); the cache then holds the prefill and the k drafts, and
        the verify's rows are the prefill's last token (row 0) and the drafts (rows 1 .. k).
        The prefill's graph runs on this stream and the verify rows' beside it (``fused_graphs``,
        ``_enqueue_fused``), each as it would alone: every row's logits, mass and cache entries
        equal those of ``prefill`` and k ``decode`` calls bit for bit. A prefill longer than
        the largest bucket runs its first chunks alone; a one-token prefill is a decode step,
        so then the token and the drafts are one verify pass (at most ``verify_tokens`` rows:
        fewer drafts may be verified than given).
        """
        ids = self._token_ids(prefill_ids)
        feed = self._token_ids(np.concatenate([ids, np.asarray(drafts, np.int64).reshape(-1)])
                               )[len(ids):]   # both fit, both in the vocabulary
        k = len(feed)
        if not 1 <= k <= self.verify_tokens:
            raise BackendError(f'a fused pass verifies 1 .. {self.verify_tokens} drafts on '
                               f'this backend (verify_tokens), not {k}')
        if len(allowed) != k + 1:
            raise BackendError(f'prefill_verify got {len(allowed)} allowed sets for {k} drafts '
                               'and the prefill')
        if len(ids) == 1:   # the token is a decode step: one verify pass of it and the drafts
            rows = min(k + 1, self.verify_tokens)
            return self.verify(np.concatenate([ids, feed])[:rows], list(allowed[:rows]))
        self._settle_rows()
        biggest = PREFILL_BUCKETS[-1]
        head = len(ids) - ((len(ids) - 1) % biggest + 1)   # the chunks before the last
        if head:
            self.prefill(ids[:head])
        chunk = ids[head:]
        n_max = next(b for b in PREFILL_BUCKETS if b >= len(chunk))
        if (n_max, k) not in self.fused_graphs:
            raise BackendError(f'no fused pass of {len(chunk)} + {k} tokens in a cache of '
                               f'{self.capacity}')
        self._upload_allowed(allowed)
        if head:   # the last chunk's mass adds to the earlier chunks' (in row 0)
            with self.stream:
                self.mass_rows[0][...] = self.mass
        for lane, tokens in ((self.lane, chunk), (self.side_lane, feed)):
            slot = self._ring_slot(1, self.ids_ring)
            slot[:len(tokens)] = tokens
            self._to_device(lane.ids, slot, len(tokens))
        self._write_fused_state(len(chunk), k, self.length, 1 if head else 0)
        self.fused_graphs[n_max, k].launch(self.stream)
        self._copy(self.host_verify_out.ctypes.data, self.verify_out.data.ptr, 4 * (k + 1),
                   self.cp.cuda.runtime.memcpyDeviceToHost)
        self._finish(side=True)   # waits, and raises on non-finite logits
        self._rows, self._row = (self.length + len(chunk) - 1, k + 1), k
        self._rows_mass_valid = False
        self.length += len(chunk) + k
        self._logits_valid = True
        return self.host_verify_out[:k + 1].astype(np.int64)

    def row_mass(self, i):
        """Float32 [start + i + 1]: the attention mass of row ``i`` of the last verify."""
        if self._rows is None or not 0 <= i < self._rows[1]:
            raise BackendError(f'no row {i} of a verify to read')
        start, n = self._rows
        if not self._rows_mass_valid:   # every row in one copy
            self._to_host(self.host_rows_mass[:n], self.mass_rows[:n])
            self._rows_mass_valid = True
        return self.host_rows_mass[i, :start + i + 1].copy()

    def _current(self):
        """Return the device logits and mass of the last token (a verify row's or the call's)."""
        if self._row is None:
            return self.logits_buf, self.mass
        return self.logits_rows[self._row], self.mass_rows[self._row]

    def _settle_rows(self):
        """Make the current verify row's logits and mass the backend's own; forget the rows."""
        if self._row is not None:
            logits, mass = self._current()
            with self.stream:
                self.logits_buf[...] = logits
                self.mass[...] = mass
        self._rows = self._row = None

    def _finish(self, side=False):
        """Wait for the queued work; raise if it produced non-finite logits.

        ``side``: a fused pass's verify rows ran too (their flags are in the side lane's state).
        """
        if side:
            self._copy(self.host_side_flags.ctypes.data, self.side_lane.state[FLAGS:].data.ptr,
                       self.host_side_flags.nbytes, self.cp.cuda.runtime.memcpyDeviceToHost)
        self._to_host(self.host_flags, self.state[FLAGS:])
        if self.host_flags[0] & 1 or (side and self.host_side_flags[0] & 1):
            raise BackendError('the model produced non-finite logits')
        return self.host_flags

    @reports_device_errors
    def logits(self):
        """Float32 logits [vocab] of the last token run."""
        self._finish()
        self._to_host(self.host_logits, self._current()[0])
        return self.host_logits.copy()

    @reports_device_errors
    def argmax(self, allowed=None):
        """Greedy next token; ``allowed``: sorted int array of permitted ids, or None."""
        count = -1
        if allowed is not None:
            allowed = np.asarray(allowed, dtype=np.int32)
            count = len(allowed)
            if count == 0:
                raise BackendError('argmax over an empty allowed set')
            self.host_allowed[:count] = allowed
            self._to_device(self.allowed, self.host_allowed, count)
        self._launch('argmax_masked', (ARGMAX_BLOCKS,), (256,), self.state, self._current()[0],
                     self.allowed, _i32(count), _i32(self.config.vocab_size), self.part_v,
                     self.part_i)
        return int(self._finish()[1])

    @reports_device_errors
    def attention_mass(self):
        """Float32 [length]: attention each cached token received in the last call."""
        self._finish()
        if self.length:
            self._to_host(self.host_mass, self._current()[1], self.length)
        return self.host_mass[:self.length].copy()

    # -- cache maintenance ---------------------------------------------------------
    def rollback(self, length):
        """Forget every token at or after ``length``.

        Back into the rows of the last verify, the logits and mass become that row's.
        """
        length = rollback_length(length, self.length)
        if self._rows is not None:
            start, n = self._rows
            if start < length <= start + n:
                self._rows, self._row = (start, length - start), length - start - 1
            else:
                self._settle_rows()
        self.length = length

    def _kv_arrays(self):
        names = {'k': self.k, 'v': self.v}
        if self.kv_int8:
            names.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return names

    @reports_device_errors
    def export_kv(self, start, stop):
        """Return the cache's slots start .. stop - 1 as named host arrays (for ``import_kv``).

        The numpy backend's names and layout: k, v [layers, n, kv heads, head dim] (fp32, or
        int8 with k_scale, v_scale [layers, n, kv heads]).
        """
        import cupy as cp
        start, stop = kv_slot_range(start, stop, self.length)
        with self.stream:
            out = {name: cp.asnumpy(a[:, start:stop], stream=self.stream)
                   for name, a in self._kv_arrays().items()}
        self.stream.synchronize()
        return out

    @reports_device_errors
    def import_kv(self, tensors, start=0):
        """Put exported slots at ``start`` .. and make the cache end after them.

        As the numpy backend's: slots before ``start`` stay, the logits are those of no token
        until the next call, a foreign layout is a BackendError. Returns the new length.
        """
        import cupy as cp
        if not 0 <= start <= self.length:
            raise BackendError(f'cannot import at slot {start} of a cache of {self.length}')
        self._settle_rows()
        try:
            n = kv_slot_count(tensors, self._kv_arrays(), start)
        except (ValueError, KeyError, AttributeError) as exc:
            raise BackendError(f'the stored KV state does not fit this cache: {exc}') from None
        with self.stream:
            for name, a in self._kv_arrays().items():
                a[:, start:start + n] = cp.asarray(np.ascontiguousarray(tensors[name]))
            self.mass[start:start + n] = 0
        self.stream.synchronize()
        self.length = start + n
        self._logits_valid = False
        return self.length

    @reports_device_errors
    def compact(self, keep):
        """Move slots ``keep`` (ascending) to 0..m-1, re-rotating keys by (new - old) position."""
        keep = compact_slots(keep, self.length)
        self._settle_rows()
        m = len(keep)
        if m:
            cfg = self.config
            self.host_keep[:m] = keep
            self._to_device(self.keep, self.host_keep, m)
            grid = (m, cfg.num_layers)
            scales = (self.k_scale, self.v_scale) if self.kv_int8 else (NULL, NULL)
            scales_tmp = ((self.k_scale_tmp, self.v_scale_tmp) if self.kv_int8
                          else (NULL, NULL))
            self._launch('compact_gather', grid, (128,), self.keep, self.k, self.v, *scales,
                         self.mass, self.k_tmp, self.v_tmp, *scales_tmp, self.mass_tmp,
                         self.cos, self.sin, _i32(self.capacity), _i32(cfg.num_kv_heads),
                         _i32(cfg.head_dim))
            self._launch('compact_store', grid, (128,), self.k, self.v, *scales, self.mass,
                         self.k_tmp, self.v_tmp, *scales_tmp, self.mass_tmp,
                         _i32(self.capacity), _i32(cfg.num_kv_heads), _i32(cfg.head_dim))
        self.length = m
