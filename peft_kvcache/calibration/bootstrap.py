"""The percentile bootstrap over examples that every interval of calibration's choices and retention reports shares:
examples resampled with replacement, a fixed seed, so one set of scores always gives one interval."""

from __future__ import annotations

import torch

BOOTSTRAP = 2000  # resamples: the 2.5% and 97.5% quantiles settle to ~0.005 of the spread


def resample_indices(count: int, resamples: int = BOOTSTRAP, seed: int = 0) -> torch.Tensor:
    """``[resamples, count]`` example indices drawn with replacement, the same for the same arguments."""
    if count < 1:
        raise ValueError("a bootstrap needs at least one example")
    return torch.randint(0, count, (resamples, count), generator=torch.Generator().manual_seed(seed))


def bootstrap_interval(values: torch.Tensor, resamples: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-example ``values`` (or of paired differences).

    Example:
        >>> low, high = bootstrap_interval(torch.tensor([0.1, 0.2, 0.3, 0.2]))
        >>> 0.1 <= low <= 0.2 <= high <= 0.3
        True
    """
    means = values.double()[resample_indices(values.numel(), resamples, seed)].mean(-1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


__all__ = ["BOOTSTRAP", "bootstrap_interval", "resample_indices"]
