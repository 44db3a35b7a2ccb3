"""Quantized recurrent modules: nn.LSTM / nn.GRU / nn.RNN and nn.LSTMCell / nn.GRUCell / nn.RNNCell twins.

`quantize_` (the built-in weight configs, when `filter_fn` selects a recurrent module) quantizes every
`weight_ih*` / `weight_hh*` / `weight_hr*` Parameter to an `AffineQuantizedTensor` and installs the twin
`quantized_twin(module)` returns: same attributes, same parameters (so the same state_dict keys), same
forward signature and return structure (`output, (h_n, c_n)` / `output, h_n`, PackedSequence in and out).

How a layer runs (one direction; G gates: LSTM 4, GRU 3, RNN 1; H hidden, P = proj_size or H):
    gi = F.linear(x_all, W_ih, b_ih)             x_all [N, I]: every timestep at once (N = sum of batch sizes)
    for each step t:  gh = F.linear(h[:b_t], W_hh, b_hh)    [b_t, G*H], the small-M kernels
                      LSTM: i, f, g, o = gi_t + gh;  c = sig(f) c + sig(i) tanh(g);  h = sig(o) tanh(c) (@ W_hr)
                      GRU:  r, z = sig(gi_rz + gh_rz); n = tanh(gi_n + r * gh_n);  h = n + z (h - n)
                      RNN:  h = act(gi_t + gh)
Padded input is the packed case with every batch size equal to B, so one loop serves both; in a
PackedSequence the rows of step t are the first b_t rows (lengths sorted descending), which is why a
reverse pass can start each sequence from its initial state: rows join as t decreases.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from affineq import cpp as _cpp
from affineq.tensor import fallback
from affineq.tensor.activation import act_eps, fused_int8_mode
from affineq.tensor.affine import AffineQuantizedTensor

__all__ = [
    "QuantizedLSTM", "QuantizedGRU", "QuantizedRNN",
    "QuantizedLSTMCell", "QuantizedGRUCell", "QuantizedRNNCell",
    "RECURRENT_TYPES", "quantized_twin", "recurrent_weight_names",
]


# -- one step of each cell -------------------------------------------------------------------------------


def _lstm_step(gi, h, c, w_hh, b_hh, w_hr):
    g = gi + F.linear(h, w_hh, b_hh)
    i, f, gg, o = g.chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
    h = torch.sigmoid(o) * torch.tanh(c)
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def _gru_step(gi, h, w_hh, b_hh):
    gh = F.linear(h, w_hh, b_hh)
    hidden = h.shape[1]
    rz = torch.sigmoid(gi[:, : 2 * hidden] + gh[:, : 2 * hidden])
    r, z = rz[:, :hidden], rz[:, hidden:]
    n = torch.tanh(torch.addcmul(gi[:, 2 * hidden:], r, gh[:, 2 * hidden:]))
    return torch.addcmul(n, z, h - n)


def _rnn_step(gi, h, w_hh, b_hh, relu):
    g = gi + F.linear(h, w_hh, b_hh)
    return torch.relu(g) if relu else torch.tanh(g)


# -- the C++ recurrence -------------------------------------------------------------------------------------

_CELL_CODES = {"LSTM": 0, "GRU": 1, "RNN_TANH": 2, "RNN_RELU": 3}


def _fused_ok(gi: torch.Tensor, h: torch.Tensor, w_hh, w_hr) -> bool:
    """Whether `affineq::lowbit_rnn_layer` runs this layer: a `dense` recurrent weight (our kernel's format)
    with float or dynamic int8 activations (int8 ones not computing in bf16: the kernel quantizes float32 h),
    float32 CPU state, no projection, hidden size a multiple of 8, no gradient wanted, and the C++ kernels
    built. Otherwise the Python loop runs (same math, F.linear)."""
    return (isinstance(w_hh, AffineQuantizedTensor) and w_hh.spec.fmt == "dense" and not w_hh.spec.transposed
            and not w_hh.act_tensors and _act_mode(w_hh) is not None and w_hr is None
            and not (w_hh.spec.compute_dtype is not None and w_hh.spec.act_quant is not None)
            and gi.dtype == h.dtype == torch.float32 and gi.device.type == "cpu" and h.shape[-1] % 8 == 0
            and not (torch.is_grad_enabled() and (gi.requires_grad or h.requires_grad))
            and _cpp.is_available())


def _act_mode(w) -> int | None:
    aq = w.spec.act_quant
    return -1 if aq is None else fused_int8_mode(aq)


def _fused_layer(gi, steps, h, c, w_hh, b_hh, cell: str, reverse: bool):
    """(output [N, H], h_n, c_n or None) of one direction through the C++ recurrence."""
    from affineq.tensor.linear_kernels import lowbit_weight_args

    aq = w_hh.spec.act_quant
    if not torch.compiler.is_compiling():  # dynamo cannot trace the recorder's ContextVar
        fallback.record("affineq.lowbit_rnn_layer")
    op = (torch.ops.affineq.lowbit_rnn_layer_bf16_compute if w_hh.spec.compute_dtype == torch.bfloat16
          else torch.ops.affineq.lowbit_rnn_layer)
    out, h_n, c_n = op(
        gi, steps, h, c, None if b_hh is None else b_hh.float(), *lowbit_weight_args(w_hh), _act_mode(w_hh),
        aq is not None and aq.per_token, act_eps(gi, aq) if aq is not None else 0.0,
        _CELL_CODES[cell], reverse)
    return out, h_n, (c_n if cell == "LSTM" else None)


# -- the full-sequence modules ---------------------------------------------------------------------------


class _QuantizedRNNBase(nn.Module):
    """Shared by QuantizedLSTM / QuantizedGRU / QuantizedRNN: attributes, parameters and the layer loop."""

    _float_type: ClassVar[type[nn.RNNBase]]
    _gates: ClassVar[int]

    def __init__(self, float_module: nn.RNNBase) -> None:
        super().__init__()
        for attr in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout",
                     "bidirectional", "proj_size", "mode"):
            setattr(self, attr, getattr(float_module, attr))
        self.nonlinearity = getattr(float_module, "nonlinearity", None)
        for name, p in float_module._parameters.items():
            self.register_parameter(name, p)
        self.train(float_module.training)

    @classmethod
    def from_float(cls, float_module: nn.RNNBase) -> _QuantizedRNNBase:
        """The twin of `float_module`, sharing its (already quantized, or float) Parameters."""
        return cls(float_module)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
        for attr, default in (("bias", True), ("batch_first", False), ("dropout", 0.0), ("bidirectional", False),
                              ("proj_size", 0)):
            if getattr(self, attr) != default:
                s += f", {attr}={getattr(self, attr)}"
        if self.nonlinearity not in (None, "tanh"):
            s += f", nonlinearity={self.nonlinearity!r}"
        return s

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _out_size(self) -> int:
        return self.proj_size if self.proj_size > 0 else self.hidden_size

    def _layer_params(self, layer: int, direction: int):
        sfx = f"_l{layer}" + ("_reverse" if direction else "")
        p = self._parameters
        return (p["weight_ih" + sfx], p["weight_hh" + sfx], p.get("bias_ih" + sfx), p.get("bias_hh" + sfx),
                p.get("weight_hr" + sfx))

    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        if packed:
            data, batch_sizes, sorted_indices, unsorted_indices = input
            steps = batch_sizes.tolist()
            batch, unbatched = steps[0], False
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"{type(self).__name__}: input must be 3-D (batched) or 2-D (unbatched), got "
                                 f"{input.dim()}-D of shape {tuple(input.shape)}")
            unbatched = input.dim() == 2
            x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
            seq, batch = x.shape[0], x.shape[1]
            data, steps = x.reshape(seq * batch, x.shape[2]), [batch] * seq
            sorted_indices = unsorted_indices = None
        if data.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: input.size(-1) must be input_size={self.input_size}, got "
                             f"{data.shape[-1]}")
        h0, c0 = self._initial_state(hx, batch, data, unbatched, sorted_indices)
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(self._directions):
                k = layer * self._directions + d
                out, h, c = self._run_direction(data, steps, h0[k], None if c0 is None else c0[k],
                                                self._layer_params(layer, d), reverse=d == 1)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            data = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                data = F.dropout(data, self.dropout, training=True)
        h_n = torch.stack(h_n)
        c_n = torch.stack(c_n) if c0 is not None else None
        if unsorted_indices is not None:
            h_n = h_n.index_select(1, unsorted_indices)
            c_n = None if c_n is None else c_n.index_select(1, unsorted_indices)
        if packed:
            output = PackedSequence(data, batch_sizes, sorted_indices, unsorted_indices)
        else:
            output = data.reshape(len(steps), batch, data.shape[-1])
            if unbatched:
                output, h_n = output.squeeze(1), h_n.squeeze(1)
                c_n = None if c_n is None else c_n.squeeze(1)
            elif self.batch_first:
                output = output.transpose(0, 1)
        return output, ((h_n, c_n) if c0 is not None else h_n)

    def _initial_state(self, hx, batch, data, unbatched, sorted_indices):
        """(h0 [L*D, B, P], c0 [L*D, B, H] or None), in the sorted order of a PackedSequence."""
        lstm = self._gates == 4
        layers = self.num_layers * self._directions
        want_h = (layers, batch, self._out_size)
        want_c = (layers, batch, self.hidden_size)
        if hx is None:
            h0 = data.new_zeros(want_h)
            return h0, (data.new_zeros(want_c) if lstm else None)
        if lstm:
            if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
                raise ValueError(f"{type(self).__name__}: hx must be a tuple (h_0, c_0) (or None for zeros), got "
                                 f"{type(hx).__name__}")
            h0, c0 = hx
        else:
            if not isinstance(hx, torch.Tensor):
                raise ValueError(f"{type(self).__name__}: hx must be a tensor h_0 (or None for zeros), got "
                                 f"{type(hx).__name__}")
            h0, c0 = hx, None
        states = [("h_0", h0, want_h)] + ([("c_0", c0, want_c)] if lstm else [])
        out = []
        for name, t, want in states:
            if unbatched:
                if t.dim() != 2:
                    raise ValueError(f"{type(self).__name__}: for unbatched 2-D input, {name} must be 2-D "
                                     f"{(want[0], want[2])}, got shape {tuple(t.shape)}")
                t = t.unsqueeze(1)
            if tuple(t.shape) != want:
                raise ValueError(f"{type(self).__name__}: {name} must have shape (num_layers * num_directions, "
                                 f"batch, {'proj_size or ' if name == 'h_0' and lstm else ''}hidden_size) = "
                                 f"{want}, got {tuple(t.shape)}")
            if sorted_indices is not None:
                t = t.index_select(1, sorted_indices)
            out.append(t.to(data.dtype))
        return out[0], (out[1] if lstm else None)

    def _run_direction(self, data, steps, h, c, params, reverse):
        """One layer, one direction: (output [N, P], h_n [B, P], c_n [B, H] or None)."""
        w_ih, w_hh, b_ih, b_hh, w_hr = params
        batch = steps[0]
        if self._gates == 4 and b_hh is not None:
            # b_hh only adds to the gates, so it joins b_ih in the one batched projection
            b_ih = b_hh if b_ih is None else b_ih + b_hh
            b_hh = None
        gi = F.linear(data, w_ih, b_ih)
        if _fused_ok(gi, h, w_hh, w_hr):
            return _fused_layer(gi, steps, h, c, w_hh, b_hh, self.mode, reverse)
        starts = [0]
        for b in steps[:-1]:
            starts.append(starts[-1] + b)
        outs = [None] * len(steps)
        relu = self.nonlinearity == "relu"
        for t in (reversed(range(len(steps))) if reverse else range(len(steps))):
            b, s = steps[t], starts[t]
            g, h_t = gi[s:s + b], h[:b] if b < batch else h
            if self._gates == 4:
                h_new, c_new = _lstm_step(g, h_t, c[:b] if b < batch else c, w_hh, b_hh, w_hr)
                c = c_new if b == batch else torch.cat([c_new, c[b:]])
            elif self._gates == 3:
                h_new = _gru_step(g, h_t, w_hh, b_hh)
            else:
                h_new = _rnn_step(g, h_t, w_hh, b_hh, relu)
            h = h_new if b == batch else torch.cat([h_new, h[b:]])
            outs[t] = h_new
        return torch.cat(outs), h, c


class QuantizedLSTM(_QuantizedRNNBase):
    """nn.LSTM with quantized weights (`quantize_` installs it): same parameters, forward and outputs."""

    _float_type = nn.LSTM
    _gates = 4


class QuantizedGRU(_QuantizedRNNBase):
    """nn.GRU with quantized weights (`quantize_` installs it): same parameters, forward and outputs."""

    _float_type = nn.GRU
    _gates = 3


class QuantizedRNN(_QuantizedRNNBase):
    """nn.RNN (tanh or relu) with quantized weights (`quantize_` installs it)."""

    _float_type = nn.RNN
    _gates = 1


# -- cells -----------------------------------------------------------------------------------------------


class _QuantizedCellBase(nn.Module):
    _float_type: ClassVar[type[nn.RNNCellBase]]
    _gates: ClassVar[int]

    def __init__(self, float_module: nn.RNNCellBase) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.bias = (float_module.input_size, float_module.hidden_size,
                                                        float_module.bias)
        self.nonlinearity = getattr(float_module, "nonlinearity", None)
        for name, p in float_module._parameters.items():
            self.register_parameter(name, p)
        self.train(float_module.training)

    @classmethod
    def from_float(cls, float_module: nn.RNNCellBase) -> _QuantizedCellBase:
        return cls(float_module)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            s += ", bias=False"
        if self.nonlinearity not in (None, "tanh"):
            s += f", nonlinearity={self.nonlinearity!r}"
        return s

    def forward(self, input, hx=None):
        name = type(self).__name__
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: input must be 2-D (batch, input_size) or 1-D (input_size,), got shape "
                             f"{tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"{name}: input.size(-1) must be input_size={self.input_size}, got {input.shape[-1]}")
        unbatched = input.dim() == 1
        x = input.unsqueeze(0) if unbatched else input
        lstm = self._gates == 4
        if hx is None:
            zeros = x.new_zeros(x.shape[0], self.hidden_size)
            states = (zeros, zeros) if lstm else (zeros,)
        else:
            states = tuple(hx) if lstm else (hx,)
            if lstm and len(states) != 2:
                raise ValueError(f"{name}: hx must be a tuple (h_0, c_0) (or None for zeros)")
            want = (x.shape[0], self.hidden_size)
            states = tuple(s.unsqueeze(0) if unbatched else s for s in states)
            for s in states:
                if tuple(s.shape) != want:
                    raise ValueError(f"{name}: each state must have shape (batch, hidden_size) = {want} (or "
                                     f"({self.hidden_size},) for 1-D input), got {tuple(s.shape)}")
            states = tuple(s.to(x.dtype) for s in states)
        p = self._parameters
        w_hh, b_ih, b_hh = p["weight_hh"], p.get("bias_ih"), p.get("bias_hh")
        if lstm and b_hh is not None:
            b_ih, b_hh = (b_hh if b_ih is None else b_ih + b_hh), None
        gi = F.linear(x, p["weight_ih"], b_ih)
        if _fused_ok(gi, states[0], w_hh, None):
            cell = "LSTM" if lstm else "GRU" if self._gates == 3 else f"RNN_{self.nonlinearity.upper()}"
            _, h, c = _fused_layer(gi, [x.shape[0]], states[0], states[1] if lstm else None, w_hh, b_hh, cell,
                                   False)
            out = (h, c) if lstm else h
        elif lstm:
            out = _lstm_step(gi, states[0], states[1], w_hh, b_hh, None)
        else:
            out = _gru_step(gi, states[0], w_hh, b_hh) if self._gates == 3 else \
                _rnn_step(gi, states[0], w_hh, b_hh, self.nonlinearity == "relu")
        if lstm:
            return tuple(o.squeeze(0) for o in out) if unbatched else out
        return out.squeeze(0) if unbatched else out


class QuantizedLSTMCell(_QuantizedCellBase):
    """nn.LSTMCell with quantized weights: forward(input, (h, c)) -> (h', c')."""

    _float_type = nn.LSTMCell
    _gates = 4


class QuantizedGRUCell(_QuantizedCellBase):
    """nn.GRUCell with quantized weights: forward(input, h) -> h'."""

    _float_type = nn.GRUCell
    _gates = 3


class QuantizedRNNCell(_QuantizedCellBase):
    """nn.RNNCell (tanh or relu) with quantized weights: forward(input, h) -> h'."""

    _float_type = nn.RNNCell
    _gates = 1


_TWINS: dict[type, type] = {c._float_type: c for c in (QuantizedLSTM, QuantizedGRU, QuantizedRNN, QuantizedLSTMCell,
                                                       QuantizedGRUCell, QuantizedRNNCell)}
RECURRENT_TYPES: tuple[type, ...] = tuple(_TWINS) + tuple(_TWINS.values())


def recurrent_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The matrices of a recurrent module that quantize: weight_ih*, weight_hh*, weight_hr* (not biases)."""
    return tuple(n for n, p in module._parameters.items() if p is not None and n.startswith("weight_"))


def quantized_twin(module: nn.Module, config=None) -> nn.Module:
    """The quantized twin of a float recurrent module (sharing its Parameters); any other module as is.

    With `config.packing_format == "auto"`, a recurrent matrix (`weight_hh*`: M = batch rows, every step)
    that "auto" stored `plain` (int8 dynamic, for aten's `_int_mm`) is re-stored `dense`, the format the C++
    recurrence reads; codes and qparams unchanged. So is an input matrix (`weight_ih*`, M = seq x batch) that
    the `affineq.int8_codes_linear` kernel reads (exact int8 code products, VNNI + VBMI builds).

    Exact type match: a user subclass of nn.LSTM may override forward (QuantConfig.check refuses it)."""
    twin = _TWINS.get(type(module))
    if twin is None:
        return module
    if isinstance(module, nn.RNNBase) and module.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
        raise ValueError(f"unknown recurrent mode {module.mode!r}")
    if getattr(config, "packing_format", None) == "auto" and _cpp.is_available():
        from affineq.tensor.linear_kernels import int8_codes_check

        for name, p in module._parameters.items():
            if not (isinstance(p, AffineQuantizedTensor) and p.spec.fmt == "plain" and p.device.type == "cpu"
                    and len(p.spec.shape) == 2 and _act_mode(p) is not None):
                continue
            dense = p.to_format("dense")
            if name.startswith("weight_hh") or int8_codes_check(torch.empty(1, p.spec.shape[1]), dense) is None:
                module._parameters[name] = nn.Parameter(dense, requires_grad=False)
    return twin.from_float(module)
