"""8-bit (float8 e4m3) attention: cuDNN's fp8 SDPA through nvidia-cudnn-frontend, with exact error reduction.

The kernel (Hopper and newer) takes e4m3 Q, K, V with per-tensor fp32 descales, quantises the softmax numerator
P~ = exp(s - rowmax) to e4m3 with `scale_s`, and on Hopper writes an e4m3 O scaled by `scale_o`. What this module
adds around it (docs/performance.md, "8-bit attention"):

1. Quantisation of q, k, v from the attention input (after RMSNorm + RoPE), written as plain torch ops so that a
   compiled block fuses it into the op producing q/k/v (`torch.compile`), and compiled on its own otherwise.
2. K smoothing (SageAttention): K minus its per-channel mean over tokens. Exact under softmax: q.(k_j - m) =
   q.k_j - q.m, and the q.m term is constant along a softmax row. It removes the shared offset that would
   otherwise spend the 3-bit mantissa of every key.
3. V smoothing: V minus its per-channel mean, added back to O. Exact because softmax rows sum to one; the fp8 O
   then carries only the deviation, so its rounding error shrinks with it.
4. Per-head V (and O) scales. The kernel's descales are scalars, but O is linear in V: each head's V is scaled to
   the full e4m3 range by its own factor, the kernel is told descale_v = 1, and each head's O is divided by that
   factor afterwards. Exact, and needs nothing from cuDNN. Q and K stay per tensor: their softmax logits need
   one common descale per head pair, which the kernel does not take, and after the per-head RMSNorm (which
   normalises every head vector to unit RMS) their heads share one range anyway.

Layout: the quantiser keeps the memory layout of its input (elementwise ops preserve strides): BHSD-contiguous q
from dit_svc/model.py's blocks gives BHSD e4m3 tensors, a [S, H, D]-backed view gives [S, H, D]-backed ones. cuDNN
reads any of them as BHSD through their strides (the plan is keyed by them), and O is allocated like q.

Everything except the cuDNN call has a CPU path: `emulate=True` replaces the kernel by an fp32 emulation of the
same arithmetic (e4m3 P and O included), for tests and for checking the quantisation math without a GPU.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-12  # an all-zero tensor would otherwise divide by zero
# Scale of the softmax numerator P~ in (0, 1] before its e4m3 cast: a power of two (exact in fp32), below 448.
SOFTMAX_SCALE = 256.0
# Scale of O before its e4m3 cast. O is a convex combination of V rows, so |O| <= max|V| = 448 in quantised
# units; 0.5 keeps rounding of the softmax weights' sum away from e4m3's top (a NaN in e4m3fn), and costs no
# precision (e4m3's relative step is the same across its normal range).
OUTPUT_SCALE = 0.5
MIN_CAPABILITY = (9, 0)  # cuDNN's fp8 SDPA: Hopper and newer
MIN_CUDNN_BACKEND = 90100  # 9.1.0 introduced the fp8 SDPA forward
GRAPH_CACHE_SIZE = 16  # cuDNN plans kept (one per plan_key); a job uses one or two


@dataclass(frozen=True)
class Fp8AttentionOptions:
    """How q, k, v are quantised (see the module docstring)."""

    v_scale: str = "head"  # "tensor" | "head": one scale for V (and O) or one per head
    smooth_k: bool = True  # subtract K's per-channel mean over tokens
    smooth_v: bool = True  # subtract V's per-channel mean over tokens, add it back to O
    min_seq: int = 1024  # shorter sequences (e.g. the text refiner) run the compute-dtype SDPA instead

    def __post_init__(self) -> None:
        if self.v_scale not in ("tensor", "head"):
            raise ValueError(f"v_scale must be 'tensor' or 'head', got {self.v_scale!r}")

    @property
    def label(self) -> str:
        return f"{self.v_scale}{'+k' if self.smooth_k else ''}{'+v' if self.smooth_v else ''}"


# The options the benchmark compares (scripts/bench_attention.py); DEFAULT is what the registry runs.
OPTIONS = {
    "naive": Fp8AttentionOptions(v_scale="tensor", smooth_k=False, smooth_v=False),
    "head": Fp8AttentionOptions(v_scale="head", smooth_k=False, smooth_v=False),
    "head+k": Fp8AttentionOptions(v_scale="head", smooth_k=True, smooth_v=False),
    "head+kv": Fp8AttentionOptions(v_scale="head", smooth_k=True, smooth_v=True),
}
DEFAULT_OPTIONS = OPTIONS["head+kv"]


class Fp8QKV(NamedTuple):
    """Quantised attention inputs. q8/k8/v8 [H, S, D] e4m3 (the input's memory layout); descale_q/descale_k [1]
    fp32 (value = descale x e4m3); o_scale [H, 1, 1] and o_shift [H, 1, D] fp32 (or None) turn the kernel's e4m3 O
    back into O."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    o_scale: torch.Tensor
    o_shift: torch.Tensor | None


def _to_e4m3(x: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    return (x * mult).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _centered_amax(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(head, channel) absmax of x [H, S, D] after subtracting its per-channel mean over tokens (if `smooth`),
    as [H, 1, D], and the mean [H, 1, D] (or None). One pass of three reductions (max, min, mean), so the amax of
    the centred tensor costs no extra pass: fp32 subtraction is monotone, so max_j(x_j - m) == max_j(x_j) - m."""
    hi, lo = x.amax(1, keepdim=True), x.amin(1, keepdim=True)
    if not smooth:
        return torch.maximum(hi, -lo), None
    mean = x.mean(1, keepdim=True)
    return torch.maximum(hi - mean, mean - lo), mean


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: Fp8AttentionOptions) -> Fp8QKV:
    """q, k, v [H, S, D] (any float dtype, any strides) -> Fp8QKV. Pure torch (compiles and fuses)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    aq = qf.abs().amax().clamp(min=AMAX_FLOOR)
    amk, mk = _centered_amax(kf, options.smooth_k)
    ak = amk.amax().clamp(min=AMAX_FLOOR)
    amv, mv = _centered_amax(vf, options.smooth_v)
    av = amv.amax(dim=(1, 2), keepdim=True) if options.v_scale == "head" else amv.amax().expand(amv.shape[0], 1, 1)
    av = av.clamp(min=AMAX_FLOOR)  # [H, 1, 1]
    q8 = _to_e4m3(qf, E4M3_MAX / aq)
    k8 = _to_e4m3(kf if mk is None else kf - mk, E4M3_MAX / ak)
    v8 = _to_e4m3(vf if mv is None else vf - mv, E4M3_MAX / av)
    # The kernel sees V in quantised units (descale_v = 1) and writes O * OUTPUT_SCALE in those units.
    o_scale = av / (E4M3_MAX * OUTPUT_SCALE)
    return Fp8QKV(q8, k8, v8, (aq / E4M3_MAX).reshape(1), (ak / E4M3_MAX).reshape(1), o_scale, mv)


def dequantize_o(o8: torch.Tensor, o_scale: torch.Tensor, o_shift: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """e4m3 O [H, S, D] from the kernel -> O [H, S, D] in `dtype` (same memory layout)."""
    o = o8.float() * o_scale
    if o_shift is not None:
        o = o + o_shift
    return o.to(dtype)


def sdpa_fp8_emulated(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                      descale_k: torch.Tensor) -> torch.Tensor:
    """fp32 emulation of the kernel on [H, S, D] e4m3 inputs (descale_v = 1, scale_o = OUTPUT_SCALE): softmax
    numerator quantised to e4m3 with SOFTMAX_SCALE, normalised by its fp32 row sum, O written as e4m3 [H, S, D].
    The kernel takes the row max blockwise (flash attention), so its P~ rounding differs slightly; the error is the
    same kind. Materialises the [H, S, S] scores: tests and small shapes only."""
    d = q8.shape[-1]
    q = q8.float() * descale_q.float()
    k = k8.float() * descale_k.float()
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    denom = p.sum(-1, keepdim=True)
    p8 = (p * SOFTMAX_SCALE).to(E4M3).float() * (1.0 / SOFTMAX_SCALE)
    o = (p8 @ v8.float()) / denom
    return (o * OUTPUT_SCALE).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


# =====================================================================================================================
# cuDNN (nvidia-cudnn-frontend), optional
# =====================================================================================================================


def unavailable(device: torch.device | str) -> str | None:
    """None if cuDNN fp8 SDPA can run on `device`, else why not (missing package, GPU too old, ...). Never raises:
    the registry's start-up probe calls it for every candidate."""
    device = torch.device(device)
    try:
        import cudnn
    except Exception as e:  # ImportError, or a library that fails to load (OSError / RuntimeError)
        return f"nvidia-cudnn-frontend is not importable ({type(e).__name__}: {e}); pip install nvidia-cudnn-frontend"
    if device.type != "cuda":
        return f"cuDNN fp8 attention needs a CUDA GPU (device is {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"cuDNN fp8 attention needs compute capability >= 9.0 (Hopper), this GPU is sm_{cap[0]}{cap[1]}"
    try:
        # The frontend loads libcudnn itself (LD_LIBRARY_PATH, then the nvidia-cudnn wheel torch uses); without one
        # every backend call raises RuntimeError ("Unable to find symbol cudnnGetVersion").
        version = cudnn.backend_version()
    except Exception as e:
        return f"nvidia-cudnn-frontend found no cuDNN library ({type(e).__name__}: {e})"
    if version < MIN_CUDNN_BACKEND:
        return f"cuDNN backend {version} has no fp8 SDPA (needs >= 9.1.0)"
    return None


class _Plan(NamedTuple):
    graph: object
    tensors: dict  # port name -> the graph's tensor (inputs, scales, O, amax_s, amax_o)
    workspace_bytes: int
    amax: torch.Tensor  # [2, 1, 1, 1, 1] fp32 scratch for the kernel's amax_s / amax_o outputs (never read)


def plan_key(device: torch.device, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, o8: torch.Tensor,
             head_descales: bool) -> tuple:
    """What a plan is built for: device, heads, rows, head_dim, the four [H, S, D] stride triples, descale shape.
    A new sequence length or memory layout gets its own plan (built in ~1 s, kept; docs/performance.md)."""
    h, s, d = q8.shape
    return (device.index, h, s, d, tuple(tuple(x.stride()) for x in (q8, k8, v8, o8)), head_descales)


def declare_graph(cudnn, handle, h: int, s: int, d: int, strides: tuple, head_descales: bool = False):
    """The fp8 SDPA graph in nvidia-cudnn-frontend's graph IR, validated by the frontend, not yet built
    (no GPU needed up to here). strides: the [H, S, D] strides of q, k, v and O. Returns (graph, tensors by port).

    Facts of nvidia-cudnn-frontend 1.32.0 this relies on (its `pygraph.sdpa_fp8` and backend binding docstrings):
    every input port is required: q, k, v (dims [B, H, S, D], last stride 1), descale_q/k/v/s and scale_s/o
    (fp32 device tensors [1, 1, 1, 1]); `generate_stats=False` is inference (no softmax stats output); the call
    returns [O, Stats (None here), Amax_S, Amax_O]. O is declared e4m3 (Hopper's kernel writes fp8 O; bf16 O is
    Blackwell-only) with q's layout, and both amaxes as fp32 [1, 1, 1, 1] outputs, as cuDNN's fp8 forward graphs
    have always declared them (the backend serves such a graph; we never read them)."""
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    dims = [1, h, s, d]
    # BHSD dims over each tensor's own [H, S, D] strides (batch stride: the whole tensor).
    t = {n: graph.tensor(name=n, dim=dims, stride=[h * s * d, *st], data_type=e4m3)
         for n, st in zip(("q", "k", "v"), strides)}
    qk_dims = ([1, h, 1, 1], [h, 1, 1, 1]) if head_descales else ([1, 1, 1, 1], [1, 1, 1, 1])
    for n in ("descale_q", "descale_k"):
        t[n] = graph.tensor(name=n, dim=qk_dims[0], stride=qk_dims[1], data_type=fp32)
    for n in ("descale_v", "descale_s", "scale_s", "scale_o"):
        t[n] = graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
        descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"], attn_scale=1.0 / math.sqrt(d),
        generate_stats=False, name="sdpa_fp8")
    o.set_output(True).set_dim(dims).set_stride([h * s * d, *strides[3]]).set_data_type(e4m3)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    t.update(o=o, amax_s=amax_s, amax_o=amax_o)
    graph.validate()
    return graph, t


def variant_pack(tensors: dict, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor,
                 descale_q: torch.Tensor, descale_k: torch.Tensor, consts: dict[str, torch.Tensor],
                 amax: torch.Tensor) -> dict:
    """Graph tensor -> buffer for every port of `declare_graph`'s graph (a missing one fails the execute).
    q4/k4/v4/o4 [1, H, S, D] e4m3 views with the declared geometry; descales [1, 1, 1, 1] or [1, H, 1, 1] fp32."""
    t = tensors
    return {t["q"]: q4, t["k"]: k4, t["v"]: v4, t["o"]: o4, t["descale_q"]: descale_q, t["descale_k"]: descale_k,
            t["descale_v"]: consts["one"], t["descale_s"]: consts["descale_s"], t["scale_s"]: consts["scale_s"],
            t["scale_o"]: consts["scale_o"], t["amax_s"]: amax[0], t["amax_o"]: amax[1]}


def scale_constants(device: torch.device | str) -> dict[str, torch.Tensor]:
    """The fixed scale tensors ([1, 1, 1, 1] fp32 on `device`): descale_v = 1 (V arrives in quantised units), the
    softmax numerator's scale_s / descale_s and O's scale_o (module constants above)."""
    def scalar(v):
        return torch.full((1, 1, 1, 1), v, dtype=torch.float32, device=device)
    return {"one": scalar(1.0), "scale_s": scalar(SOFTMAX_SCALE), "descale_s": scalar(1.0 / SOFTMAX_SCALE),
            "scale_o": scalar(OUTPUT_SCALE)}


class CudnnFp8Sdpa:
    """cuDNN fp8 SDPA plans, built on first use per `plan_key` and kept (LRU).

    One cuDNN handle per device, created on that device. Calls are serialised by a lock (a cuDNN handle must not
    be driven from two threads at once); each call points the handle at the caller's current CUDA stream first
    (`cudnn.set_stream`, a no-op when unchanged), so the kernel runs in stream order with the ops around it."""

    def __init__(self, cache_size: int = GRAPH_CACHE_SIZE):
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._handles: dict[int, object] = {}
        self._consts: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._cache_size = cache_size

    def _handle(self, device: torch.device):
        import cudnn

        if device.index not in self._handles:
            with torch.cuda.device(device):
                self._handles[device.index] = cudnn.create_handle()
        return self._handles[device.index]

    def _build(self, device: torch.device, key: tuple) -> _Plan:
        import cudnn

        _, h, s, d, strides, head_descales = key
        try:
            graph, tensors = declare_graph(cudnn, self._handle(device), h, s, d, strides, head_descales)
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
            workspace = graph.get_workspace_size()
        except Exception as e:
            msg = (f"cuDNN {cudnn.backend_version_string()} (frontend {cudnn.__version__}) has no fp8 SDPA plan for "
                   f"heads={h} rows={s} head_dim={d} strides={strides}: {type(e).__name__}: {e}")
            log.warning("%s", msg)
            raise RuntimeError(msg) from e
        log.info("built cuDNN fp8 SDPA plan for heads=%d rows=%d head_dim=%d strides=%s (%d B workspace)", h, s, d,
                 strides, workspace)
        # At least one byte: a zero-size buffer has no address to hand over.
        return _Plan(graph, tensors, max(1, workspace), torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=device))

    def _plan(self, device: torch.device, key: tuple) -> _Plan:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._build(device, key)
            while len(self._plans) > self._cache_size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                 descale_k: torch.Tensor) -> torch.Tensor:
        """[H, S, D] e4m3 q8/k8/v8 (any layout with a unit stride on D; V in quantised units: descale_v = 1),
        descales [1] fp32 (or [H]: per-head descales, if this cuDNN accepts them) -> e4m3 O [H, S, D], laid out
        like q8, = softmax(q k^T / sqrt(D)) v * OUTPUT_SCALE."""
        import cudnn

        h, s, d = q8.shape
        device = q8.device
        q8, k8, v8 = (x if x.stride(-1) == 1 and _dense(x) else x.contiguous() for x in (q8, k8, v8))
        out = torch.empty_like(q8)  # keeps q8's (dense) layout, as the fake implementation does
        head_descales = descale_q.numel() > 1
        key = plan_key(device, q8, k8, v8, out, head_descales)
        shape = (1, h, 1, 1) if head_descales else (1, 1, 1, 1)
        with self._lock:
            if device.index not in self._consts:
                self._consts[device.index] = scale_constants(device)
            plan = self._plan(device, key)
            ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device)
            # 4-D views with exactly the declared BHSD geometry (batch stride: the whole tensor).
            q4, k4, v4, o4 = (torch.as_strided(x, (1, h, s, d), (h * s * d, *x.stride())) for x in (q8, k8, v8, out))
            pack = variant_pack(plan.tensors, q4, k4, v4, o4, descale_q.float().reshape(shape),
                                descale_k.float().reshape(shape), self._consts[device.index], plan.amax)
            handle = self._handle(device)
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
            plan.graph.execute(pack, ws, handle=handle)
        return out


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense (some permutation of a contiguous tensor): what empty_like keeps as is."""
    order = sorted(range(x.dim()), key=lambda i: x.stride(i))
    expect = 1
    for i in order:
        if x.size(i) != 1 and x.stride(i) != expect:
            return False
        expect *= x.size(i)
    return True


# One plan cache per process: the custom op below cannot carry Python state, and plans are per device/shape.
_CUDNN = CudnnFp8Sdpa()


@torch.library.custom_op("h3stages::sdpa_fp8", mutates_args=())
def sdpa_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
             descale_k: torch.Tensor) -> torch.Tensor:
    """cuDNN fp8 SDPA as a torch op (opaque to torch.compile, which fuses the quantisation around it)."""
    return _CUDNN(q8, k8, v8, descale_q, descale_k)


@sdpa_fp8.register_fake
def _(q8, k8, v8, descale_q, descale_k):
    return torch.empty_like(q8 if q8.stride(-1) == 1 and _dense(q8) else q8.contiguous())


# =====================================================================================================================
# The attention callable
# =====================================================================================================================


class Fp8Attention:
    """AttentionFn (dit_svc/model.py): (q, k, v) [1, H, S, D] -> o [1, H, S, D] in q's dtype, non-causal, 1/sqrt(D).

    `emulate=True` runs the fp32 emulation of the kernel (any device). `compile_quant=True` compiles the
    quantisation and dequantisation on their own (for eager models; inside a compiled block they are traced and
    fused with the surrounding ops anyway)."""

    def __init__(self, options: Fp8AttentionOptions = DEFAULT_OPTIONS, emulate: bool = False,
                 compile_quant: bool = False):
        self.options = options
        self.emulate = emulate
        self._quantize, self._dequantize = quantize_qkv, dequantize_o
        if compile_quant:
            # Dynamic shapes from the start: the start-up probe's sequence length is not a job's.
            self._quantize = torch.compile(quantize_qkv, dynamic=True)
            self._dequantize = torch.compile(dequantize_o, dynamic=True)
        self.__name__ = f"fp8_attention[{options.label}{', emulated' if emulate else ''}]"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[2] < self.options.min_seq:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        tracing = torch.compiler.is_compiling()  # inside a compiled block: trace the plain ops and fuse them there
        p = self._run(quantize_qkv if tracing else self._quantize, quantize_qkv, q[0], k[0], v[0], self.options)
        kernel = sdpa_fp8_emulated if self.emulate else sdpa_fp8
        o8 = kernel(p.q8, p.k8, p.v8, p.descale_q, p.descale_k)
        o = self._run(dequantize_o if tracing else self._dequantize, dequantize_o, o8, p.o_scale, p.o_shift, q.dtype)
        return o.unsqueeze(0)

    def _run(self, fn, eager, *args):
        """fn(*args); if a standalone compilation fails, warn once and stay eager (same math, unfused)."""
        if fn is eager:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:  # a compiler failure on this machine must not take attention down
            log.warning("fp8 attention: compiling the q/k/v quantisation failed (%s: %s); running it eagerly",
                        type(e).__name__, str(e)[:300])
            self._quantize, self._dequantize = quantize_qkv, dequantize_o
            return eager(*args)
