"""The learned scorer, now at home with its policy in `kvjax.policies.learned`; kept here so
that `kvjax.scorer.Scorer` still imports."""

from kvjax.policies.learned import (  # noqa: F401
    DEFAULT_MODEL,
    FORMAT,
    Scorer,
    default_scorer,
    normalise,
    shipped_path,
)
