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
``logits`` is the LM head.  Torch tensors stay the owners of all memory; the
C side only sees their data pointers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import tempfile
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

ABI_VERSION = 4


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
        ("ss_forward", [P, I32, P, I32, P, P, I32, P, P, P, P, P], I32),
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
        keep: list[Tensor] = []  # owns every buffer the C side points into

        def bf16(t: Tensor) -> Tensor:
            t = t.detach().to(torch.bfloat16).contiguous()
            keep.append(t)
            return t

        def packed(t: Tensor) -> int | None:
            if not self.use_amx:
                return None
            p = pack_amx(lib, t)
            keep.append(p)
            return p.data_ptr()

        def f32(t: Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        self._layers = (_Layer * a.num_layers)()
        for i, layer in enumerate(model.layers):
            k_cache, v_cache = kv.layer(i)
            wqkv, wo = bf16(_weight(layer.qkv_proj)), bf16(_weight(layer.o_proj))
            wgu, wdown = bf16(_weight(layer.gate_up_proj)), bf16(_weight(layer.down_proj))
            self._layers[i] = _Layer(
                wqkv=wqkv.data_ptr(),
                bqkv=f32(_bias(layer.qkv_proj)),
                ln1=f32(layer.input_layernorm.weight),
                ln2=f32(layer.post_attention_layernorm.weight),
                qnorm=f32(layer.q_norm.weight) if a.qk_norm else None,
                knorm=f32(layer.k_norm.weight) if a.qk_norm else None,
                wo=wo.data_ptr(),
                wgu=wgu.data_ptr(),
                wdown=wdown.data_ptr(),
                kcache=k_cache.data_ptr(),
                vcache=v_cache.data_ptr(),
                wqkv_p=packed(wqkv),
                wo_p=packed(wo),
                wgu_p=packed(wgu),
                wdown_p=packed(wdown),
            )
        self.embed = bf16(model.embed_tokens.weight)
        head = model.embed_tokens.weight if model.lm_head is None else _weight(model.lm_head)
        self.lm_head = bf16(head)
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
            final_norm=f32(model.norm.weight),
            cos=f32(cos),
            sin=f32(sin),
            layers=ctypes.addressof(self._layers),
            lm_head=self.lm_head.data_ptr(),
            lm_head_p=packed(self.lm_head),
            vocab=self.lm_head.shape[0],
            pad=0,
        )
        self._keep = keep

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
        T, H = len(input_ids), self.a.hidden_size
        ids = torch.tensor(input_ids, dtype=torch.int64)
        info = torch.tensor(seqs, dtype=torch.int32)
        width = max(len(bt) for bt in block_tables)
        tables = torch.tensor([[*bt, *[0] * (width - len(bt))] for bt in block_tables], dtype=torch.int32)
        out = torch.empty(T, H, dtype=torch.float32)
        aux: dict[int, Tensor] = {}
        aux_ptrs = None
        if aux_layer_ids:
            arr = (ctypes.c_void_p * self.a.num_layers)()
            for i in aux_layer_ids:
                aux[i] = torch.empty(T, H, dtype=torch.float32)
                arr[i] = aux[i].data_ptr()
            aux_ptrs = ctypes.addressof(arr)
        pos = None if positions is None else torch.tensor(positions, dtype=torch.int32)
        base = None if tree_base is None else torch.tensor(tree_base, dtype=torch.int32)
        masks = None if tree_masks is None else torch.tensor(int64_masks(list(tree_masks)), dtype=torch.int64)
        self.lib.ss_set_num_threads(torch.get_num_threads())  # per calling thread in OpenMP
        rc = self.lib.ss_forward(
            ctypes.addressof(self._model), T, _ptr(ids), len(seqs), _ptr(info), _ptr(tables), width,
            _ptr(out), aux_ptrs, _ptr(pos), _ptr(base), _ptr(masks),
        )  # fmt: skip
        if rc == -4:
            raise MemoryError("fused CPU decoder: out of memory for this step's buffers")
        if rc != 0:
            what = {-1: "model shape", -2: "sequence layout or block tables", -3: "a token id outside the vocabulary"}
            raise ValueError(f"fused CPU decoder rejected its inputs: {what.get(rc, rc)}")
        return out, aux

    def logits(self, hidden: Tensor) -> Tensor:
        h = hidden.float().contiguous()
        N = h.shape[0]
        out = torch.empty(N, self.lm_head.shape[0], dtype=torch.float32)
        self.lib.ss_set_num_threads(torch.get_num_threads())
        self.lib.ss_logits(ctypes.addressof(self._model), _ptr(h), N, _ptr(out))
        return out


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
