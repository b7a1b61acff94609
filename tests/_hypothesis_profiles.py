"""Hypothesis settings of the fuzz tests (issue 6), in one place.

Profiles (pick with FSD_FUZZ_PROFILE, default "fsd-ci"):
  fsd-ci    derandomised: the same examples on every run, so CI is reproducible;
  fsd-deep  random examples, for long local or nightly runs.
FSD_FUZZ_EXAMPLES sets the total number of examples of the property fuzz tests (default 10000);
each test takes its share (`fuzz_settings(share)`). Nothing here is loaded globally, so other test
files keep hypothesis' defaults.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile("fsd-ci", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=_SUPPRESSED)
settings.register_profile("fsd-deep", derandomize=False, deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESSED)

PROFILE = os.environ.get("FSD_FUZZ_PROFILE", "fsd-ci")
TOTAL_EXAMPLES = int(os.environ.get("FSD_FUZZ_EXAMPLES", "10000"))


def fuzz_settings(share: float) -> settings:
    """Settings of one fuzz test that runs `share` of FSD_FUZZ_EXAMPLES examples."""
    return settings(settings.get_profile(PROFILE), max_examples=max(1, round(TOTAL_EXAMPLES * share)))
