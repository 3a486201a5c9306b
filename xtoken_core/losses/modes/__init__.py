"""The KD modes, one module each, and their registry: a new mode is its module (a
:class:`~xtoken_core.losses.modes.base.KDMode` with its reference and its kernel path) and one
line in :data:`MODES`."""

from xtoken_core.losses.modes.base import KDMode, KDTerms
from xtoken_core.losses.modes.gold import Gold, RelaxedGold
from xtoken_core.losses.modes.pkl import PKL

#: KD mode name (the loss config's ``mode``) -> its class.
MODES: dict[str, type[KDMode]] = {
    "pkl": PKL,
    "gold": Gold,
    "xtoken": RelaxedGold,
}

__all__ = ["MODES", "KDMode", "KDTerms"]
