"""The stacked routed experts LLaDA2 and LLaDA-MoE share (trl_dllm.models.families._moe): every implementation of
transformers' experts interface (``eager`` = the class's own per-expert loop, ``grouped_mm``, ``batched_mm``) against a
hand-written dense reference, outputs and gradients, in the routings that break grouped kernels; whole tiny models
equal under eager and grouped_mm; a block's aten ops independent of the number of experts; the block compiled with
``fullgraph=True``; no host read of tensor data in a grouped_mm forward; the per-expert checkpoint layout round trip.

What runs on CPU (torch 2.13, transformers 5.24), checked below rather than assumed: an eager float32 forward under
``grouped_mm`` calls torch's own kernel (``aten._grouped_mm``, one per projection). Under dynamo, transformers uses
torch's kernel only for bfloat16 weights (as on a CUDA bf16 run); float32 weights fall back to its custom op
``transformers::grouped_mm_fallback``, opaque to the graph, whose body loops over the experts after ``offs.tolist()``
(a host read of the offsets; on CPU no device synchronisation, on CUDA one per projection)."""

import re
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils.import_utils import is_torch_greater_or_equal

from trl_dllm.core.masks import block_causal_mask
from trl_dllm.models.families import NATIVE_LAYOUTS, native_config
from trl_dllm.models.families._moe import StackedExperts, stack_expert_weights
from trl_dllm.models.families.llada2 import LLaDA2SparseMoe
from trl_dllm.models.families.llada_moe import LLaDAMoESparseMoe
from trl_dllm.models.loading import load_pretrained
from trl_dllm.testing import save_tiny_original_checkpoint, tiny_original_config

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
BLOCKS = {"llada2": LLaDA2SparseMoe, "llada_moe": LLaDAMoESparseMoe}
# torch's grouped_mm has a CPU kernel from 2.9 (transformers falls back to its looping custom op before)
CPU_GROUPED_MM = is_torch_greater_or_equal("2.9", accept_dev=True)
# what transformers' grouped_mm calls: torch's kernel (torch.nn.functional.grouped_mm, which dynamo traces through to
# torch._grouped_mm), or its own looping op
GROUPED_MM = {getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None)} - {None}
FALLBACK = torch.ops.transformers.grouped_mm_fallback
needs_cpu_grouped_mm = pytest.mark.skipif(not CPU_GROUPED_MM, reason="torch < 2.9 has no CPU grouped_mm kernel")


class OpCounter(TorchDispatchMode):
    """Counts every aten (and custom) op dispatched, by name (``aten.mm.default``). A host read by ``.tolist()`` is
    not an op and is not seen; ``.item()`` / ``bool()`` are (``aten._local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def stacked_experts(num_experts: int, implementation: str, hidden: int = 16, width: int = 8) -> StackedExperts:
    config = PretrainedConfig(experts_implementation=implementation)
    config.num_experts, config.hidden_size, config.hidden_act = num_experts, hidden, "silu"
    experts = StackedExperts(config, width)
    generator = torch.Generator().manual_seed(0)
    experts.gate_up_proj.data = 0.3 * torch.randn(num_experts, 2 * width, hidden, generator=generator)
    experts.down_proj.data = 0.3 * torch.randn(num_experts, hidden, width, generator=generator)
    return experts


def dense_reference(x, index, weights, gate_up_proj, down_proj):
    """``Σ_j w[t, j] · down_e(silu(gate_e x_t) · up_e x_t)``, ``e = index[t, j]``, one token and one slot at a time;
    an expert's gate rows are the first half of its ``gate_up_proj`` rows, its up rows the second."""
    width = down_proj.shape[-1]
    rows = []
    for t in range(len(x)):
        row = torch.zeros_like(x[t])
        for j, e in enumerate(index[t].tolist()):
            gate, up = gate_up_proj[e, :width] @ x[t], gate_up_proj[e, width:] @ x[t]
            row = row + weights[t, j] * (down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(row)
    return torch.stack(rows)


def routing(case: str) -> tuple[int, torch.Tensor]:
    """``(num_experts, top_k_index (T, k))`` of each routing case."""
    generator = torch.Generator().manual_seed(1)
    if case == "more_experts_than_tokens":  # 64 experts, 3 tokens top-2: at most 6 used, 58+ groups empty
        return 64, torch.stack([torch.randperm(64, generator=generator)[:2] for _ in range(3)])
    if case == "all_to_one_expert":  # every token to expert 5 (top-1): one group holds all, the others are empty
        return 8, torch.full((6, 1), 5)
    if case == "all_to_one_pair":  # every token's top-2 is experts (6, 2), in that order
        return 8, torch.tensor([[6, 2]] * 5)
    if case == "lonely_experts":  # token 0's top-3 includes experts 6 and 7, which no other token uses
        return 8, torch.tensor([[6, 0, 7], [0, 1, 2], [2, 3, 1], [1, 0, 3]])
    scores = torch.randn(32, 8, generator=generator)  # "dense": 32 tokens top-2 of 8, as a router picks
    return 8, scores.topk(2, dim=-1).indices


@pytest.mark.parametrize("case", ["dense", "more_experts_than_tokens", "all_to_one_expert", "all_to_one_pair",
                                  "lonely_experts"])  # fmt: skip
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_experts_equal_the_dense_reference(implementation, case):
    """Outputs and gradients (w.r.t. the hidden states, the routing weights, ``gate_up_proj`` and ``down_proj``) of
    each implementation equal the dense reference in float32, and the experts no token routes to get exactly zero
    gradient (a grouped kernel must not leave their rows unwritten)."""
    num_experts, index = routing(case)
    experts = stacked_experts(num_experts, implementation)
    assert experts.config._experts_implementation == implementation
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(len(index), 16, generator=generator, requires_grad=True)
    weights = torch.rand(index.shape, generator=generator).requires_grad_()
    cotangent = torch.randn(len(index), 16, generator=generator)
    inputs = (x, weights, experts.gate_up_proj, experts.down_proj)

    out = experts(x, index, weights)
    expected = dense_reference(x, index, weights, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out, inputs, cotangent)
    for grad, reference in zip(grads, torch.autograd.grad(expected, inputs, cotangent)):
        torch.testing.assert_close(grad, reference)
    unused = torch.ones(num_experts, dtype=torch.bool)
    unused[index.unique()] = False
    assert unused.any() == (case != "dense")
    assert not grads[2][unused].any() and not grads[3][unused].any()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: save_tiny_original_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"), family)
            for family in BLOCKS}  # fmt: skip


@pytest.mark.parametrize("family", list(BLOCKS))
def test_whole_model_equal_under_eager_and_grouped_mm(checkpoints, family):
    """A tiny LLaDA2 (its 4-D block mask) / LLaDA-MoE (a 2-D padding mask), loaded as users load it (grouped_mm by
    default): logits and every parameter's gradient equal under ``eager`` (the per-expert loop), ``grouped_mm`` and
    ``batched_mm``, each set with ``model.set_experts_implementation``, and each really running its own kernels."""
    model = load_pretrained(checkpoints[family], dtype=torch.float32).train()
    assert model.config._experts_implementation == "grouped_mm"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=generator)
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, :2] = 0
    mask = block_causal_mask(8, 4, 0, attention_mask=padding) if family == "llada2" else padding
    cotangent = torch.randn(2, 8, model.config.vocab_size, generator=generator)
    results = {}
    for implementation in IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        model.zero_grad(set_to_none=True)
        with OpCounter() as counter:
            logits = model(input_ids=ids, attention_mask=mask).logits
            (logits * cotangent).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results[implementation] = logits.detach(), grads, counter.ops
    logits, grads, ops = results["eager"]
    assert "aten.nonzero.default" in ops and "aten._grouped_mm.default" not in ops  # the per-expert loop
    assert len(grads) == len(list(model.parameters()))
    for implementation in ("grouped_mm", "batched_mm"):
        other_logits, other_grads, other_ops = results[implementation]
        assert "aten.nonzero.default" not in other_ops
        assert ("aten._grouped_mm.default" in other_ops) == (implementation == "grouped_mm" and CPU_GROUPED_MM)
        torch.testing.assert_close(other_logits, logits)
        assert other_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], msg=lambda m, n=name: f"{n}: {m}")


def moe_block(family: str, num_experts: int, implementation: str = "grouped_mm", dtype=torch.float32):
    """One MoE block of the released config at tiny width (hidden 32, expert width 16, top-2; LLaDA2: 4 groups, best
    2, one shared expert) with ``num_experts`` experts, random weights (and LLaDA2's expert bias). A block built outside a
    model has no experts implementation unless its config names one (transformers' default, grouped_mm, is resolved
    by ``PreTrainedModel.__init__``), so it is set here."""
    config = native_config({**tiny_original_config(family), "num_experts": num_experts})
    config._experts_implementation = implementation
    block = BLOCKS[family](config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
    return block.to(dtype)


def block_input(block, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, 32, block.experts.hidden_dim, generator=generator).to(dtype)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_block_ops_do_not_grow_with_the_experts(family):
    """aten ops of one MoE block forward of 32 tokens at 64 experts ≤ 1.15× those at 8 (grouped_mm). Measured here
    (torch 2.13 CPU; ``OpCounter`` around ``block(x)`` under ``torch.no_grad()``, see ``moe_block``):

    ============ ========== ========== ===============================================
    family       8 experts  64 experts before, 8 / 64 (issue 53: one module per expert)
    ============ ========== ========== ===============================================
    LLaDA2       65         65         118 / 566
    LLaDA-MoE    31         31         84 / 532
    ============ ========== ========== ===============================================

    The class's own loop (``eager``) still grows: 178 / 1130 (LLaDA2), 144 / 1096 (LLaDA-MoE) — the control that
    the counter sees the experts. Print them with ``pytest tests/models/test_moe_experts.py -k grow -s``."""
    counts = {}
    for implementation in ("grouped_mm", "eager"):
        for num_experts in (8, 64):
            block = moe_block(family, num_experts, implementation)
            x = block_input(block)
            with torch.no_grad(), OpCounter() as counter:
                block(x)
            counts[implementation, num_experts] = sum(counter.ops.values())
    print(family, counts)
    assert counts["grouped_mm", 64] <= 1.15 * counts["grouped_mm", 8]
    assert counts["eager", 64] > 4 * counts["eager", 8]


def graph_calls(block, x) -> Counter:
    """``torch.compile(block, fullgraph=True)`` with a backend that keeps dynamo's graph and runs it as is: the
    functions the one graph calls, counted (a graph break raises under ``fullgraph=True``)."""
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(block, fullgraph=True, backend=keep)(x)
    assert len(graphs) == 1
    return Counter(node.target for node in graphs[0].graph.nodes if node.op == "call_function")


@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_block_compiles_fullgraph(family):
    """``torch.compile(block, fullgraph=True)`` (``aot_eager``: dynamo's graph through AOTAutograd, no graph break
    possible) gives the block's output and its gradients w.r.t. the input and every parameter. In float32 the graph
    calls transformers' ``grouped_mm_fallback`` op (twice: gate_up, down); in bfloat16, CUDA's dtype, torch's
    ``_grouped_mm`` itself and no fallback. (Inductor also compiles it on CPU, float32 and bfloat16, forward and
    backward, equal to the eager block: 4-40 s a compile on 2 cores, so not run here.)"""
    block = moe_block(family, 64)
    x = block_input(block)
    calls = graph_calls(block, x)
    assert calls[FALLBACK] == 2 and not GROUPED_MM & set(calls)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    results = []
    for run in (block, compiled):
        block.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out, router_logits = run(xg)
        (out.square().sum() + router_logits.square().sum()).backward()
        results.append((out.detach(), router_logits.detach(), xg.grad, [p.grad for p in block.parameters()]))
    (out, logits, x_grad, grads), (c_out, c_logits, c_x_grad, c_grads) = results
    torch.testing.assert_close(c_out, out)
    torch.testing.assert_close(c_logits, logits)
    torch.testing.assert_close(c_x_grad, x_grad)
    for grad, c_grad in zip(grads, c_grads):
        torch.testing.assert_close(c_grad, grad)

    if CPU_GROUPED_MM:
        bf16 = moe_block(family, 64, dtype=torch.bfloat16)
        calls = graph_calls(bf16, block_input(bf16, torch.bfloat16))
        assert sum(calls[f] for f in GROUPED_MM) == 2 and calls[FALLBACK] == 0
    torch._dynamo.reset()


@needs_cpu_grouped_mm
@pytest.mark.parametrize("family", list(BLOCKS))
def test_grouped_mm_forward_reads_no_tensor_data(family):
    """No host synchronisation in a grouped_mm forward. (1) float32, eager: no ``aten._local_scalar_dense``
    (``.item()``, ``bool()``) nor data-dependent shape (``nonzero``), torch's kernel twice and never transformers'
    fallback (which reads the offsets with ``.tolist()``, invisible to a dispatch mode). (2) bfloat16 on fake tensors,
    which hold no data, so any host read (``.item()``, ``.tolist()``, ``nonzero``) raises: the block's forward runs
    (torch's fake ``_grouped_mm`` takes bf16 only, CUDA's dtype); the class's own loop does not (the control)."""
    block = moe_block(family, 64)
    x = block_input(block)
    with OpCounter() as counter:
        block(x)[0].sum().backward()  # the backward too
    ops = counter.ops
    assert ops["aten._grouped_mm.default"] >= 2 and "transformers.grouped_mm_fallback.default" not in ops
    assert not {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"} & set(ops)

    for implementation in ("grouped_mm", "eager"):
        block = moe_block(family, 64, implementation, dtype=torch.bfloat16)
        with FakeTensorMode() as mode:
            fake = {name: mode.from_tensor(t) for name, t in [*block.named_parameters(), *block.named_buffers()]}
            x = mode.from_tensor(block_input(block, torch.bfloat16))
            if implementation == "grouped_mm":
                assert torch.func.functional_call(block, fake, (x,))[0].shape == x.shape
            else:
                with pytest.raises(Exception, match="nonzero"):
                    torch.func.functional_call(block, fake, (x,))


PER_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@pytest.mark.parametrize("family", list(BLOCKS))
def test_per_expert_state_dict_round_trip(family):
    """transformers' ``revert_weight_conversion`` (what ``save_pretrained`` writes) gives the released per-expert keys;
    ``stack_expert_weights`` of them is the model's state dict, tensor for tensor (12 experts, so a lexicographic
    order, 10 before 2, would show); another model's ``load_state_dict`` takes them (a trainer checkpoint resumed) and
    then holds the same tensors. A layer missing a projection is refused."""
    config = native_config({**tiny_original_config(family), "num_experts": 12})
    model_class = NATIVE_LAYOUTS[family].model_class
    torch.manual_seed(0)
    model = model_class(config)
    state = model.state_dict()
    per_expert = revert_weight_conversion(model, state)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    expected = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in moe_layers for e in range(12)
                for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    assert {k for k in per_expert if PER_EXPERT.search(k)} == expected
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in per_expert)
    i = moe_layers[0]
    experts = model.model.layers[i].mlp.experts
    up = experts.gate_up_proj[10, experts.intermediate_dim :]  # expert 10's up rows: the second half
    assert torch.equal(per_expert[f"model.layers.{i}.mlp.experts.10.up_proj.weight"], up)

    stacked = stack_expert_weights(per_expert)
    assert stacked.keys() == state.keys()
    assert all(torch.equal(stacked[k], state[k]) for k in state)

    torch.manual_seed(1)
    resumed = model_class(config)
    assert not torch.equal(resumed.model.layers[i].mlp.experts.down_proj, experts.down_proj)
    result = resumed.load_state_dict(per_expert)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(resumed.state_dict()[k], state[k]) for k in state)

    with pytest.raises(KeyError, match=r"every expert needs .*missing \['0.up_proj'"):
        stack_expert_weights({k: v for k, v in per_expert.items() if ".up_proj." not in k})
    gap = next(k for k in per_expert if ".experts.3.down_proj." in k)  # one expert's projection missing mid-layer
    with pytest.raises(KeyError, match=r"missing \['3.down_proj'\] of 12 experts"):
        stack_expert_weights({k: v for k, v in per_expert.items() if k != gap})
