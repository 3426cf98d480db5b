"""Storage media behind one small Tier interface: host RAM, local disk, PFS, Redis, GPU."""

from tiers.base import Tier, TierError, TierFull, TierUnavailable

__all__ = ["Tier", "TierError", "TierFull", "TierUnavailable"]
