"""Hypothesis profiles: every CI run draws the same examples, and a failure says how to replay it.

``ci`` (the default): derandomized (examples are a function of the test's source, so two runs of
the same commit test the same inputs), no example database, no deadline (a deadline is a timing
assertion, and this suite runs on shared 2-core machines), and ``print_blob`` so a failure prints
the ``@reproduce_failure(...)`` decorator that replays it exactly.

``dev``: random examples, more of them, with the local example database (``.hypothesis/``), for
hunting new counterexamples locally: ``HYPOTHESIS_PROFILE=dev python3 -m pytest tests/codecs``.

``mutation``: ``ci`` without shrinking, for scripts/mutation.sh.

``HYPOTHESIS_PROFILE`` picks the profile (``--hypothesis-profile`` on the command line wins over
both). Tests that set ``max_examples`` themselves (costly properties) keep their own budget in
every profile; everything else inherits the profile's.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    derandomize=True,  # implies database=None
    deadline=None,
    print_blob=True,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    derandomize=False,
    deadline=None,
    print_blob=True,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
# scripts/mutation.sh: the ci examples, but a failure is not shrunk (a mutant is killed by the
# first failing example; shrinking one can take longer than running the suite)
settings.register_profile(
    "mutation",
    settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
