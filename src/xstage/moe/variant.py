"""Deprecated: `Variant` moved to `xstage.spec.variant` (data every floor agrees on).

Importing this module warns once and re-exports `Variant` and `parse_variants`; `xstage.moe.Variant`
stays public without a warning.
"""

import warnings

from xstage.spec.variant import Variant, parse_variants  # noqa: F401

warnings.warn("xstage.moe.variant moved to xstage.spec.variant; import it from there", DeprecationWarning,
              stacklevel=2)
