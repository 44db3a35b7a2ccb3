"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a linear's weight column by column, spreading each column's rounding error over the
columns not yet quantized so that the layer's output on the calibration inputs changes least.

For W [N, K] and inputs X [T, K] the layer-wise objective is ||X W^T - X Q^T||^2, whose Hessian in each row of
W is H = 2 X^T X / T [K, K] (the same for every row). With U the upper Cholesky factor of H^-1, quantizing
column j to q_j and updating the remaining columns by

    W[:, j+1:] -= ((W[:, j] - q_j) / U[j, j]) * U[j, j+1:]

is the optimal brain surgeon update (Frantar et al., eq. 2-4). Updates are applied lazily: inside a block of
`blocksize` columns immediately, to the columns after it once per block (one matmul instead of K outer
products).

Model level (`GPTQConfig.run`): the transformer blocks (`find_blocks`) are processed in order; each block's
H is collected from the inputs its linears receive when the earlier blocks are already quantized, and the
block's quantized outputs feed the next block, so memory holds one block's activations. Linears outside any
block (or a model with no ModuleList) are handled by one more pass over the whole model.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from affineq.algorithms._base import AlgorithmConfig, Precomputed
from affineq.algorithms._capture import (
    Stop,
    capture_inputs,
    find_blocks,
    record_linear_inputs,
    run_block,
)
from affineq.algorithms._routed import as_rows_by_input, capture_routed, down_inputs, rows_per_expert, up_name
from affineq.configs import (
    QuantConfig,
)
from affineq.eval import eval_mode
from affineq.expert_weights import expert_parameter_names, experts_transposed, is_expert_module, stack_experts
from affineq.model_inputs import call_model, progress
from affineq.tensor.affine import AffineQuantizedTensor
from affineq.tensor.spec import QParamOptions, QuantSpec

__all__ = ["GPTQConfig", "gptq_quantize", "Hessian"]


# -- the per-layer algorithm --------------------------------------------------------------------------------


class Hessian:
    """Running H = 2 X^T X / T over the rows x [T, K] of every input a layer receives.

    Each X^T X is computed in float32 (the matmul is the cost) and summed in float64, so thousands of
    calibration tokens add up without losing the small eigenvalues the Cholesky factor depends on."""

    def __init__(self, k: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor, xtx: torch.Tensor | None = None) -> None:
        """Add inputs x [..., K] (or their precomputed float32 X^T X, shared by layers with the same input)."""
        x = x.reshape(-1, x.shape[-1])
        if xtx is None:
            xtx = xtx_of(x)
        self.sum += xtx.to(self.sum.device, torch.float64)
        self.tokens += x.shape[0]

    def matrix(self) -> torch.Tensor:
        """H float64 [K, K] (all zero before any input)."""
        return self.sum * (2.0 / max(self.tokens, 1))


def xtx_of(x: torch.Tensor) -> torch.Tensor:
    """X^T X float32 [K, K] of x [T, K]."""
    x = x.reshape(-1, x.shape[-1]).float()
    return x.T @ x


def _inverse_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1, damp = percdamp * mean(diag H), in float64: H of a few
    thousand calibration tokens is close to singular (float32 Cholesky fails or loses the small directions
    GPTQ's updates follow), and float64 costs little at K of a few thousand. If the damped H is still not
    positive definite (e.g. duplicated inputs), the damping grows tenfold up to three times, with a warning."""
    k = h.shape[0]
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    damp = percdamp * float(torch.diagonal(h).mean())
    for attempt in range(4):
        factor, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                if attempt:
                    warnings.warn(f"GPTQ: the Hessian needed damping {damp:.3g} (percdamp x {10 ** attempt}) to "
                                  "be positive definite; more or more varied calibration data avoids this",
                                  stacklevel=3)
                return upper
        damp = max(damp * 10, 1e-8)
    raise ValueError("GPTQ: the calibration Hessian is not positive definite even with 1000x damping; pass "
                     "more calibration data or a larger percdamp")


class _GroupQParams:
    """The qparams of one group of columns (all rows), as the packing format stores them, and quantization of
    one column with them. The value of every code comes from a table the format itself dequantized (formats
    differ in float rounding, e.g. `dense` computes scale * u + offset), so the values GPTQ feeds back are
    exactly what the packed tensor dequantizes to; a column is rounded to the nearest entry of its row's
    (evenly spaced) table, a handful of small ops instead of the validated primitives (~100 us each), which
    matters over the K columns of every layer."""

    #: clip search: range shrink factors tried (1 down to 0.8) and the error norm, as the reference GPTQ
    #: code's `Quantizer(mse=True)`
    SHRINK = torch.linspace(1.0, 0.8, 21)[1:].tolist()
    NORM = 2.4

    def __init__(self, spec: QuantSpec, options: QParamOptions, n: int, clip_search: bool = False) -> None:
        self.spec, self.options, self.clip_search = spec, options, clip_search
        g = spec.block_size[1]
        self.levels = int(spec.quant_max - spec.quant_min + 1)
        self.copies = -(-self.levels // g)  # groups of g columns that hold every code once
        # a [n, copies * g] tensor of the real group size: every format that holds the weight holds it
        self.table_spec = spec.replace(shape=(n, self.copies * g))
        self.group_spec = spec.replace(shape=(n, g))
        codes = torch.arange(self.copies * g) % self.levels + spec.quant_min
        self.table_codes = codes.to(spec.target.container).expand(n, -1)

    def choose(self, w: torch.Tensor):
        """(scale, zero point, value table [N, levels] float32, lowest value, 1 / step) for the columns w [N, g]:
        min/max per row, as the base config would choose them, rounded as the format stores them. With
        `clip_search`, per row the range scaled by the SHRINK factor with the least sum |w - q(w)|^NORM."""
        best = self._choose(w)
        if not self.clip_search:
            return best
        err = self._error(w, best)
        for p in self.SHRINK:
            cand = self._choose(w * p)
            e = self._error(w, cand)
            better = e < err
            err = torch.where(better, e, err)
            best = tuple(None if b is None else torch.where(better.view(-1, *([1] * (b.dim() - 1))), c, b)
                         for b, c in zip(best, cand, strict=True))
        return best

    def _error(self, w: torch.Tensor, qparams) -> torch.Tensor:
        _, _, table, low, inv_step = qparams
        u = torch.round((w - low[:, None]) * inv_step[:, None]).clamp_(0, self.levels - 1).long()
        return (w - table.gather(1, u)).abs().pow(self.NORM).sum(1)

    def _choose(self, w: torch.Tensor):
        n = w.shape[0]
        scale, zp = AffineQuantizedTensor.stored_qparams(w, self.group_spec, self.options)
        rep = (lambda t: t.reshape(n, 1).expand(n, self.copies).contiguous())
        table = AffineQuantizedTensor.from_codes(
            self.table_codes.to(w.device), rep(scale), None if zp is None else rep(zp), self.table_spec
        ).dequantize()[:, :self.levels].float()
        inv_step = 1.0 / (table[:, 1] - table[:, 0]).clamp_min(torch.finfo(torch.float32).tiny)
        return scale.reshape(n), None if zp is None else zp.reshape(n), table, table[:, 0], inv_step

    def quantize(self, col: torch.Tensor, qparams) -> tuple[torch.Tensor, torch.Tensor]:
        """(unsigned codes u = q - quant_min [N] int64, their stored values float32 [N]) of column col [N]."""
        _, _, table, low, inv_step = qparams
        u = torch.round((col - low) * inv_step).clamp_(0, self.levels - 1).long()
        return u, table.gather(1, u.unsqueeze(1)).squeeze(1)


@contextlib.contextmanager
def _one_thread():
    """Run the column loop on one thread: its ops touch ~100 kB each, where splitting them across threads
    costs more in synchronisation than it saves (10x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    options: QParamOptions | None = None,
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
    clip_search: bool = False,
) -> tuple[AffineQuantizedTensor, torch.Tensor]:
    """GPTQ one weight [N, K] (block size (1, g) or (1, K) in `spec`) with H [K, K] (`Hessian.matrix()`).

    Returns (the packed AffineQuantizedTensor, the quantized weight [N, K] in weight.dtype); the tensor dequantizes to
    exactly that weight. Group qparams come from min/max of each group (per `spec` and `options`, the base
    config's choice), taken from the weights as GPTQ has updated them when the group is reached, or from the
    original weights with `static_groups` (required with `act_order` and groups, so every group keeps its
    contiguous columns in the stored layout while columns are processed in order of decreasing diag(H)).
    `clip_search`: each group's range is shrunk (per row) where that lowers sum |w - q(w)|^2.4.
    Columns whose input was always zero (diag H = 0) get round-to-nearest and pass no error on (the reference
    zeroes them; inputs at inference need not be zero there). Math in float32, the Cholesky in float64."""
    n, k = weight.shape
    g = spec.block_size[1]
    if len(spec.block_size) != 2 or spec.block_size[0] != 1 or k % g:
        raise ValueError(f"GPTQ needs a 2-D weight with block size (1, g); got block size {spec.block_size} for "
                         f"shape {tuple(weight.shape)}")
    options = options or QParamOptions()
    w = weight.detach().float().clone()
    h = hessian.detach().to(w.device, torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    grouped = g < k
    static = static_groups or act_order or not grouped  # per-row qparams come from the whole original row
    qp = _GroupQParams(spec, options, n, clip_search)
    groups: list = [None] * (k // g)  # (scale [N], zero point [N] or None, value table [N, levels]) per group
    if static:
        for gi in range(k // g):
            groups[gi] = qp.choose(w[:, gi * g:(gi + 1) * g])

    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    with _one_thread():
        hinv = _inverse_cholesky(h, percdamp).float()
    if not static:  # a group must not straddle two lazy blocks: its qparams are chosen from fully updated columns
        blocksize = math.ceil(max(blocksize, g) / g) * g
    order = perm.tolist() if perm is not None else list(range(k))

    q = torch.zeros_like(w)
    codes = torch.zeros(n, k, dtype=torch.int64, device=w.device)  # u = q - quant_min
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        with _one_thread():
            for i in range(i2 - i1):
                col = order[i1 + i]
                gi = col // g
                if not static and col % g == 0:
                    groups[gi] = qp.choose(w1[:, i:i + g])
                c, dq = qp.quantize(w1[:, i], groups[gi])
                codes[:, i1 + i], q[:, i1 + i] = c, dq
                e = (w1[:, i] - dq) / h1[i, i]
                w1[:, i:].addr_(e, h1[i, i:], alpha=-1.0)
                err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if perm is not None:
        inv = torch.argsort(perm)
        q, codes = q[:, inv], codes[:, inv]
    scale = torch.stack([gr[0] for gr in groups], dim=1)
    zp = None if groups[0][1] is None else torch.stack([gr[1] for gr in groups], dim=1)
    codes = (codes + int(spec.quant_min)).to(spec.target.container)
    aqt = AffineQuantizedTensor.from_codes(codes, scale, zp, spec)
    return aqt, q.to(weight.dtype)


# -- the config ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTQConfig(AlgorithmConfig):
    """GPTQ around a weight config: `quantize_(model, GPTQConfig(Int4WeightOnlyConfig(group_size=64)),
    calibration_data=batches)`.

    base_config: a config with min/max integer qparams per row or group (`AlgorithmConfig.cannot_wrap`), e.g.
        Int4WeightOnlyConfig, IntxWeightOnlyConfig (int2-int8, PerGroup or PerAxis(0), symmetric or
        asymmetric), Int8WeightOnlyConfig or Int8DynamicActivationInt4WeightConfig (8da4w; H from the float
        inputs, later blocks see the int8 activations).
    blocksize: columns per lazy update (128 as in the paper; rounded up to a multiple of the group size when
        qparams are chosen as groups are reached).
    percdamp: dampening added to diag(H), as a fraction of its mean (0.01 in the paper).
    act_order: quantize columns in order of decreasing diag(H) (largest inputs first, while the most columns
        remain to absorb the error). With groups this uses static groups (see below). On by default (the paper's
        code has it off): on SmolLM2-135M int4 g64 (4 x 512 calibration tokens) it took perplexity from +17.7%
        to +10.5% over float (RTN: +30.6%).
    static_groups: choose every group's qparams from the original weights before GPTQ runs (None: only when
        act_order needs it). False chooses the qparams of each group from the GPTQ-updated weights when the
        group is reached (the paper's choice; usually slightly better without act_order).
    true_sequential: inside a block, quantize the linears that share an input together, in the order the block
        calls them (q/k/v, then o, then gate/up, then down), each with H from the inputs that the already
        quantized earlier linears produce. False: one H pass per block (faster, slightly less accurate).
    clip_search: choose each group's range by a search over shrink factors 1 .. 0.8 that minimises
        sum |w - q(w)|^2.4 per row (the reference code's mse qparams) instead of plain min/max. On by default:
        SmolLM2-135M int4 g64 (32 x 512 tokens) +11.0% -> +8.9% perplexity over float, quantize 113 -> 147 s.
    progress: a progress bar per block (needs tqdm).
    """

    needs_data: ClassVar[bool] = True
    expert_weights: ClassVar[bool] = True  # MoE experts: per expert, H from the tokens the router sends it
    blocksize: int = 128
    percdamp: float = 0.01
    act_order: bool = True
    static_groups: bool | None = None
    true_sequential: bool = True
    clip_search: bool = True
    progress: bool = True

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.blocksize, bool) or not isinstance(self.blocksize, int) or self.blocksize < 1:
            raise ValueError(f"GPTQConfig.blocksize={self.blocksize!r} must be a positive int (columns per lazy "
                             "update; 128 is the paper's)")
        if (isinstance(self.percdamp, bool) or not isinstance(self.percdamp, (int, float))
                or not math.isfinite(self.percdamp) or not 0 < self.percdamp <= 1):
            raise ValueError(f"GPTQConfig.percdamp={self.percdamp!r} must be a number in (0, 1] (fraction of "
                             "mean(diag H) added to the diagonal; 0.01 is the paper's)")
        for name in ("act_order", "true_sequential", "clip_search", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTQConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.static_groups is not None and not isinstance(self.static_groups, bool):
            raise ValueError(f"GPTQConfig.static_groups={self.static_groups!r} must be True, False or None (auto)")
        if self.act_order and self.static_groups is False:
            raise ValueError("GPTQConfig(act_order=True, static_groups=False): act-order visits columns out of "
                             "order, so groups chosen as they are reached would not be contiguous in the stored "
                             "layout; use static_groups=True or None")

    def run(self, model: nn.Module, layers: dict[str, nn.Module], data: list | None) -> dict[str, QuantConfig]:
        return _GPTQRun(self, model, layers).run(data)

    def quantize_layer(self, layer: nn.Linear, hessian: torch.Tensor) -> AffineQuantizedTensor:
        """GPTQ of one linear with H [K, K]: the AffineQuantizedTensor the base config's spec describes."""
        weight = layer.weight
        aqt, _ = gptq_quantize(
            weight, hessian, self.base_config.weight_spec(weight, layer), self.base_config.qparam_options(),
            blocksize=self.blocksize, percdamp=self.percdamp, act_order=self.act_order,
            static_groups=bool(self.static_groups), clip_search=self.clip_search)
        return aqt


# -- the model-level run ------------------------------------------------------------------------------------


class _GPTQRun:
    """One GPTQ pass over `layers` of `model`: block by block, quantized weights swapped in as each linear is
    done (so later inputs see them) and the original Parameters put back at the end (quantize_ installs
    the Precomputed results)."""

    def __init__(self, cfg: GPTQConfig, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.cfg, self.model, self.layers = cfg, model, layers
        self.results: dict[str, QuantConfig] = {}
        self.originals: dict[str, nn.Parameter] = {}
        self.expert_originals: dict[tuple[str, str], nn.Parameter] = {}  # (experts module, parameter name)

    def run(self, data: list) -> dict[str, QuantConfig]:
        try:
            # eval mode: the calibration forwards must not update BatchNorm statistics (or run dropout)
            with torch.no_grad(), eval_mode(self.model):
                self._run(data)
        finally:
            for fqn, p in self.originals.items():
                self.layers[fqn].weight = p
            for (fqn, name), p in self.expert_originals.items():
                self.layers[fqn]._parameters[name] = p
        return self.results

    def _run(self, data: list) -> None:
        found = find_blocks(self.model, self.layers)
        if found is not None:
            name, blocks = found
            prefix = f"{name}." if name else ""
            per_block = [{f: m for f, m in self.layers.items() if f.startswith(f"{prefix}{b}.")}
                         for b in range(len(blocks))]
            used = [b for b, inside in enumerate(per_block) if inside]
            # start at the first block with selected linears, stop after the last (the float blocks around
            # them need no pass; a whole-model pass below handles linears outside the blocks)
            inputs = capture_inputs(self.model, blocks[used[0]], data)
            for b in progress(range(used[0], used[-1] + 1), "GPTQ blocks", self.cfg.progress):
                block = blocks[b]
                if per_block[b]:
                    self._quantize_group(per_block[b], inputs, lambda inp, block=block: block(*inp[0], **inp[1]))
                if b < used[-1]:
                    inputs = run_block(block, inputs)
            del inputs
        rest = {f: m for f, m in self.layers.items() if f not in self.results
                and not any((f, n) in self.expert_originals for n in expert_parameter_names(m))}
        if rest:  # linears outside the blocks (or no blocks): one pass over the whole model
            self._quantize_group(rest, data, lambda item: call_model(self.model, item))

    def _quantize_group(self, layers: dict[str, nn.Module], inputs: list, forward: Callable) -> None:
        """Quantize `layers` (all called by `forward` on each input) in the order true_sequential asks; MoE
        experts modules after the linears (`_quantize_experts`)."""
        experts = {f: m for f, m in layers.items() if is_expert_module(m)}
        layers = {f: m for f, m in layers.items() if f not in experts}
        if layers:
            self._quantize_linears(layers, inputs, forward)
        for fqn, module in experts.items():
            self._quantize_experts(fqn, module, inputs, forward)

    def _quantize_experts(self, fqn: str, module: nn.Module, inputs: list, forward: Callable) -> None:
        """GPTQ of each expert's weights with H from the rows the router sends that expert: the experts module's
        inputs (hidden_states [T, H], top_k_index [T, k]) are recorded for every calibration item; gate_up (or up)
        first, then down_proj with H from the gate's outputs through the quantized gate_up."""
        rows = rows_per_expert(capture_routed(module, inputs, forward),
                               module._parameters["down_proj"].shape[0])  # each expert's tokens
        up = self._gptq_experts(fqn, module, up_name(module), rows)
        hidden = down_inputs(module, as_rows_by_input(module, up.dequantize()), rows)
        self._gptq_experts(fqn, module, "down_proj", hidden)

    def _gptq_experts(self, fqn: str, module: nn.Module, name: str, rows: list[list[torch.Tensor]],
                      ) -> AffineQuantizedTensor:
        """GPTQ of expert weight `name` of `module`, expert e with H from rows[e] (its inputs [t, K]); the result is
        recorded for the final pass and its dequantized copy swapped in for later inputs."""
        weight = module._parameters[name]
        transposed = experts_transposed(module)
        w = weight.detach().transpose(-2, -1) if transposed else weight.detach()  # [E, N, K]
        base = self.cfg.base_config
        parts = []
        for e in range(w.shape[0]):
            hs = Hessian(w.shape[2], w.device)
            for x in rows[e]:
                if x.shape[0]:
                    hs.add(x)
            if hs.tokens == 0:
                warnings.warn(f"GPTQ: expert {e} of {fqn}.{name} received no calibration token; it is quantized "
                              "round-to-nearest", stacklevel=4)
            we = w[e].contiguous()
            proxy = nn.Linear(we.shape[1], we.shape[0], bias=False, device="meta", dtype=we.dtype)
            aqt, _ = gptq_quantize(we, hs.matrix(), base.weight_spec(we, proxy), base.qparam_options(),
                                   blocksize=self.cfg.blocksize, percdamp=self.cfg.percdamp,
                                   act_order=self.cfg.act_order, static_groups=bool(self.cfg.static_groups),
                                   clip_search=self.cfg.clip_search)
            parts.append(aqt)
        q = stack_experts(parts, transposed)
        self.results[f"{fqn}.{name}"] = Precomputed(base=base, weight=q)
        self.expert_originals.setdefault((fqn, name), weight)
        module._parameters[name] = nn.Parameter(q.dequantize().to(weight.dtype), requires_grad=False)
        return q

    def _quantize_linears(self, layers: dict[str, nn.Module], inputs: list, forward: Callable) -> None:
        if self.cfg.true_sequential:
            pending = dict(layers)
            while pending:
                stage = self._first_stage(pending, inputs[0], forward)
                self._quantize_stage(stage, inputs, forward)
                pending = {f: m for f, m in pending.items() if f not in stage}
        else:
            self._quantize_stage(layers, inputs, forward)

    def _first_stage(self, pending: dict[str, nn.Module], first, forward: Callable) -> dict[str, nn.Module]:
        """The pending linear called first on input `first`, with the pending linears called right after it on
        the same tensor (q/k/v, gate/up); all pending linears when none is called (round-to-nearest, warned)."""
        stage: dict[str, nn.Module] = {}
        x0: list[torch.Tensor] = []  # held until the forward ends, so its storage cannot be reused

        def hook(fqn, x):
            if x0 and not _same_tensor(x, x0[0]):
                raise Stop  # a new input: the stage is complete
            x0[:1] = [x]
            stage[fqn] = pending[fqn]

        with record_linear_inputs(pending, hook), contextlib.suppress(Stop):
            forward(first)
        return stage or pending

    def _quantize_stage(self, stage: dict[str, nn.Module], inputs: list, forward: Callable) -> None:
        hessians = {f: Hessian(m.in_features, m.weight.device) for f, m in stage.items()}
        memo: list[tuple[torch.Tensor, torch.Tensor]] = []  # this item's inputs and their X^T X (shared)
        called: set[str] = set()

        def hook(fqn, x):
            xtx = next((m for t, m in memo if _same_tensor(t, x)), None)
            if xtx is None:
                xtx = xtx_of(x)
                memo.append((x, xtx))  # holds x, so no later tensor of this item can reuse its storage
            hessians[fqn].add(x, xtx)
            called.add(fqn)
            if len(called) == len(stage):
                raise Stop  # every linear of the stage has its input: the rest of the forward is not needed

        with record_linear_inputs(stage, hook):
            for inp in inputs:
                memo.clear()
                called.clear()
                with contextlib.suppress(Stop):
                    forward(inp)
        memo.clear()
        for fqn, layer in stage.items():
            hs = hessians[fqn]
            if hs.tokens == 0:
                warnings.warn(f"GPTQ: {fqn} received no calibration input; it is quantized round-to-nearest",
                              stacklevel=4)
            aqt = self.cfg.quantize_layer(layer, hs.matrix())
            self.results[fqn] = Precomputed(base=self.cfg.base_config, weight=aqt)
            self._swap_in(fqn, layer, aqt)

    def _swap_in(self, fqn: str, layer: nn.Module, aqt: AffineQuantizedTensor) -> None:
        """Let later inputs see the quantized layer: the dequantized weight (same numerics, float kernels), or
        the tensor itself when it also quantizes activations (8da4w)."""
        self.originals.setdefault(fqn, layer.weight)
        w = aqt if aqt.act_quant is not None else aqt.dequantize().to(layer.weight.dtype)
        layer.weight = nn.Parameter(w, requires_grad=False)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)

