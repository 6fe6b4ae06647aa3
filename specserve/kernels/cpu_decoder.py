"""Build, load and call the fused CPU decoder (``cpu_decoder.c``).

The C source is compiled once with the system C compiler into the specserve
cache directory (the file name carries a hash of the source and flags; a
library prebuilt next to the source, as container images ship it, is used
first), then loaded with ctypes.  It needs an x86-64 CPU with AVX512-BF16
(then it uses AMX tiles where the CPU has them) or with AVX2 + FMA + F16C (a
second build of the same source, see ``cpu_features``); anywhere else (or with
no compiler) ``load_library`` raises ``KernelUnavailable`` with the reason and
the caller keeps the torch path.

``CpuDecoder`` wraps a bf16 ``LlamaModel`` and its ``KVCache``: ``forward``
runs the whole decoder stack for a flattened ragged batch in one C call and
``logits`` is the LM head.  ``FusedHead`` runs a draft head's one decoder layer
(an EAGLE head's) the same way (``ss_head_layer``; EAGLE-3's input built in the
call, ``ss_eagle3_layer``) and its norm and LM head (``ss_norm_logits``);
``FusedHeadChain`` runs an EAGLE-3 head's greedy draft chains in one call;
``FusedStepArgs`` is a step's layout as these calls read it.  Torch
tensors stay the owners of all memory; the C side only sees their data pointers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from specserve.executor.batch import int64_masks
from specserve.kernels.cpu_features import (
    ISAS,
    SOURCE,
    cflags,
    cpu_flags,
    cpu_unsupported_reason,
    find_compiler,
    kernel_isa,
    library_name,
)

log = logging.getLogger(__name__)

ABI_VERSION = 7


class KernelUnavailable(RuntimeError):
    """The fused CPU decoder cannot run here (the message says why)."""


def _build(cc: str, out: Path, isa: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *cflags(isa), "-o", str(tmp_lib), str(SOURCE)], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp_lib, out)  # atomic: concurrent builders never see a partial file


def build_library(out_dir: Path, isa: str | None = None) -> Path:
    """Compile one build of the kernel (default: this CPU's best, else AVX512)
    into out_dir (no CPU check: an image build may run elsewhere)."""
    cc = find_compiler()
    if not cc:
        raise KernelUnavailable("no C compiler (gcc) on PATH to build it")
    isa = isa or kernel_isa() or "avx512"
    path = out_dir / library_name(isa)
    if not path.exists():
        log.info("building the fused CPU decoder kernel (%s) into %s", isa, path)
        _build(cc, path, isa)
    return path


def load_library(cache_dir: Path, isa: str | None = None) -> ctypes.CDLL:
    """The kernel library: prebuilt next to the source (container images), else
    built once into cache_dir/kernels.  ``isa`` picks a build other than the
    best one this CPU runs (tests); the CPU must still support it."""
    reason = cpu_unsupported_reason()
    if reason:
        raise KernelUnavailable(reason)
    if isa is None:
        isa = kernel_isa()
    elif isa not in ISAS or not set(ISAS[isa][1]) <= cpu_flags():
        raise KernelUnavailable(f"the CPU cannot run the {isa} build")
    assert isa is not None
    prebuilt = SOURCE.parent / library_name(isa)
    lib_path = prebuilt if prebuilt.exists() else build_library(cache_dir / "kernels", isa)
    # torch (imported above) has loaded its libgomp.so.1; the kernel library's
    # DT_NEEDED entry resolves to that same OpenMP runtime and thread pool.
    lib = ctypes.CDLL(str(lib_path))
    if lib.ss_abi_version() != ABI_VERSION:
        raise KernelUnavailable(f"{lib_path} has ABI {lib.ss_abi_version()}, expected {ABI_VERSION}")
    P, I32 = ctypes.c_void_p, ctypes.c_int
    for name, args, res in [
        ("ss_forward", [P, I32, P, I32, P, P, I32, P, P, P, P, P, P], I32),
        ("ss_head_layer", [P, I32, I32, P, P, I32, P, P, I32, P, P, P], I32),
        ("ss_eagle3_layer", [P, I32, P, P, I32, P, P, I32, P, P, I32, P, P, I32, P, P, P], I32),
        ("ss_norm_logits", [P, P, I32, P], I32),
        ("ss_eagle3_chain", [P, I32, P, P, P, I32, P, P, I32, P, P, I32, P, I32, P], I32),
        ("ss_logits", [P, P, I32, P], I32),
        ("ss_matmul", [P, I32, P, P, I32, I32, P, P], I32),
        ("ss_pack_amx", [P, I32, I32, P], I32),
        ("ss_amx_packed_elems", [I32, I32], ctypes.c_long),
        ("ss_amx_init", [], I32),
        ("ss_set_num_threads", [I32], I32),
        ("ss_isa", [], ctypes.c_char_p),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    built = lib.ss_isa().decode()
    if built != isa:
        raise KernelUnavailable(f"{lib_path} is the {built} build, expected {isa}")
    log.info("fused CPU decoder: %s build (%s)", isa, lib_path.name)
    return lib


def library_isa(lib: ctypes.CDLL) -> str:
    """Which build a loaded library is: "avx512" or "avx2"."""
    return lib.ss_isa().decode()


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "wqkv", "bqkv", "ln1", "ln2", "qnorm", "knorm", "wo", "wgu", "wdown", "kcache", "vcache",
            "wqkv_p", "wo_p", "wgu_p", "wdown_p",
        )
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int32)
            for name in (
                "hidden", "inter", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "block_size", "window", "n_positions", "reserved",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("embed", "final_norm", "cos", "sin", "layers", "lm_head", "lm_head_p")],
        ("vocab", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]  # fmt: skip


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def amx_usable(lib: ctypes.CDLL) -> bool:
    """AMX tiles exist and Linux granted this process the tile state."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags() and lib.ss_amx_init() == 0


def pack_amx(lib: ctypes.CDLL, w: Tensor) -> Tensor:
    """w (N, K) bf16 -> the AMX tile layout of cpu_decoder.c (N padded to 16, K to 32)."""
    w = w.detach().to(torch.bfloat16).contiguous()
    N, K = w.shape
    out = torch.empty(lib.ss_amx_packed_elems(N, K), dtype=torch.bfloat16)
    lib.ss_pack_amx(_ptr(w), N, K, _ptr(out))
    return out


def matmul(lib: ctypes.CDLL, x: Tensor, w: Tensor, packed: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """x (M, K) bf16 @ w (N, K) bf16 ^T (+ fp32 bias) -> (M, N) fp32, through AMX
    when ``packed`` (``pack_amx(w)``) is given (for tests and benchmarks)."""
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    lib.ss_matmul(_ptr(x), M, _ptr(w), _ptr(packed), N, K, _ptr(b), _ptr(y))
    return y


class FusedLinear(torch.nn.Module):
    """A bf16 ``nn.Linear`` whose forward is the fused decoder's matmul (``ss_matmul``:
    AVX2 / AVX512-BF16 GEMV with fp32 accumulation, AMX tiles where usable), for the
    small networks that run beside the fused target (an EAGLE head's layer and LM
    head): torch's own bf16 matmul on a CPU without native bf16 is several times
    slower.  Inputs are rounded to bf16 (as the fused decoder's activations are);
    the output is float32 with ``fp32_out`` (logits), else the input's dtype."""

    def __init__(self, lib: ctypes.CDLL, linear: torch.nn.Linear, fp32_out: bool = False):
        super().__init__()
        self.lib = lib
        self.fp32_out = fp32_out
        w = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        b = getattr(linear, "bias", None)
        self.bias = None if b is None else torch.nn.Parameter(b.detach().float().contiguous(), requires_grad=False)
        self.packed = pack_amx(lib, w) if amx_usable(lib) else None
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        M, N = x2.shape[0], self.out_features
        y = torch.empty(M, N, dtype=torch.float32)
        if M:
            self.lib.ss_matmul(_ptr(x2), M, _ptr(self.weight), _ptr(self.packed), N, self.in_features,
                               _ptr(self.bias), _ptr(y))
        y = y.view(*lead, N)
        return y if self.fp32_out else y.to(x.dtype)


def fuse_linears(module: torch.nn.Module, lib: ctypes.CDLL, fp32_out: Sequence[str] = ()) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``FusedLinear`` (names in
    ``fp32_out`` return float32); returns how many were replaced."""
    n = 0
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is torch.nn.Linear:
                full = f"{name}.{attr}" if name else attr
                setattr(child, attr, FusedLinear(lib, sub, fp32_out=full in fp32_out))
                n += 1
    return n


@dataclass
class FusedStepArgs:
    """A step's layout as the fused kernels read it: per sequence (offset on the token
    axis, new tokens, tokens already cached) and its block table (padded to one width),
    the tokens' rotary positions, and the draft-tree fields of ``executor.batch`` (both
    None without trees)."""

    info: Tensor  # (B, 3) int32
    tables: Tensor  # (B, width) int32
    positions: Tensor | None  # (T,) int32, None: start + i
    tree_base: Tensor | None  # (B,) int32
    tree_masks: Tensor | None  # (T,) int64
    num_tokens: int

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, int]], block_tables: Sequence[Sequence[int]],
              positions: Sequence[int] | None = None, tree_base: Sequence[int] | None = None,
              tree_masks: Sequence[int] | None = None) -> "FusedStepArgs":
        width = max(len(bt) for bt in block_tables) or 1
        return cls(
            info=torch.tensor(seqs, dtype=torch.int32).view(len(seqs), 3),
            tables=_padded_tables(block_tables, width),
            positions=None if positions is None else torch.tensor(positions, dtype=torch.int32),
            tree_base=None if tree_base is None else torch.tensor(tree_base, dtype=torch.int32),
            tree_masks=None if tree_masks is None else torch.tensor(int64_masks(list(tree_masks)), dtype=torch.int64),
            num_tokens=sum(n for _, n, _ in seqs),
        )

    @classmethod
    def from_batch(cls, batch: Any) -> "FusedStepArgs":
        """From a ``StepBatch`` (its positions, trees and block tables as they are)."""
        qs = batch.query_start
        seqs = [(qs[b], qs[b + 1] - qs[b], batch.seq_lens[b] - (qs[b + 1] - qs[b])) for b in range(batch.num_seqs)]
        return cls.build(seqs, batch.block_tables, batch.positions, batch.tree_base, batch.tree_masks)

    def pointers(self) -> tuple:
        """(seq info, tables, width, positions, tree base, tree masks) for a C call."""
        return (_ptr(self.info), _ptr(self.tables), self.tables.shape[1], _ptr(self.positions),
                _ptr(self.tree_base), _ptr(self.tree_masks))


def _padded_tables(block_tables: Sequence[Sequence[int]], width: int) -> Tensor:
    """(B, width) int32 block tables, each row padded with zeros."""
    return torch.tensor([[*bt, *[0] * (width - len(bt))] for bt in block_tables], dtype=torch.int32)


def _check_rc(rc: int) -> None:
    if rc == -4:
        raise MemoryError("fused CPU decoder: out of memory for this step's buffers")
    if rc != 0:
        what = {-1: "model shape", -2: "sequence layout or block tables", -3: "a token id outside the vocabulary"}
        raise ValueError(f"fused CPU decoder rejected its inputs: {what.get(rc, rc)}")


class _Owned:
    """Keeps every tensor the C side points into alive, in the layouts it reads."""

    def __init__(self, lib: ctypes.CDLL, use_amx: bool):
        self.lib, self.use_amx = lib, use_amx
        self.keep: list[Tensor] = []

    def bf16(self, t: Tensor) -> Tensor:
        t = t.detach().to(torch.bfloat16).contiguous()
        self.keep.append(t)
        return t

    def packed(self, t: Tensor, lin: Any = None) -> int | None:
        """``t`` packed for AMX (None without AMX); a ``FusedLinear`` ``lin`` of the same
        weight lends its packed copy."""
        if not self.use_amx:
            return None
        p = getattr(lin, "packed", None)
        if p is None:
            p = pack_amx(self.lib, t)
        self.keep.append(p)
        return p.data_ptr()

    def f32(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def layer(self, layer: Any, k_cache: Tensor, v_cache: Tensor, input_norm: Any, qk_norm: bool) -> "_Layer":
        """A decoder layer's ``_Layer`` (q/k/v and gate/up fused, as ``llama.DecoderLayer``
        and ``eagle.HeadLayer`` hold them) over its cache layer."""
        wqkv, wo = self.bf16(_weight(layer.qkv_proj)), self.bf16(_weight(layer.o_proj))
        wgu, wdown = self.bf16(_weight(layer.gate_up_proj)), self.bf16(_weight(layer.down_proj))
        return _Layer(
            wqkv=wqkv.data_ptr(), bqkv=self.f32(_bias(layer.qkv_proj)),
            ln1=self.f32(input_norm.weight) if input_norm is not None else None,
            ln2=self.f32(layer.post_attention_layernorm.weight),
            qnorm=self.f32(layer.q_norm.weight) if qk_norm else None,
            knorm=self.f32(layer.k_norm.weight) if qk_norm else None,
            wo=wo.data_ptr(), wgu=wgu.data_ptr(), wdown=wdown.data_ptr(),
            kcache=k_cache.data_ptr(), vcache=v_cache.data_ptr(),
            wqkv_p=self.packed(wqkv, layer.qkv_proj), wo_p=self.packed(wo, layer.o_proj),
            wgu_p=self.packed(wgu, layer.gate_up_proj), wdown_p=self.packed(wdown, layer.down_proj),
        )  # fmt: skip


class CpuDecoder:
    """The fused decoder for one bf16 ``LlamaModel`` and its KV cache."""

    def __init__(self, lib: ctypes.CDLL, model: Any, kv: Any, num_positions: int, use_amx: bool | None = None):
        a = model.a
        if kv.data.dtype != torch.bfloat16:
            raise KernelUnavailable("the fused CPU decoder needs a bfloat16 KV cache")
        cos, sin = model.rotary.cos, model.rotary.sin
        if cos.shape[1] * 2 != a.head_dim:
            raise KernelUnavailable("partial rotary embeddings are not supported by the fused CPU decoder")
        self.lib = lib
        self.a = a
        # AMX runs every decode-sized matmul (1..32 rows) from a packed copy of the
        # projections; without it, the AVX512-BF16 (or AVX2) GEMV reads the torch
        # weights.  The AVX2 build has no AMX (ss_amx_init fails there).
        self.use_amx = amx_usable(lib) if use_amx is None else use_amx
        own = _Owned(lib, self.use_amx)  # owns every buffer the C side points into
        self._layers = (_Layer * a.num_layers)()
        for i, layer in enumerate(model.layers):
            self._layers[i] = own.layer(layer, *kv.layer(i), layer.input_layernorm, a.qk_norm)
        self.embed = own.bf16(model.embed_tokens.weight)
        head = model.embed_tokens.weight if model.lm_head is None else _weight(model.lm_head)
        self.lm_head = own.bf16(head)
        self._model = _Model(
            hidden=a.hidden_size,
            inter=a.intermediate_size,
            n_layers=a.num_layers,
            n_heads=a.num_heads,
            n_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            block_size=kv.block_size,
            window=a.sliding_window or 0,
            n_positions=min(num_positions, cos.shape[0]),
            reserved=0,
            eps=a.rms_norm_eps,
            scale=a.head_dim**-0.5,
            embed=self.embed.data_ptr(),
            final_norm=own.f32(model.norm.weight),
            cos=own.f32(cos),
            sin=own.f32(sin),
            layers=ctypes.addressof(self._layers),
            lm_head=self.lm_head.data_ptr(),
            lm_head_p=own.packed(self.lm_head),
            vocab=self.lm_head.shape[0],
            pad=0,
        )
        self._keep = own.keep

    def forward(
        self,
        input_ids: Sequence[int],
        seqs: Sequence[tuple[int, int, int]],  # per sequence: (t offset, new tokens, tokens already cached)
        block_tables: Sequence[Sequence[int]],
        aux_layer_ids: tuple[int, ...] = (),
        positions: Sequence[int] | None = None,
        tree_base: Sequence[int] | None = None,
        tree_masks: Sequence[int] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run the stack; token i of a sequence sits at context index start + i.
        ``positions`` (T,): rotary positions (default start + i); ``tree_base`` (B,) and
        ``tree_masks`` (T,): draft trees, the rule of ``executor.batch`` (both or neither)."""
        return self.run(input_ids, FusedStepArgs.build(seqs, block_tables, positions, tree_base, tree_masks),
                        aux_layer_ids)

    def run(self, input_ids: Sequence[int], step: FusedStepArgs, aux_layer_ids: tuple[int, ...] = (),
            input_embeds: Sequence[tuple[int, Tensor]] | None = None) -> tuple[Tensor, dict[int, Tensor]]:
        """``forward`` over a step's layout already built (``FusedStepArgs.from_batch``):
        the final-normed hidden states (T, H) and the residual streams entering
        ``aux_layer_ids``, float32.  ``input_embeds``: (first row on T, (n, H)
        embeddings) pairs replacing those rows' token embeddings, rounded to bf16 and
        scaled by the model's embedding multiplier as the torch path does
        (``StepBatch.input_embeds``)."""
        T, H = len(input_ids), self.a.hidden_size
        ids = torch.tensor(input_ids, dtype=torch.int64)
        x_in = None
        if input_embeds:
            x_in = self.embed[ids].float()
            mult = self.a.embedding_multiplier
            for row, rows in input_embeds:
                src = rows.to(dtype=torch.bfloat16)
                x_in[row : row + src.shape[0]] = (src * mult if mult != 1.0 else src).float()
        out = torch.empty(T, H, dtype=torch.float32)
        aux: dict[int, Tensor] = {}
        aux_ptrs = None
        if aux_layer_ids:
            arr = (ctypes.c_void_p * self.a.num_layers)()
            for i in aux_layer_ids:
                aux[i] = torch.empty(T, H, dtype=torch.float32)
                arr[i] = aux[i].data_ptr()
            aux_ptrs = ctypes.addressof(arr)
        info, tables, width, pos, base, masks = step.pointers()
        self.lib.ss_set_num_threads(torch.get_num_threads())  # per calling thread in OpenMP
        _check_rc(self.lib.ss_forward(ctypes.addressof(self._model), T, _ptr(ids), step.info.shape[0], info, tables,
                                      width, _ptr(out), aux_ptrs, pos, base, masks, _ptr(x_in)))
        return out, aux

    def logits(self, hidden: Tensor) -> Tensor:
        h = hidden.float().contiguous()
        N = h.shape[0]
        out = torch.empty(N, self.lm_head.shape[0], dtype=torch.float32)
        self.lib.ss_set_num_threads(torch.get_num_threads())
        self.lib.ss_logits(ctypes.addressof(self._model), _ptr(h), N, _ptr(out))
        return out


class FusedHead:
    """A draft head's decoder layer (``models.eagle.HeadLayer``: q/k/v and gate/up fused,
    no q/k norm) in one C call over the head's paged cache layer: q/k/v from the
    attention input, rotary, the K/V write, attention (draft trees included), o, the
    MLP, with the residual stream in float32 inside the layer.

    ``__call__`` takes the attention input the head built (``ss_head_layer``).  Given
    ``eagle3`` (the embeddings (V, H), the layer's input norm and hidden norm weights and
    ``norm_before_residual``), ``eagle3_layer`` builds EAGLE-3's input in the same call
    (``ss_eagle3_layer``); given ``lm_head`` (draft vocabulary rows) and ``final_norm``,
    ``logits`` is the head's norm and LM head (``ss_norm_logits``)."""

    def __init__(self, lib: ctypes.CDLL, layer: Any, rotary: Any, kv: tuple[Tensor, Tensor], block_size: int, *,
                 hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rms_norm_eps: float, num_positions: int, window: int | None = None, use_amx: bool | None = None,
                 eagle3: tuple[Tensor, Tensor, Tensor, bool] | None = None, final_norm: Tensor | None = None,
                 lm_head: Any = None):
        k_cache, v_cache = kv
        if k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16:
            raise KernelUnavailable("the fused head layer needs a bfloat16 KV cache")
        if getattr(layer, "q_norm", None) is not None:
            raise KernelUnavailable("the fused head layer has no q/k norm")
        cos, sin = rotary.cos, rotary.sin
        if cos.shape[1] * 2 != head_dim:
            raise KernelUnavailable("partial rotary embeddings are not supported by the fused CPU decoder")
        self.lib = lib
        self.hidden_size = hidden_size
        self.in_features = _weight(layer.qkv_proj).shape[1]
        own = _Owned(lib, amx_usable(lib) if use_amx is None else use_amx)
        self._layers = (_Layer * 1)(own.layer(layer, k_cache, v_cache, None, False))
        self.eagle3 = None
        if eagle3 is not None:
            embed, ln_in, hnorm, norm_before_residual = eagle3
            if self.in_features != 2 * hidden_size:
                raise KernelUnavailable(f"an EAGLE-3 layer reads 2 x {hidden_size} inputs, not {self.in_features}")
            table = own.bf16(embed)
            self.eagle3 = (table.data_ptr(), table.shape[0], own.f32(ln_in), own.f32(hnorm), int(norm_before_residual))
        self.vocab = 0
        head_w = None
        if lm_head is not None:
            head_w = own.bf16(_weight(lm_head))
            self.vocab = head_w.shape[0]
        self._model = _Model(
            hidden=hidden_size, inter=intermediate_size, n_layers=1, n_heads=num_heads, n_kv_heads=num_kv_heads,
            head_dim=head_dim, block_size=block_size, window=window or 0,
            n_positions=min(num_positions, cos.shape[0]), reserved=0, eps=rms_norm_eps, scale=head_dim**-0.5,
            embed=None, final_norm=own.f32(final_norm), cos=own.f32(cos), sin=own.f32(sin),
            layers=ctypes.addressof(self._layers), lm_head=_ptr(head_w),
            lm_head_p=own.packed(head_w, lm_head) if head_w is not None else None, vocab=self.vocab, pad=0,
        )  # fmt: skip
        self._keep = own.keep

    def _check(self, T: int, residual: Tensor, step: FusedStepArgs) -> None:
        if residual.shape != (T, self.hidden_size) or step.num_tokens != T:
            raise ValueError(f"fused head layer: {T} rows and {tuple(residual.shape)} residuals for a step of "
                             f"{step.num_tokens} tokens")

    def __call__(self, x_in: Tensor, residual: Tensor, step: FusedStepArgs) -> Tensor:
        """x_in (T, in_features): what q/k/v read; residual (T, H).  Returns the layer's
        output (T, H) float32 (before any final norm)."""
        T = x_in.shape[0]
        self._check(T, residual, step)
        if x_in.shape[1] != self.in_features:
            raise ValueError(f"fused head layer: inputs of {x_in.shape[1]} features, expected {self.in_features}")
        xin = x_in.to(torch.bfloat16).contiguous()
        x = torch.empty(T, self.hidden_size, dtype=torch.float32).copy_(residual)  # the C call writes it
        info, tables, width, pos, base, masks = step.pointers()
        self.lib.ss_set_num_threads(torch.get_num_threads())
        _check_rc(self.lib.ss_head_layer(ctypes.addressof(self._model), self.in_features, T, _ptr(xin), _ptr(x),
                                         step.info.shape[0], info, tables, width, pos, base, masks))
        return x

    def eagle3_layer(self, ids: Tensor, hidden: Tensor, step: FusedStepArgs) -> Tensor:
        """An EAGLE-3 step from its tokens (T,) and hidden input (T, H): the layer's output
        (T, H) float32."""
        if self.eagle3 is None:
            raise ValueError("fused head layer: built without EAGLE-3's inputs")
        T = ids.shape[0]
        self._check(T, hidden, step)
        table, vocab, ln_in, hnorm, nbr = self.eagle3
        g = hidden.to(torch.bfloat16).contiguous()
        tok = ids.to(torch.int64).contiguous()
        x = torch.empty(T, self.hidden_size, dtype=torch.float32)
        info, tables, width, pos, base, masks = step.pointers()
        self.lib.ss_set_num_threads(torch.get_num_threads())
        _check_rc(self.lib.ss_eagle3_layer(ctypes.addressof(self._model), T, _ptr(tok), table, vocab, ln_in, hnorm,
                                           nbr, _ptr(g), _ptr(x), step.info.shape[0], info, tables, width, pos,
                                           base, masks))
        return x

    @property
    def has_logits(self) -> bool:
        return self.vocab > 0

    def logits(self, out: Tensor) -> Tensor:
        """(N, H) layer outputs -> (N, draft vocabulary) float32 logits."""
        if not self.has_logits:
            raise ValueError("fused head layer: built without an LM head")
        x = out.float().contiguous()
        N = x.shape[0]
        y = torch.empty(N, self.vocab, dtype=torch.float32)
        self.lib.ss_set_num_threads(torch.get_num_threads())
        _check_rc(self.lib.ss_norm_logits(ctypes.addressof(self._model), _ptr(x), N, _ptr(y)))
        return y


class FusedHeadChain:
    """A fused EAGLE-3 head's greedy draft chains, every column in one C call
    (``ss_eagle3_chain``): the eager loop's logits, argmax, draft-to-target map and
    layer steps, with no Python between columns.  ``draft`` has ``HeadDraftGraphs``'
    contract (the proposer's ``static``): the head's bf16 states at each row's last
    real position and (last position, drafts wanted, block table) per row."""

    max_num_seqs = 1 << 30  # no buffers to outgrow: any batch drafts here

    def __init__(self, fused: "FusedHead", draft_to_target: Tensor | None, num_spec_tokens: int):
        if fused.eagle3 is None or not fused.has_logits:
            raise KernelUnavailable("a fused draft chain needs an EAGLE-3 head with its own LM head")
        self.fused = fused
        self.d2t = None if draft_to_target is None else draft_to_target.to(torch.int64).contiguous()
        self.K = num_spec_tokens

    def draft(self, hidden: Tensor, rows: Sequence[tuple[int, int, Sequence[int]]]) -> list[list[int]]:
        B = len(rows)
        if B == 0:
            return []
        f, K = self.fused, self.K
        want = torch.tensor([w for _, w, _ in rows], dtype=torch.int32)
        if int(want.max()) > K:
            raise ValueError(f"fused draft chain: {int(want.max())} drafts wanted, at most {K}")
        last = torch.tensor([p for p, _, _ in rows], dtype=torch.int32)
        width = max(len(t) for _, _, t in rows) or 1
        tables = _padded_tables([t for _, _, t in rows], width)
        g = hidden.to(torch.bfloat16).contiguous()
        if g.shape != (B, f.hidden_size):
            raise ValueError(f"fused draft chain: states {tuple(g.shape)} for {B} rows")
        out = torch.zeros(B, K, dtype=torch.int64)
        table, vocab, ln_in, hnorm, nbr = f.eagle3
        f.lib.ss_set_num_threads(torch.get_num_threads())
        _check_rc(f.lib.ss_eagle3_chain(ctypes.addressof(f._model), B, _ptr(want), _ptr(last), _ptr(tables), width,
                                        _ptr(g), table, vocab, ln_in, hnorm, nbr, _ptr(self.d2t), K, _ptr(out)))
        return [d[:w] for d, (_, w, _) in zip(out.tolist(), rows)]


def _weight(lin: Any) -> Tensor:
    w = getattr(lin, "weight", None)
    if w is None:
        raise KernelUnavailable("the model was already pre-packed for the torch path")
    return w


def _bias(lin: Any) -> Tensor | None:
    return getattr(lin, "bias", None)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specserve.kernels.cpu_decoder [DIR]``: build every ISA's
    library (AVX512, AVX2) into DIR (default: next to the source, where
    ``load_library`` looks first), so an image built on one CPU serves both."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    out = Path(args[0]) if args else SOURCE.parent
    for isa in ISAS:
        print(build_library(out, isa))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
