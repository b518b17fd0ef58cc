"""CPU linear layers on prepacked weights, so a forward of 2–16 rows costs about what one row costs.

PyTorch's default fp32 CPU matmul re-packs the weight matrix on every call and picks a slower kernel for a few
rows than for one, so on a bandwidth-bound decode step verifying k > 1 rows cost ~1.7x one row. Packing each
`nn.Linear`'s weight once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) and calling
`torch.ops.mkldnn._linear_pointwise` removes most of that, and makes the one-row step faster too. Sibling
projections that read the same input (q/k/v, gate/up) are packed as one matrix and computed by one call: fewer,
larger products keep both cores busy (`benchmarks/bench_step.py` measures all of this).

`packed_linears(model)` swaps the packed modules in for the duration of a generation and puts the original
`nn.Linear` modules back afterwards; the packed weights are built once per model and kept on it. A packed weight
whose source parameter changed in place (or was replaced) is re-packed before use, so stale weights are never
used. Only fp32 `nn.Linear` layers on the CPU are packed, when PyTorch has oneDNN; everything else is left as is.

Which kernel is fastest for a product of k rows depends on the CPU, so each packed weight computes with one of
three, by row count (`set_default_rows`, `set_streamed_rows`; measured per model and machine by
`row_kernels.row_kernels_for`): up to `default_rows` rows PyTorch's default matmul on the model's own weights
(exactly as the model's own linear layers compute them; MKL is quick for 1–3 rows on some Intel CPUs), up to
`streamed_rows` rows the streamed kernel (`streamed_gemm`: the weights streamed once for all the rows), larger
products (a prompt's prefill) the oneDNN-packed weight — or, when the streamed kernel computes the small products,
PyTorch's default matmul or oneDNN on the layers' own weights (`set_large_kernel`, measured too): oneDNN's layout
then is never built, which saves a full copy of the weights (the default model: 540 MB) and its packing time. (On
the Intel machine the default matmul's prefills took within ±5% of oneDNN's time; on an AMD Zen 5 CPU, where MKL
runs its AVX2 code, oneDNN's unpacked product took ~0.45x of its time.) Or, where every weight is held for the AMX
kernels (16 rows of a block-form weight for little more than one), the streamed kernel computes every row count
(`"streamed"`) when it measured faster there too (a 700-token prefill's products: 341 against 537 ms on the default
matmul, session 55). Each layout is built on first use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import affine_weights, amx_kernel, streamed_gemm

_CACHE_ATTR = "_lookahead_packed_linears"
# Sibling projections of one block that transformers' decoder layers call on the same input tensor.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LARGE_KERNELS = ("default", "onednn", "streamed")  # what computes products above the streamed kernel's rows


def packing_available(model: nn.Module) -> bool:
    """Whether `packed_linears` would pack anything: oneDNN present and an fp32 `nn.Linear` on the CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return any(_packable(module) for module in model.modules())


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True, compact: bool = True, amx: bool = True) -> Iterator[int]:
    """Within the block, every packable `nn.Linear` of `model` runs on prepacked weights; yields how many
    layers were swapped (0 when disabled or nothing is packable). The originals are restored on exit, also on
    error. Not re-entrant for the same model (a nested call swaps nothing more). `compact`: the streamed kernel
    holds weights that have an exact 4-bit or 8-bit block form in it (`affine_weights`), else always float32; `amx`:
    4-bit ones in the AMX kernel's layout where the CPU has AMX (`amx_kernel`), 8-bit ones in the AMX-INT8 kernel's
    where it has AMX-INT8 (`amx_int8`)."""
    if not enabled or not torch.backends.mkldnn.is_available() or getattr(model, "_lookahead_packed_on", False):
        yield 0
        return
    swaps = _packed_modules(model)
    for parent, name, packed in swaps:
        setattr(parent, name, packed)
    set_compact_weights(model, compact, amx)
    model._lookahead_packed_on = True
    try:
        yield len(swaps)
    finally:
        for parent, name, packed in swaps:
            setattr(parent, name, packed.linear)
        model._lookahead_packed_on = False
        set_default_rows(model, 0)
        set_streamed_rows(model, 0)
        set_large_kernel(model, "default")


def set_default_rows(model: nn.Module, rows: int) -> None:
    """Products of at most `rows` rows of `model`'s packed linear layers run PyTorch's default matmul on the
    layers' own weights (0: every product on the packed weights); recorded as `model._lookahead_default_rows`
    (the cost curve's cache key reads it). Raises `ValueError` for a negative count."""
    if rows < 0:
        raise ValueError(f"default-matmul rows must be >= 0, got {rows}")
    for packed in packed_weights(model):
        packed.default_rows = rows
    model._lookahead_default_rows = rows


def set_streamed_rows(model: nn.Module, rows: int) -> None:
    """Products of more than the default-matmul rows and at most `rows` rows of `model`'s packed linear layers
    run the streamed kernel (`streamed_gemm`; 0: none); recorded as `model._lookahead_streamed_rows` (the cost
    curve's cache key reads it). Raises `ValueError` for a negative count, or a positive one when the kernel is
    not available on this machine."""
    if rows < 0:
        raise ValueError(f"streamed-kernel rows must be >= 0, got {rows}")
    if rows and not streamed_gemm.available():
        raise ValueError("the streamed matmul kernel is not available on this machine (llvmlite or FMA missing)")
    for packed in packed_weights(model):
        packed.streamed_rows = rows
    model._lookahead_streamed_rows = rows


def set_large_kernel(model: nn.Module, kernel: str) -> None:
    """Products above the streamed kernel's rows of `model`'s packed linear layers (a prefill) run PyTorch's
    default matmul (`"default"`), oneDNN on the layers' own weights (`"onednn"`) or the streamed kernel too
    (`"streamed"`); recorded as `model._lookahead_large_kernel`. Raises `ValueError` for another name."""
    if kernel not in LARGE_KERNELS:
        raise ValueError(f"the large-product kernel must be one of {LARGE_KERNELS}, got {kernel!r}")
    for packed in packed_weights(model):
        packed.large = kernel
    model._lookahead_large_kernel = kernel


def set_compact_weights(model: nn.Module, compact: bool, amx: bool = True) -> None:
    """Whether the streamed kernel's panels of `model`'s packed weights hold weights with an exact block form in
    it (`affine_weights`; panels built the other way are dropped), and with `amx` in the AMX kernels' layouts
    where the CPU has AMX; recorded as `model._lookahead_compact_weights` (True, False or "amx": the cost
    curve's and the kernel choice's cache keys read it)."""
    for packed in packed_weights(model):
        if (packed.compact, packed.amx) != (compact, amx):
            packed.compact, packed.amx, packed.panels = compact, amx, None
    model._lookahead_compact_weights = "amx" if compact and amx and amx_kernel.available() else compact


def packed_weights(model: nn.Module) -> list["_PackedWeights"]:
    """Every distinct packed weight of `model` (one per packed layer or fused group), built if needed; empty
    when nothing is packable or oneDNN is missing."""
    if not torch.backends.mkldnn.is_available():
        return []
    found: dict[int, _PackedWeights] = {}
    for _, _, module in _packed_modules(model):
        packed = module.group.packed if isinstance(module, FusedMember) else module.packed
        found.setdefault(id(packed), packed)
    return list(found.values())


def _packable(module: nn.Module) -> bool:
    """An fp32 CPU `nn.Linear` holding a plain tensor (subclasses with their own forward, e.g. quantized layers,
    and tensor-parallel shards, whose weights are `DTensor`s, are left alone)."""
    return (type(module) is nn.Linear and type(module.weight.data) is torch.Tensor
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32)


def _packed_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, packed replacement) for every packable linear; built once and kept on `model`
    (the replacements re-pack themselves when their weights change)."""
    cached = model.__dict__.get(_CACHE_ATTR)
    if cached is None:
        cached = []
        for parent in model.modules():
            cached.extend(_pack_children(parent))
        model.__dict__[_CACHE_ATTR] = cached
    return cached


def _pack_children(parent: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Packed replacements for the packable direct children of `parent`, sibling groups fused."""
    children = {name: child for name, child in parent.named_children() if _packable(child)}
    swaps, grouped = [], set()
    for names in FUSED_GROUPS:
        members = [children.get(name) for name in names]
        if all(m is not None for m in members) and _fusable(members):
            group = FusedGroup(members)
            swaps.extend((parent, name, FusedMember(group, i)) for i, name in enumerate(names))
            grouped.update(names)
    swaps.extend((parent, name, PackedLinear(child)) for name, child in children.items() if name not in grouped)
    return swaps


def _fusable(members: list[nn.Linear]) -> bool:
    """Same input width and all with or all without bias."""
    return (len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1)


class _PackedWeights:
    """One weight built from one or more linears' weights (rows stacked), held in the layouts the products use:
    oneDNN's prepacked layout, the streamed kernel's panels and layouts other modules derive, each built on first
    use and rebuilt when any source parameter changed in place or was replaced."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self._parameters = [linear._parameters for linear in linears]  # replaced parameters land in these dicts
        self.stamp = None
        self.weight = self.bias = self.panels = None
        self.derived_layouts: dict = {}  # layouts other modules build from these weights (`derived`)
        self.default_rows = 0  # products of at most this many rows use the linears' own weights
        self.streamed_rows = 0  # products of more rows, up to this many, use the streamed kernel
        self.large = "default"  # above them (the streamed kernel in use): "default" matmul, "onednn" unpacked or
        # "streamed" (the streamed kernel for every row count)
        self.compact = True  # streamed panels in the weights' exact block form where they have one
        self.amx = True  # block forms in the AMX kernels' layouts where the CPU has AMX (4-bit) or AMX-INT8 (8-bit)

    def get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(oneDNN-packed weight, bias or None), fresh for the current parameters."""
        self._refresh()
        if self.weight is None:
            weight, self.bias = self._stacked()
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return self.weight, self.bias

    def streamed(self) -> streamed_gemm.StreamedWeight:
        """The weight (and bias) in the streamed kernel's panel layout, fresh for the current parameters."""
        self._refresh()
        if self.panels is None:
            weights = [m.weight for m in self.linears]
            self.panels = (affine_weights.pack_stacked(weights, self._bias(), self.amx) if self.compact
                           else streamed_gemm.pack_stacked(weights, self._bias()))
        return self.panels

    def derived(self, name: str, build):
        """The layout `name` another module builds from these weights with `build()` (e.g. `argmax_head`'s int8
        copy), built on first use and rebuilt, like the others, when a source parameter changed."""
        self._refresh()
        if name not in self.derived_layouts:
            self.derived_layouts[name] = build()
        return self.derived_layouts[name]

    def _refresh(self) -> None:
        """Drop every layout built from parameters that have changed since."""
        stamp = _stamp(self._parameters)
        if stamp != self.stamp:
            self.weight = self.bias = self.panels = None
            self.derived_layouts = {}
            self.stamp = stamp

    @torch.no_grad()
    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The source weights stacked [N_total, K] (contiguous) and biases [N_total] or None."""
        return torch.cat([m.weight.detach() for m in self.linears]).contiguous(), self._bias()

    def _bias(self) -> torch.Tensor | None:
        """The source biases stacked [N_total], or None when the linears have none."""
        if self.linears[0].bias is None:
            return None
        return torch.cat([m.bias.detach() for m in self.linears])


def weights_stamp(weights: list[_PackedWeights]) -> list[tuple[int, int]]:
    """Identity and in-place version of every source parameter of all `weights`, in one list: while it and their
    `panels` stay the same, `streamed()` returns the same panels (a check of many products at once)."""
    return _stamp([params for w in weights for params in w._parameters])


def _stamp(parameters: list[dict]) -> list[tuple[int, int]]:
    """Identity and in-place version of every parameter in `parameters` (the `_parameters` dicts of the source
    linears: weight and bias). Checked on every product, so read straight from the dicts, ~10x cheaper than
    attribute access."""
    return [(id(param), param._version) for params in parameters for param in params.values() if param is not None]


def _linear(x: torch.Tensor, packed: _PackedWeights) -> torch.Tensor:
    """x [..., K] → [..., N]: for at most `packed.default_rows` rows with PyTorch's default matmul
    (`default_product`), for at most `packed.streamed_rows` with the streamed kernel (`streamed_product`), else
    on the oneDNN-packed weight (`packed_product`) — or, when the streamed kernel is in use, the default matmul,
    oneDNN on the layers' own weights or the streamed kernel again (`packed.large`), so that oneDNN's copy of the
    weights is never made (see the module docstring)."""
    parts = linear_parts(x, packed)
    if parts is not None:
        return _joined(parts)
    rows = x.numel() // x.shape[-1]
    if rows <= packed.streamed_rows or (packed.streamed_rows and packed.large == "streamed"):
        return streamed_product(x, packed)
    return packed_product(x, packed)


def linear_parts(x: torch.Tensor, packed: _PackedWeights) -> list[torch.Tensor] | None:
    """Each source linear's product of x [..., K] on its own, in the order `packed` stacks them, when `_linear`
    computes them one by one — PyTorch's default matmul or oneDNN on the layers' own weights — so that a caller who
    splits the stacked output again can skip `_linear`'s concatenation (the default model's prefills: 0–4% shorter
    without it, docs/step-cost.md); None when `_linear` computes one stacked product (the streamed kernel, the
    packed weight)."""
    rows = x.numel() // x.shape[-1]
    if rows <= packed.default_rows:
        return _each(x, packed, F.linear)
    if rows <= packed.streamed_rows or not packed.streamed_rows or packed.large == "streamed":
        return None
    return _each(x, packed, _onednn_linear if packed.large == "onednn" else F.linear)


def streamed_product(x: torch.Tensor, packed: _PackedWeights) -> torch.Tensor:
    """x [..., K] → [..., N] with the streamed kernel (`streamed_gemm`)."""
    if x.dim() == 2:
        return streamed_gemm.product(x, packed.streamed())
    out = streamed_gemm.product(x.reshape(-1, x.shape[-1]), packed.streamed())
    return out.view(*x.shape[:-1], out.shape[-1])


def packed_product(x: torch.Tensor, packed: _PackedWeights) -> torch.Tensor:
    """x [..., K] → [..., N] on the packed weight (oneDNN)."""
    weight, bias = packed.get()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_product(x: torch.Tensor, packed: _PackedWeights) -> torch.Tensor:
    """x [..., K] → [..., N]: each source linear's own weight through oneDNN's product, unpacked (no copy of the
    weights is kept; a prompt's prefill on CPUs where MKL's default matmul takes a slower path, measured by
    `row_kernels`), outputs side by side as the packed weight stacks them."""
    return _side_by_side(x, packed, _onednn_linear)


def default_product(x: torch.Tensor, packed: _PackedWeights) -> torch.Tensor:
    """x [..., K] → [..., N]: each source linear's own weight through PyTorch's default matmul (the very call
    `nn.Linear` makes), outputs side by side as the packed weight stacks them."""
    return _side_by_side(x, packed, F.linear)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN's product on the unpacked weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight.detach(), None if bias is None else bias.detach(), "none",
                                              [], "")


def _side_by_side(x: torch.Tensor, packed: _PackedWeights, product) -> torch.Tensor:
    """`product(x, weight, bias)` of each source linear of `packed`, outputs concatenated along the last dimension
    in the order the packed weight stacks them."""
    return _joined(_each(x, packed, product))


def _joined(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The outputs of the source linears side by side along the last dimension (one alone as it is)."""
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def _each(x: torch.Tensor, packed: _PackedWeights, product) -> list[torch.Tensor]:
    """`product(x, weight, bias)` of each source linear of `packed`, in the order the packed weight stacks them."""
    return [product(x, linear.weight, linear.bias) for linear in packed.linears]


class PackedLinear(nn.Module):
    """Drop-in for one `nn.Linear` (same input and output) computed with a prepacked weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        object.__setattr__(self, "linear", linear)  # not a submodule: its parameters are registered below
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: state_dict keys unchanged
        self.packed = _PackedWeights([linear])
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] → [..., out]."""
        if x.dtype != torch.float32 or x.requires_grad:
            return self.linear(x)
        return _linear(x, self.packed)


class FusedGroup:
    """Sibling linears that read the same input, packed as one matrix: the first call with a new input computes
    all of them and the others take their slice of that result."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.packed = _PackedWeights(linears)
        bounds = [0]
        for linear in linears:
            bounds.append(bounds[-1] + linear.out_features)
        self.bounds = bounds
        self.key = None  # (input object, its version) of the held result
        self.result = None

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Member `index`'s output for x [..., in] → [..., out_index] (contiguous)."""
        key = (x, x._version)
        if self.key is None or self.key[0] is not x or self.key[1] != x._version:
            self.result, self.key = _linear(x, self.packed), key
        out = self.result[..., self.bounds[index]: self.bounds[index + 1]].contiguous()
        if index == len(self.linears) - 1:
            self.result = self.key = None  # every member has read it: do not hold activations
        return out


class FusedMember(nn.Module):
    """Drop-in for one linear of a `FusedGroup` (same input and output as the original)."""

    def __init__(self, group: FusedGroup, index: int):
        super().__init__()
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "linear", group.linears[index])
        self.weight, self.bias = self.linear.weight, self.linear.bias  # the same Parameters (see PackedLinear)
        self.index = index
        self.in_features, self.out_features = self.linear.in_features, self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] → [..., out]; a product of at most `default_rows` rows is this linear's own (the same
        numbers as its slice of the group's stacked default product, without computing the siblings' into it)."""
        if x.dtype != torch.float32 or x.requires_grad or x.numel() <= self.group.packed.default_rows * x.shape[-1]:
            return self.linear(x)
        return self.group.output(x, self.index)
