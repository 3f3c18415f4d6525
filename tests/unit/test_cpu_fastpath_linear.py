"""Megatron's linear layers over one TP rank on CPU as a plain product: the ``one_rank_linear`` CPU fast path
(fbt_megatron/model/cpu_fastpaths.py).

The reference is the product written out in float64 (``y = x W^T + b``; ``dx = g W``, ``dW = g^T x``,
``db = Σ g``); then Megatron's own function and mappings: output and gradients bitwise, in the layers and
in the whole model. Over one rank no Megatron autograd node is left in the graph, nor DeepSpeed's
replacement of ``F.linear`` (which a ZeRO-3 engine installs process-wide); what the short way does not
cover (gradient accumulation fusion, sequence parallelism, deferred embedding gradients, a group of two,
other devices) is Megatron's function. TP=2 against TP=1 is ``tests/integration/test_model_tp.py``."""

import pytest
import torch
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer import TransformerConfig

from fbt_megatron.model import cpu_fastpaths as room
from fbt_megatron.model.fbt_gpt import build_model
from tests.support.model_helpers import LLAMA, feedback, loss_and_grads, tiny_model_config


def column_then_row(dtype, seed=0):
    """A ColumnParallelLinear 6 -> 10 feeding a RowParallelLinear 10 -> 4, both with biases added in
    the layer (Megatron's TransformerLayer skips them for its fused add; the output layer has none)."""
    config = TransformerConfig(num_layers=1, hidden_size=6, num_attention_heads=1, params_dtype=dtype,
                               use_cpu_initialization=True)
    torch.manual_seed(seed)
    init = torch.nn.init.normal_
    col = megatron_layers.ColumnParallelLinear(6, 10, config=config, init_method=init, bias=True, gather_output=False)
    row = megatron_layers.RowParallelLinear(10, 4, config=config, init_method=init, bias=True,
                                            input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        col.bias.normal_()
        row.bias.normal_()
    return col, row


def run(col, row, x, grad):
    for p in (*col.parameters(), *row.parameters()):
        p.grad = None
    xi = x.clone().requires_grad_()
    hidden, _ = col(xi)
    out, _ = row(hidden)
    out.backward(grad)
    return out.detach(), xi.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad


# the names Megatron's layers look up, and Megatron's own functions under them
MEGATRONS = {"linear_with_grad_accumulation_and_async_allreduce": room.MEGATRON_LINEAR,
             "copy_to_tensor_model_parallel_region": room.MEGATRON_COPY_TO,
             "reduce_from_tensor_model_parallel_region": room.MEGATRON_REDUCE_FROM}


def inputs(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 3, 6, generator=g, dtype=dtype), torch.randn(5, 3, 4, generator=g, dtype=dtype)


@pytest.fixture
def megatrons_own():
    """A context in which Megatron's layers use Megatron's own function and mappings."""

    class Megatrons:
        def __enter__(self):
            self.installed = {n: getattr(megatron_layers, n) for n in MEGATRONS}
            for n, f in MEGATRONS.items():
                setattr(megatron_layers, n, f)

        def __exit__(self, *exc):
            for n, f in self.installed.items():
                setattr(megatron_layers, n, f)

    return Megatrons()


def test_equals_the_product_in_float64(single_process):
    room.install("cpu")
    col, row = column_then_row(torch.float64)
    x, g = inputs(torch.float64)
    out, dx, dw1, db1, dw2, db2 = run(col, row, x, g)
    w1, b1, w2, b2 = col.weight.detach(), col.bias.detach(), row.weight.detach(), row.bias.detach()
    h = x @ w1.T + b1
    assert torch.allclose(out, h @ w2.T + b2, rtol=1e-13, atol=1e-13)
    gh = g @ w2  # the gradient reaching the hidden layer
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    assert torch.allclose(dw2, flat(g).T @ flat(h), rtol=1e-13, atol=1e-13)
    assert torch.allclose(db2, flat(g).sum(0), rtol=1e-13, atol=1e-13)
    assert torch.allclose(dw1, flat(gh).T @ flat(x), rtol=1e-13, atol=1e-13)
    assert torch.allclose(db1, flat(gh).sum(0), rtol=1e-13, atol=1e-13)
    assert torch.allclose(dx, gh @ w1, rtol=1e-13, atol=1e-13)


def test_agrees_with_megatrons_function(single_process, megatrons_own):
    room.install("cpu")
    col, row = column_then_row(torch.float32)
    x, g = inputs(torch.float32)
    ours = run(col, row, x, g)
    with megatrons_own:
        theirs = run(col, row, x, g)
    for a, b in zip(ours, theirs):  # the same product, then the bias; the same gradient products
        assert torch.equal(a, b)


class Refused:
    """Stands in for Megatron's autograd functions: any use fails the test."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.name} was used over one CPU rank")


def refuse_megatron_nodes(monkeypatch):
    # a ZeRO-3 engine puts DeepSpeed's autograd function in F.linear's place for the whole process
    monkeypatch.setattr(torch.nn.functional, "linear", Refused("torch.nn.functional.linear"))
    monkeypatch.setattr(megatron_layers.LinearWithGradAccumulationAndAsyncCommunication, "apply",
                        Refused("LinearWithGradAccumulationAndAsyncCommunication"))
    monkeypatch.setattr(mappings._CopyToModelParallelRegion, "apply", Refused("_CopyToModelParallelRegion"))
    monkeypatch.setattr(mappings._ReduceFromModelParallelRegion, "apply", Refused("_ReduceFromModelParallelRegion"))


def test_no_megatron_node_over_one_rank(single_process, monkeypatch):
    room.install("cpu")
    col, row = column_then_row(torch.float32)
    refuse_megatron_nodes(monkeypatch)
    run(col, row, *inputs(torch.float32))


def test_the_model_installs_it(single_process, monkeypatch, megatrons_own):
    """Building the model installs the short way, taken everywhere (attention, MLP, output layer), with
    the loss and gradients of Megatron's path, bitwise."""
    for name, f in MEGATRONS.items():
        monkeypatch.setattr(megatron_layers, name, f)  # what a process has before a model is built
    model = build_model(tiny_model_config(**LLAMA), feedback())
    with megatrons_own:
        theirs = loss_and_grads(model, 1)
    with monkeypatch.context() as m:
        refuse_megatron_nodes(m)
        ours = loss_and_grads(model, 1)
    assert torch.equal(ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys()
    for name in ours[1]:
        assert torch.equal(ours[1][name], theirs[1][name]), name


class TwoRanks:
    def size(self):
        return 2


@pytest.mark.parametrize("case", ["fusion", "sequence_parallel", "allreduce_dgrad", "buffer", "two_ranks", "meta",
                                  "async_grad_allreduce", "unknown_argument", "positional"])
def test_everything_else_is_megatrons_function(single_process, monkeypatch, case):
    calls = []
    monkeypatch.setattr(room, "MEGATRON_LINEAR", lambda *args, **kwargs: calls.append((args, kwargs)) or "megatron")
    x = torch.randn(2, 3, 4, device="meta" if case == "meta" else "cpu")
    w = torch.randn(5, 4, device=x.device)
    kwargs = dict(input=x, weight=w, bias=None, gradient_accumulation_fusion=case == "fusion",
                  allreduce_dgrad=case == "allreduce_dgrad", sequence_parallel=case == "sequence_parallel",
                  grad_output_buffer=[] if case == "buffer" else None,
                  tp_group=TwoRanks() if case == "two_ranks" else None,
                  async_grad_allreduce=True if case == "async_grad_allreduce" else None)
    if case == "unknown_argument":  # an argument a later Megatron adds: its function decides
        kwargs["new_option"] = True
    if case == "positional":  # after input and weight the wrapper reads arguments by name; by position they pass
        args = (kwargs.pop("input"), kwargs.pop("weight"), kwargs.pop("bias"))
    else:
        args = (kwargs.pop("input"), kwargs.pop("weight"))  # as Megatron's layers pass them
    assert room.linear_with_grad_accumulation_and_async_allreduce(*args, **kwargs) == "megatron"
    assert calls == [(args, kwargs)]


@pytest.mark.parametrize("case", ["two_ranks", "meta"])
def test_mappings_elsewhere_are_megatrons(single_process, monkeypatch, case):
    seen = []
    monkeypatch.setattr(room, "MEGATRON_COPY_TO", lambda x, group: seen.append(("copy", group)) or "copy")
    monkeypatch.setattr(room, "MEGATRON_REDUCE_FROM", lambda x, group: seen.append(("reduce", group)) or "reduce")
    x = torch.randn(2, 3, device="meta" if case == "meta" else "cpu")
    group = TwoRanks() if case == "two_ranks" else None
    assert room.copy_to_tensor_model_parallel_region(x, group=group) == "copy"
    assert room.reduce_from_tensor_model_parallel_region(x, group=group) == "reduce"
    assert seen == [("copy", group), ("reduce", group)]


def test_megatrons_function_still_runs_through_the_installed_name(single_process):
    """Megatron's function reads its warning flag through the module's global name, which is ours after
    install: the fallback must run (here: an input-gradient all-reduce asked for over one CPU rank)."""
    room.install("cpu")
    x, w = torch.randn(3, 2, 4), torch.randn(5, 4, requires_grad=True)
    out = megatron_layers.linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=True, sequence_parallel=False)
    assert torch.equal(out, torch.matmul(x, w.t()))


def test_no_parallel_state_is_not_one_rank():
    """Without Megatron's parallel state the default group is unknown: Megatron's function decides."""
    assert not room.one_rank(None)
    assert room.one_rank(TwoRanks()) is False
