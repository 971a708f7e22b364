"""EBPO (trl_dllm.core.objectives.ebpo); expected values are derived by hand in the comments, or by autograd through
a direct transcription of the formula."""

import copy
import math

import pytest
import torch

from trl_dllm.core.likelihood.block import block
from trl_dllm.core.objectives import ObjectiveOutput, ebpo, espo, kl_divergence
from trl_dllm.testing import build_tiny_block_model, build_tokenizer


def _mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def _shifted(logps, mask, per_token_gaps):
    """old_logps with every scored token `gap` below `logps`: `S − S_old = gap · L` per row."""
    return (logps.detach() - torch.tensor(per_token_gaps, dtype=logps.dtype)[:, None]) * mask


def test_the_ratio_is_the_whole_sequence_gap_not_per_token():
    # The same per-token gap 0.1 in rows of lengths 2 and 4: S − S_old = 0.2 and 0.4, so ρ = e^0.2 and e^0.4
    # (ESPO would divide by L: e^0.1 for both).
    mask = _mask([2, 4], 4)
    logps = -torch.ones(2, 4) * mask
    out = ebpo(logps, _shifted(logps, mask, [0.1, 0.1]), None, mask, torch.tensor([1.0, -1.0]))
    assert isinstance(out, ObjectiveOutput) and "kl" not in out.metrics
    torch.testing.assert_close(out.metrics["ratio/min"], torch.tensor(math.exp(0.2)))
    torch.testing.assert_close(out.metrics["ratio/max"], torch.tensor(math.exp(0.4)))
    espo_out = espo(logps, _shifted(logps, mask, [0.1, 0.1]), None, mask, torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(espo_out.metrics["ratio/max"], torch.tensor(math.exp(0.1)))


def test_on_policy_loss_and_gradient():
    # ρ = 1 → ℓ_i = −A_i → loss = −mean(A) = −(2 − 1)/2 = −0.5. ∇ρ_i = ρ_i ∇S_i (no 1/L), so
    # ∂loss/∂c_{i,t} = −A_i m_{i,t} / B: row 0 −2/2 = −1 on its 2 tokens, row 1 +1/2 = 0.5 on its 4.
    mask = _mask([2, 4], 4)
    logps = torch.full((2, 4), -0.7, requires_grad=True)
    out = ebpo(logps, logps.detach(), None, mask, torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(out.loss, torch.tensor(-0.5))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -1.0, 0, 0], [0.5] * 4]))
    torch.testing.assert_close(
        ebpo(logps, None, None, mask, torch.tensor([2.0, -1.0])).loss, out.loss
    )  # None: on-policy


def test_clipping_by_hand():
    # One token per row, so S − S_old is the token gap. ε = 0.2 both sides.
    # Row 0: ρ = 1.5, A = +1 → min(1.5, 1.2) = 1.2 → ℓ = −1.2, clipped (no gradient), counted high.
    # Row 1: ρ = 0.5, A = −1 → min(−0.5, −0.8) = −0.8 → ℓ = 0.8, clipped, counted low.
    # Row 2: ρ = 1.1, A = +2 → inside the range → ℓ = −2.2, ∂ℓ/∂c = −A ρ = −2.2.
    # loss = (−1.2 + 0.8 − 2.2)/3 = −0.8667; gradient of the mean: row 2's −2.2 / 3.
    logps = torch.zeros(3, 1, requires_grad=True)
    old = -torch.log(torch.tensor([[1.5], [0.5], [1.1]]))
    out = ebpo(logps, old, None, torch.ones(3, 1), torch.tensor([1.0, -1.0, 2.0]))
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 + 0.8 - 2.2) / 3))
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0], [0.0], [-2.2 / 3]]))
    torch.testing.assert_close(out.metrics["clip_ratio/high_mean"], torch.tensor(1 / 3))
    torch.testing.assert_close(out.metrics["clip_ratio/low_mean"], torch.tensor(1 / 3))
    torch.testing.assert_close(out.metrics["clip_ratio/region_mean"], torch.tensor(2 / 3))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_on_the_composite_estimates_not_divided_by_the_length(estimator):
    # ρ = 1 and A = 0: only the KL term. Row 0: S = −4, S_ref = −6 (L = 4); row 1: S = S_ref = −2.
    # k2: ½·2² = 2 → loss = β·mean(2, 0) = 0.1; k1: S − S_ref = 2 → 0.1; k3: e^{−2} + 2 − 1 → 0.1·(e^{−2} + 1)/2.
    mask = _mask([4, 2], 4)
    logps = -torch.ones(2, 4) * mask
    ref = torch.stack([torch.full((4,), -1.5), -torch.ones(4)]) * mask
    out = ebpo(logps, logps, ref, mask, torch.zeros(2), beta=0.2, kl_estimator=estimator)
    kl0 = {"k1": 2.0, "k2": 2.0, "k3": math.exp(-2.0) + 1.0}[estimator]
    torch.testing.assert_close(out.loss, torch.tensor(0.2 * kl0 / 2))
    torch.testing.assert_close(out.metrics["kl"], torch.tensor(kl0 / 2))
    with pytest.raises(ValueError, match="beta=0.2 needs ref_logps"):
        ebpo(logps, logps, None, mask, torch.zeros(2), beta=0.2)


def test_equals_autograd_through_the_formula():
    # Random contributions, old and reference estimates, advantages of both signs: loss and gradient against a direct
    # transcription of the module docstring's formula.
    g = torch.Generator().manual_seed(0)
    mask = _mask([3, 5, 1, 4], 5)
    logps = (-torch.rand(4, 5, generator=g) * mask).requires_grad_(True)
    old = (logps.detach() + 0.15 * torch.randn(4, 5, generator=g)) * mask
    ref = (logps.detach() + 0.3 * torch.randn(4, 5, generator=g)) * mask
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    eps_low, eps_high, beta = 0.1, 0.3, 0.05
    out = ebpo(logps, old, ref, mask, adv, epsilon_low=eps_low, epsilon_high=eps_high, beta=beta, kl_estimator="k3")
    grad = torch.autograd.grad(out.loss, logps)[0]

    reference_logps = logps.detach().clone().requires_grad_(True)
    s, s_old, s_ref = (reference_logps * mask).sum(-1), (old * mask).sum(-1), (ref * mask).sum(-1)
    rho = torch.exp(s - s_old)
    surrogate = torch.min(rho * adv, rho.clamp(1 - eps_low, 1 + eps_high) * adv)
    expected = (-surrogate + beta * (torch.exp(s_ref - s) - (s_ref - s) - 1)).mean()
    expected_grad = torch.autograd.grad(expected, reference_logps)[0]
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert (rho < 1 - eps_low).any() or (rho > 1 + eps_high).any()  # the case exercises the clip


def test_with_unit_lengths_it_is_espo():
    # ESPO divides the log-ratio and the KL by L; at L = 1 the two objectives coincide.
    g = torch.Generator().manual_seed(1)
    logps, old, ref = (torch.randn(6, 1, generator=g) for _ in range(3))
    adv, mask = torch.randn(6, generator=g), torch.ones(6, 1)
    ours = ebpo(logps, old, ref, mask, adv, beta=0.1)
    theirs = espo(logps, old, ref, mask, adv, beta=0.1)
    torch.testing.assert_close(ours.loss, theirs.loss)
    assert ours.metrics.keys() == theirs.metrics.keys()


def test_the_ratio_of_block_estimates_is_the_composite_block_elbo():
    """EBPO's estimate is the `block` estimator's: the mean over the N views (timesteps, w_n = 1/N) of the sum over
    blocks of each block's ELBO, the same views (seeds) under the current and the old weights."""
    tokenizer = build_tokenizer()
    model = build_tiny_block_model(tokenizer, block_length=4, seed=0)
    old_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in old_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    g = torch.Generator().manual_seed(3)
    prompt_ids, prompt_mask = torch.randint(5, 60, (2, 4), generator=g), torch.ones(2, 4, dtype=torch.long)
    completion_ids, score_mask = torch.randint(5, 60, (2, 8), generator=g), torch.ones(2, 8)
    kwargs = dict(mask_token_id=tokenizer.mask_token_id, seeds=torch.tensor([7, 8]), block_length=4, mc_samples=3)
    with torch.no_grad():
        now = block(model, prompt_ids, prompt_mask, completion_ids, score_mask, **kwargs)
        then = block(old_model, prompt_ids, prompt_mask, completion_ids, score_mask, **kwargs)
    composite, old_composite = now.sample_estimates.mean(-1), then.sample_estimates.mean(-1)  # Σ_n (1/N) Σ_b ELBO_b
    torch.testing.assert_close(now.logps.sum(-1), composite, atol=1e-5, rtol=0)
    out = ebpo(now.logps, then.logps, None, score_mask, torch.ones(2), epsilon_low=10.0, epsilon_high=10.0)
    expected = torch.exp(composite - old_composite)
    torch.testing.assert_close(out.metrics["ratio/max"], expected.max(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.metrics["ratio/min"], expected.min(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected, torch.ones(2))  # the old weights differ: a non-trivial ratio


def test_kl_is_the_shared_estimator():
    # The KL term is `_common.kl_divergence` on the sequence sums (one definition).
    s, s_ref = torch.tensor([-3.0]), torch.tensor([-2.0])
    out = ebpo(s[:, None], s[:, None], s_ref[:, None], torch.ones(1, 1), torch.zeros(1), beta=1.0)
    torch.testing.assert_close(out.loss, kl_divergence(s, s_ref, "k2")[0])
