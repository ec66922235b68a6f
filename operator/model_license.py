"""Licence acceptance: the weights a MoEDeployment serves are published under a licence, and the operator fetches
and deploys nothing until the spec records that the deployer accepted it (`spec.model.license: {name, accepted:
true}`). Pure: the spec in, the LicenseAccepted condition out.

Which licence applies: the one the spec names (`spec.model.license.name`), else the one a known published source
declares (PUBLISHED_LICENSES: the operator cannot read a checkpoint's README before fetching it, so the sources it
knows carry their licence here). A checkpoint with neither (a PVC, a path in the image, an unknown source) needs no
acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from expertmesh.operator.spec_model import ModelSpec

# (Hugging Face repository pattern, lowercase, as fnmatch reads it; the licence its model card declares). Moonshot
# AI publishes its Kimi K models under its "Modified MIT" licence (the card's `license_name: modified-mit`).
PUBLISHED_LICENSES: tuple[tuple[str, str], ...] = (("moonshotai/kimi-k*", "modified-mit"),)

CONDITION = "LicenseAccepted"


@dataclass(frozen=True)
class LicenseVerdict:
    """The LicenseAccepted condition: `accepted` False means nothing may be fetched or deployed."""

    accepted: bool
    reason: str  # LicenseAccepted | LicenseNotAccepted | LicenseMismatch
    message: str


def hf_repo(uri: str | None) -> str | None:
    """ORG/NAME of an `hf://ORG/NAME[@REVISION]` source, else None."""
    if not uri or not uri.startswith("hf://"):
        return None
    return uri[len("hf://") :].partition("@")[0]


def published_license(uri: str | None) -> str | None:
    """The licence a known published source declares (None: not one the operator knows)."""
    repo = hf_repo(uri)
    if repo is None:
        return None
    return next((name for pattern, name in PUBLISHED_LICENSES if fnmatchcase(repo.lower(), pattern)), None)


def license_verdict(model: ModelSpec) -> LicenseVerdict | None:
    """Whether the deployer accepted the licence of the weights `model` names (None: no licence applies)."""
    uri = model.checkpoint.uri
    published = published_license(uri)
    declared = model.license
    if published is None and declared is None:
        return None
    if published is not None and declared is not None and declared.name.lower() != published:
        return LicenseVerdict(
            False,
            "LicenseMismatch",
            f"spec.model.license.name={declared.name!r}: {uri} is published under the licence {published!r}; "
            f"name that licence (and accept it) to deploy these weights",
        )
    name = declared.name if declared is not None else published
    if declared is None or not declared.accepted:
        source = f"the weights of {uri}" if published is not None else "these weights"
        return LicenseVerdict(
            False,
            "LicenseNotAccepted",
            f"spec.model.license: {source} are published under the licence {name!r}, not accepted: read it and "
            f"set spec.model.license to {{name: {name}, accepted: true}}; nothing is fetched or deployed before",
        )
    return LicenseVerdict(True, "LicenseAccepted", f"the licence {name!r} accepted (spec.model.license)")
