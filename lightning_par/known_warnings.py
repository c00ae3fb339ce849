"""Third-party warnings a lightning_par run would print on every rank, that no user can act on.

Each filter is narrow (message, category and the module that warns) and names where the cause is fixed, so that it
can go when the pinned version moves past it. Installed by every lightning_par strategy when it is built.
"""

from __future__ import annotations

import warnings

#: (message regex, category, module regex, why it is harmless)
KNOWN = [
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree",
     "Lightning 2.6 builds torch's LeafSpec, deprecated in torch 2.13, when it moves a batch to the device"),
]


def silence_known_warnings() -> None:
    for message, category, module, _why in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
