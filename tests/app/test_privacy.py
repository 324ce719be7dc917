"""The reference app's central-DP pieces: the ClientApp's own clip (``clip_update``) and the
strategy ``dp-clipping`` picks. The bound on what a compressed client sends is pinned in
tests/flower/test_differential_privacy.py, a real run in tests/test_run_command.py."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

from fedcomp.app.apps import clip_update, privacy_spent, with_central_dp
from fedcomp.app.checkpoint import ServerCheckpoint, load_checkpoint, save_checkpoint
from fedcomp.app.config import AppConfig


def _norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a))


def test_clip_update_scales_the_update_to_the_bound_and_leaves_integer_buffers() -> None:
    g = torch.Generator().manual_seed(0)
    received = {"w": torch.randn(300, generator=g), "b": torch.randn(7, generator=g), "count": torch.tensor(3)}
    trained = {"w": received["w"] + torch.randn(300, generator=g), "b": received["b"] + 1.0, "count": torch.tensor(9)}
    before = _norm({k: trained[k] for k in ("w", "b")}, received)
    clipped = clip_update(trained, received, 0.5)
    assert before > 10 and abs(_norm({k: clipped[k] for k in ("w", "b")}, received) - 0.5) < 1e-6
    # The same direction, only shorter.
    expected = (trained["w"] - received["w"]) * (0.5 / before)
    torch.testing.assert_close(clipped["w"] - received["w"], expected, rtol=1e-5, atol=1e-6)
    assert int(clipped["count"]) == 9  # a counter is not a parameter
    assert clip_update(trained, received, 2 * before) is trained  # within the bound: untouched


def test_dp_clipping_picks_flowers_wrapper_with_the_runs_settings() -> None:
    for where, kind in (
        ("client", DifferentialPrivacyClientSideFixedClipping),
        ("server", DifferentialPrivacyServerSideFixedClipping),
    ):
        cfg = AppConfig.from_run_config({"dp-clipping-norm": 0.3, "dp-noise-multiplier": 0.7, "dp-clipping": where})
        dp = with_central_dp(FedAvg(), cfg, sampled=5, population=8)
        assert isinstance(dp, kind)
        assert (dp.clipping_norm, dp.noise_multiplier, dp.num_sampled_clients) == (0.3, 0.7, 5)


def test_with_noise_the_wrapper_accounts_privacy_and_a_checkpoint_carries_it(tmp_path: Path) -> None:
    """Noise > 0: an RDP accountant over the population, no amplification; its state goes into the
    server's checkpoint and comes back, so a resumed run keeps counting from where it stopped."""
    cfg = AppConfig.from_run_config({"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "dp-delta": 1e-6})
    dp = with_central_dp(FedAvg(), cfg, sampled=3, population=10)
    assert dp.accountant is not None and privacy_spent(dp) == {"dp_epsilon": 0.0, "dp_delta": 1e-6}  # no release yet
    assert dp.accountant.config.population_size == 10 and dp.accountant.config.target_delta == 1e-6
    event = GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=3, population_size=10)
    dp.accountant.compose(event, count=4)
    spent = privacy_spent(dp)
    assert spent["dp_delta"] == 1e-6 and spent["dp_epsilon"] > 0
    ckpt = ServerCheckpoint(1, {"w": torch.zeros(2)}, None, [{"round": 1}], {}, privacy=dp.accountant.state_dict())
    save_checkpoint(tmp_path, ckpt)
    resumed = with_central_dp(FedAvg(), cfg, sampled=3, population=10)
    privacy = load_checkpoint(tmp_path).privacy
    assert privacy is not None
    resumed.accountant.load_state_dict(privacy)
    assert privacy_spent(resumed) == spent
    # No noise, no accountant (Flower's accountant needs noise); no DP wrapper, nothing to report.
    assert with_central_dp(FedAvg(), AppConfig.from_run_config({"dp-clipping-norm": 1.0}), 3, 10).accountant is None
    assert privacy_spent(FedAvg()) == {} and privacy_spent(None) == {}
