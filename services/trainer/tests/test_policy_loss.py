"""The policy-loss pieces against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet_trainer.aggregation import denominator, numerator
from rlfleet_trainer.kl import kl_penalty
from rlfleet_trainer.off_policy import ratio_band_mask, tis_weights
from rlfleet_trainer.policy_loss import PolicyLossConfig, policy_loss


def log(values: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(values))


def test_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    logp = log([[0.5, 0.25], [0.5, 0.25]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = policy_loss(logp, logp.clone(), adv, mask, PolicyLossConfig())
    # per-sample means: -1 and +2; summed over samples -> 1
    assert loss.item() == pytest.approx(1.0)
    assert stats["pg_clipfrac"].item() == 0.0
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_token_clipping_by_hand() -> None:
    old = log([[0.5, 0.5]])
    new = log([[0.8, 0.3]])  # ratios 1.6 and 0.6
    mask = torch.ones(1, 2)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    pos, stats = policy_loss(new, old, torch.ones(1, 2), mask, cfg)
    # A > 0: min(1.6, 1.28) = 1.28 (clipped); min(0.6, 0.8) = 0.6 (not) -> -(1.28 + 0.6) / 2
    assert pos.item() == pytest.approx(-(1.28 + 0.6) / 2)
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)
    neg, stats = policy_loss(new, old, -torch.ones(1, 2), mask, cfg)
    # A < 0: -min(-1.6, -1.28) = 1.6 (not); -min(-0.6, -0.8) = 0.8 (clipped) -> (1.6 + 0.8) / 2
    assert neg.item() == pytest.approx((1.6 + 0.8) / 2)
    assert stats["pg_clipfrac"].item() == pytest.approx(0.5)


def test_clipped_tokens_get_no_gradient() -> None:
    old = log([[0.5]])
    new = log([[0.8]]).requires_grad_(True)  # ratio 1.6 > 1.2
    loss, _ = policy_loss(new, old, torch.ones(1, 1), torch.ones(1, 1), PolicyLossConfig())
    loss.backward()
    assert new.grad is not None and new.grad.item() == 0.0


def test_gspo_clips_the_geometric_mean_of_the_sequence() -> None:
    old = log([[0.5, 0.5]])  # the trainer's log-probs before the step's first update (a later update)
    new = log([[0.6, 0.45]])  # token ratios 1.2 and 0.9: s = sqrt(1.08) = 1.03923
    cfg = PolicyLossConfig(clip_low=3e-4, clip_high=4e-4, sequence_ratio=True)
    pos, stats = policy_loss(new, old, torch.ones(1, 2), torch.ones(1, 2), cfg, pre_update_logp=old)
    assert pos.item() == pytest.approx(-1.0004)  # min(1.03923, 1.0004)
    assert stats["pg_clipfrac"].item() == 1.0
    neg, _ = policy_loss(new, old, -torch.ones(1, 2), torch.ones(1, 2), cfg, pre_update_logp=old)
    assert neg.item() == pytest.approx(math.sqrt(1.08))  # -min(-1.03923, -1.0004)
    # Unclipped, every token gets the gradient s * A / |y| of the sequence ratio.
    new = log([[0.5, 0.5]]).requires_grad_(True)
    loss, _ = policy_loss(new, old, torch.ones(1, 2), torch.ones(1, 2), cfg, pre_update_logp=old)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([-0.5, -0.5])  # d(-s)/dlogp_t = -s / |y| with s = 1


def test_gspos_old_policy_is_the_trainers_not_the_rollouts() -> None:
    """The engines' numerics differ from the trainer's: a sequence whose mean log-prob gap passed GSPO's 4e-4 got
    no gradient before the policy had moved at all. In the step's first update the ratio is 1, as in verl."""
    rollout = log([[0.5, 0.5]])
    trainer = log([[0.51, 0.5]])  # a gap of 0.01 on one token: s = 1.00995, far past 1 + 4e-4
    cfg = PolicyLossConfig(clip_low=3e-4, clip_high=4e-4, sequence_ratio=True)
    loss, stats = policy_loss(trainer.requires_grad_(True), rollout, torch.ones(1, 2), torch.ones(1, 2), cfg)
    assert loss.item() == pytest.approx(-1.0) and stats["pg_clipfrac"].item() == 0.0
    loss.backward()
    assert trainer.grad is not None and trainer.grad[0].tolist() == pytest.approx([-0.5, -0.5])


def test_tis_weights_by_hand() -> None:
    logp, rollout = log([[0.5, 0.2]]), log([[0.25, 0.4]])  # rho = 2 and 0.5
    assert tis_weights(logp, rollout, cap=1.5)[0].tolist() == pytest.approx([1.5, 0.5])
    # With TIS the ratio is against the trainer's own log-probs (1 here): loss = -mean(w * A).
    logp.requires_grad_(True)
    loss, stats = policy_loss(logp, rollout, torch.ones(1, 2), torch.ones(1, 2), PolicyLossConfig(tis_cap=1.5))
    assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2)
    assert stats["tis_weight"].item() == pytest.approx(1.0)
    assert stats["pg_clipfrac"].item() == 0.0
    loss.backward()
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx([-0.75, -0.25])


def test_a_later_update_takes_ratio_weights_and_band_against_the_log_probs_before_the_step() -> None:
    rollout = log([[0.5, 0.5, 0.5]])
    before = log([[0.6, 0.25, 0.5]])  # pi_train / pi_rollout before the step's first update: 1.2, 0.5, 1
    now = log([[0.9, 0.25, 0.05]])  # after it: ratios to `before` 1.5, 1, 0.1
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2, clip_ratio_c=0, tis_cap=2.0, ratio_mask_high=1.1)
    ones = torch.ones(1, 3)
    loss, stats = policy_loss(now, rollout, ones, ones, cfg, pre_update_logp=before)
    # Token 1 (rho 1.2) leaves the band; token 2: ratio 1, weight 0.5; token 3: ratio 0.1, weight 1.
    assert loss.item() == pytest.approx(-(0.5 + 0.1) / 3)
    assert stats["tis_weight"].item() == pytest.approx((1.2 + 0.5 + 1.0) / 3)
    assert stats["ratio_masked_frac"].item() == pytest.approx(1 / 3)
    assert stats["pg_clipfrac"].item() == pytest.approx(0.0)  # token 3's ratio is below the clip, but A > 0
    neg, stats = policy_loss(now, rollout, -ones, ones, cfg, pre_update_logp=before)
    assert neg.item() == pytest.approx((0.5 + 0.8) / 3) and stats["pg_clipfrac"].item() == pytest.approx(0.5)
    # The step's only update: its current log-probs are the pre-update ones, so the ratio is 1 and nothing clips.
    _, alone = policy_loss(now, rollout, -ones, ones, cfg)
    assert alone["pg_clipfrac"].item() == 0.0 and alone["tis_weight"].item() == pytest.approx((1.8 + 0.5 + 0.1) / 3)


def test_ratio_band_masks_tokens_out_of_the_loss() -> None:
    rollout = log([[0.25, 0.5, 0.5]])
    logp = log([[0.5, 0.5, 0.2]])  # rho = 2, 1, 0.4
    assert ratio_band_mask(logp, rollout, 0.5, 1.5).tolist() == [[0.0, 1.0, 0.0]]
    assert ratio_band_mask(logp, rollout, 0.0, 1.5).tolist() == [[0.0, 1.0, 1.0]]  # 0: the bound is off
    cfg = PolicyLossConfig(ratio_mask_low=0.5, ratio_mask_high=1.5)
    loss, stats = policy_loss(logp, rollout, torch.ones(1, 3), torch.ones(1, 3), cfg)
    assert loss.item() == pytest.approx(-1.0 / 3)  # only the middle token counts, over the sample's 3 tokens
    assert stats["ratio_masked_frac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_token_the_band_leaves_out_takes_no_part_in_gspos_sequence_ratio(advantage: float) -> None:
    """The outlier (ratio e^3) stayed in the geometric mean: with A > 0 the ratio passed GSPO's clip and the whole
    sequence got no gradient, with A < 0 every token's gradient was scaled up, the banded token's included."""
    rollout = log([[0.5, 0.5, 0.5, 0.5]])
    logp = (rollout + torch.tensor([[0.0, 0.0, 0.0, 3.0]])).requires_grad_(True)
    cfg = PolicyLossConfig(clip_low=3e-4, clip_high=4e-4, sequence_ratio=True, ratio_mask_low=0.5, ratio_mask_high=2.0)
    loss, _ = policy_loss(logp, rollout, torch.full((1, 4), advantage), torch.ones(1, 4), cfg)
    loss.backward()
    assert logp.grad is not None
    # The three kept tokens' ratio is 1: each gets -A / 3 of the sequence's term, over the sample's 4 tokens.
    assert logp.grad[0].tolist() == pytest.approx([-advantage / 4] * 3 + [0.0])


def test_kl_estimators_by_hand() -> None:
    logp = log([[0.5]])
    ref = log([[0.25]])
    r = math.log(0.25 / 0.5)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(r * r / 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(r) - r - 1)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(r) - r - 1)
    for estimator in ("k3", "low_var_kl"):  # clamped, as verl and OpenRLHF clamp k3
        assert kl_penalty(torch.tensor([[-20.0]]), torch.tensor([[-8.0]]), estimator).item() == 10.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k9")


def test_kl_and_entropy_terms_with_their_coefficients() -> None:
    logp = log([[0.5]])
    ref = log([[0.25]])
    entropy = torch.tensor([[0.7]])
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, stats = policy_loss(logp, logp.clone(), torch.zeros(1, 1), torch.ones(1, 1), cfg, ref, entropy)
    r = math.log(0.5)
    assert loss.item() == pytest.approx(0.1 * (math.exp(r) - r - 1) - 0.01 * 0.7)
    assert stats["kl"].item() == pytest.approx(math.exp(r) - r - 1)
    assert stats["entropy"].item() == pytest.approx(0.7)


def test_masked_tokens_do_not_count() -> None:
    logp = torch.zeros(1, 3)
    old = torch.tensor([[0.0, 5.0, 5.0]])  # wild ratios, but masked out
    loss, _ = policy_loss(logp, old, torch.ones(1, 3), torch.tensor([[1.0, 0.0, 0.0]]), PolicyLossConfig())
    assert loss.item() == pytest.approx(-1.0)


def test_aggregations_by_hand() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # seq_mean_token_mean: (mean(1, 2, 3) + 4) / 2 sequences
    assert numerator(per_token, mask, "seq_mean_token_mean", 5).item() / denominator("seq_mean_token_mean", 2, 4) == 3
    # token_mean: (1 + 2 + 3 + 4) / 4 tokens
    assert numerator(per_token, mask, "token_mean", 5).item() / denominator("token_mean", 2, 4) == 2.5
    # seq_mean_token_sum_norm: (6 / 5 + 4 / 5) / 2 sequences
    agg = numerator(per_token, mask, "seq_mean_token_sum_norm", 5).item() / denominator("seq_mean_token_sum_norm", 2, 4)
    assert agg == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        numerator(per_token, mask, "sum", 5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("gap", [-100.0, 100.0])
def test_far_apart_log_probs_give_a_finite_loss_and_gradient(estimator: str, gap: float) -> None:
    """A token the engine sampled at log-prob -100 (or the reference puts there): an unbounded exp gave
    an infinite ratio or KL and a NaN gradient, which skipped the whole step's update."""
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    far = logp.detach() + torch.tensor([[gap, 0.0]])
    cfg = PolicyLossConfig(kl_coef=0.1, kl_estimator=estimator, tis_cap=2.0, ratio_mask_high=5.0)
    for rollout, ref in ((far, logp.detach()), (logp.detach(), far)):
        for config in (cfg, PolicyLossConfig(kl_coef=0.1, kl_estimator=estimator)):
            loss, stats = policy_loss(logp, rollout, -torch.ones(1, 2), torch.ones(1, 2), config, ref)
            (grad,) = torch.autograd.grad(loss, logp)
            assert math.isfinite(loss.item()) and bool(torch.isfinite(grad).all()), (loss, grad)
            assert all(math.isfinite(v.item()) for v in stats.values()), stats


def test_dual_clip_bounds_a_negative_advantages_loss() -> None:
    """verl's dual clip (clip_ratio_c 3): ratio 5 with A = -1 gives loss 3 and no gradient, not 5 and 5;
    a positive advantage and a ratio below c are untouched."""
    rollout = log([[0.1, 0.1, 0.1]])
    logp = log([[0.5, 0.5, 0.2]]).requires_grad_(True)  # ratios 5, 5, 2
    advantages = torch.tensor([[-1.0, 1.0, -1.0]])
    cfg = PolicyLossConfig(aggregation="token_mean", clip_ratio_c=3.0)
    loss, stats = policy_loss(logp, rollout, advantages, torch.ones(1, 3), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    # token 0: min(5, 3) = 3, no gradient; token 1: -min(5, 1.2) = -1.2 (upper clip); token 2: max(2, 0.8) = 2
    assert loss.item() == pytest.approx(3.0 - 1.2 + 2.0)
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == 0.0 and grad[0, 2].item() == pytest.approx(2.0)
    assert stats["pg_dual_clipfrac"].item() == pytest.approx(1 / 3)
    off, off_stats = policy_loss(
        logp, rollout, advantages, torch.ones(1, 3), PolicyLossConfig(aggregation="token_mean")
    )
    assert off.item() == pytest.approx(5.0 - 1.2 + 2.0) and "pg_dual_clipfrac" not in off_stats


@pytest.mark.parametrize(
    "config",
    [
        PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, ratio_mask_low=0.5, ratio_mask_high=2.0),
        PolicyLossConfig(sequence_ratio=True, clip_low=3e-4, clip_high=4e-4, tis_cap=2.0, ratio_mask_low=0.5),
        PolicyLossConfig(aggregation="token_mean", kl_coef=0.1, kl_estimator="k1"),
    ],
)
def test_environment_tokens_inside_a_response_move_nothing(config: PolicyLossConfig) -> None:
    """A multi-turn response holds a tool's reply (loss mask 0) between the policy's turns; the engine and the
    reference report whatever they like there. Neither the loss, its gradient nor a statistic may see it, through
    any term (KL, entropy, TIS, the band, GSPO's sequence ratio)."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0, 1.0]])
    generator = torch.Generator().manual_seed(3)
    logp = -1.0 + 0.3 * torch.randn(2, 5, generator=generator)
    rollout = logp + 0.05 * torch.randn(2, 5, generator=generator)
    ref = logp + 0.1 * torch.randn(2, 5, generator=generator)
    before = logp + 0.01 * torch.randn(2, 5, generator=generator)
    entropy = torch.rand(2, 5, generator=generator)
    advantages = torch.tensor([[1.0], [-0.5]]).expand(2, 5)
    runs = []
    for tool_logp in (0.0, -60.0):
        current = logp.clone().requires_grad_(True)
        off_mask = torch.full_like(logp, tool_logp)
        loss, stats = policy_loss(
            current,
            torch.where(mask > 0, rollout, off_mask),
            advantages,
            mask,
            config,
            torch.where(mask > 0, ref, off_mask),
            entropy,
            before,
        )
        (grad,) = torch.autograd.grad(loss, current)
        assert bool((grad[mask == 0] == 0).all())
        runs.append((loss.item(), grad, {name: value.item() for name, value in stats.items()}))
    (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = runs
    assert loss_a == loss_b and torch.equal(grad_a, grad_b) and stats_a == stats_b
