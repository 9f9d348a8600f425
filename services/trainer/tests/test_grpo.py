"""The GRPO pieces against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet_trainer.advantages import group_normalized_advantages
from rlfleet_trainer.grpo import GrpoConfig, grpo_loss
from rlfleet_trainer.kl import kl_penalty


def test_advantages_are_group_normalized() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_normalized_advantages(rewards, eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = grpo_loss(logp, logp.clone(), adv, mask, GrpoConfig())
    # per-sample means: -1 and +2; summed over samples -> 1
    assert loss.item() == pytest.approx(1.0)
    assert stats["pg_clipfrac"].item() == 0.0
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_clipping_by_hand() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.8, 0.3]]))  # ratios 1.6 and 0.6
    mask = torch.ones(1, 2)
    cfg = GrpoConfig(clip_low=0.2, clip_high=0.28)
    pos, stats = grpo_loss(new, old, torch.tensor([1.0]), mask, cfg)
    # A > 0: min(1.6, 1.28) = 1.28; min(0.6, 0.8) = 0.6 -> -(1.28 + 0.6) / 2
    assert pos.item() == pytest.approx(-(1.28 + 0.6) / 2)
    assert stats["pg_clipfrac"].item() == pytest.approx(1.0)  # both tokens' clipped term differs
    neg, _ = grpo_loss(new, old, torch.tensor([-1.0]), mask, cfg)
    # A < 0: -min(-1.6, -1.28) = 1.6; -min(-0.6, -0.8) = 0.8 -> (1.6 + 0.8) / 2
    assert neg.item() == pytest.approx((1.6 + 0.8) / 2)


def test_clipped_tokens_get_no_gradient() -> None:
    old = torch.log(torch.tensor([[0.5]]))
    new = torch.log(torch.tensor([[0.8]])).requires_grad_(True)  # ratio 1.6 > 1.2
    loss, _ = grpo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 1), GrpoConfig())
    loss.backward()
    assert new.grad is not None and new.grad.item() == 0.0


def test_kl_estimators_by_hand() -> None:
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    r = math.log(0.25 / 0.5)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(r * r / 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(r) - r - 1)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(r) - r - 1)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k9")


def test_kl_term_is_added_with_its_coefficient() -> None:
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    cfg = GrpoConfig(kl_coef=0.1)
    loss, stats = grpo_loss(logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), cfg, ref_logp=ref)
    r = math.log(0.5)
    assert loss.item() == pytest.approx(0.1 * (math.exp(r) - r - 1))
    assert stats["kl"].item() == pytest.approx(math.exp(r) - r - 1)


def test_masked_tokens_do_not_count() -> None:
    logp = torch.zeros(1, 3)
    old = torch.tensor([[0.0, 5.0, 5.0]])  # wild ratios, but masked out
    loss, _ = grpo_loss(logp, old, torch.tensor([1.0]), torch.tensor([[1.0, 0.0, 0.0]]), GrpoConfig())
    assert loss.item() == pytest.approx(-1.0)
