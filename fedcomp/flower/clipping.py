"""What a client sends stays within Flower's DP clipping norm, error feedback included.

Flower's central differential privacy with client-side clipping
(``DifferentialPrivacyClientSideFixedClipping`` / ``...AdaptiveClipping`` on the server, which add
Gaussian noise calibrated to the clipping norm) expects each client's contribution to have an L2
norm of at most ``clipping_norm``, a key the wrapper adds to every train message's config. Flower's
``fixedclipping_mod`` clips the trained model's update; with error feedback that is not what is
sent: the codec compresses the update *plus the residual* of earlier rounds (the setting of
tests/flower/test_differential_privacy.py, updates in one direction clipped by
``fixedclipping_mod``, SBC at p = 0.2: 0.63x the norm sent in round 1, 1.24x in round 2, 1.73x in
round 5, and growing). :func:`fedcomp.flower.mod.compression_mod` therefore clips what it sends:
when the config carries ``clipping_norm``, it compresses the update with the residual, as always,
measures what the server will decode, and where that is longer than the norm compresses again the
update and the residual scaled down to fit, dropping what was scaled away (as clipping drops it).
SBC, top-k, STC, DEFT and dense fp32 scale with their input and fit at the second encoding; dense
fp16's rounding and GradiVeQ's mean may take more (at most six). A message that cannot be fitted is
not sent (the reply is an error). An encode that binds thus costs about twice the encode time.

The update itself is not clipped first, unlike ``fixedclipping_mod``: only the message's norm
enters the noise's calibration, and on MNIST (10 clients, 20 rounds, clipping norm 1, SBC + the
lattice downlink) clipping the update first ended at 0.9361, this rule at 0.9444; scaling the
accumulator to the norm before compressing (the first rule tried) at 0.9075 (docs/RESULTS.md).
The residual levels off at one to three times the norm. Put ``adaptiveclipping_mod`` inside for
adaptive clipping (its norm bit), not ``fixedclipping_mod`` (harmless, but it clips the update
first). A departure of our own: none of the five papers combines compression with differential
privacy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fedcomp.errors import ConfigError

__all__ = ["CLIPPING_NORM_KEY", "clipping_norm_of"]

#: The key Flower's client-side DP wrappers set in the train config
#: (``flwr.supercore.differential_privacy.KEY_CLIPPING_NORM``; a test pins the two equal).
CLIPPING_NORM_KEY = "clipping_norm"


def clipping_norm_of(config: Mapping[str, object] | None) -> float | None:
    """The clipping norm a train message's config asks for, or None when it asks for none.

    Raises :class:`ConfigError` naming the key when its value is not a finite number > 0."""
    if config is None or CLIPPING_NORM_KEY not in config:
        return None
    value = config[CLIPPING_NORM_KEY]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{CLIPPING_NORM_KEY}: must be a finite number > 0 (got {value!r})")
    return float(value)
