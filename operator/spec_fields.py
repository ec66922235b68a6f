"""What the MoEDeployment's models (operator/spec.py, operator/spec_model.py) are built from: the base model
(camelCase in YAML, unknown fields rejected), the checked string and quantity types whose bounds and patterns the
CRD's schema carries, and container resources."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from expertmesh.operator.validation import (
    ABSOLUTE_PATH,
    DNS1123_SUBDOMAIN,
    DNS1123_SUBDOMAIN_MAX,
    LABEL_VALUE,
    LABEL_VALUE_MAX,
    NO_SPACE,
    PATH_MAX,
    QUALIFIED_NAME,
    QUALIFIED_NAME_MAX,
    QUANTITY,
    QUANTITY_MAX,
    SECRET_KEY,
    URL_MAX,
    absolute_path_error,
    dns_subdomain_error,
    is_extended_resource,
    label_value_error,
    parse_quantity,
    qualified_name_error,
    resource_name_error,
)

GPU_RESOURCE = "nvidia.com/gpu"
MAX_RESOURCE_ENTRIES = 16
MAX_RESOURCE_INT = 10**15  # an integer quantity (bytes, cores, devices)

# Applied to nested objects with all-default fields so the API server fills their defaults in even when the
# user leaves the whole object out (Kubernetes only defaults fields whose parent object exists).
DEFAULT_EMPTY = {"default": {}}


class SpecModel(BaseModel):
    """camelCase in YAML, unknown fields rejected (a typo is an error, not silently ignored)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", allow_inf_nan=False)


def checked_string(check, max_length: int, pattern: str | None = None, **field):
    """A string field bounded by `max_length` and, in the schema, `pattern`; pydantic runs `check` (value → what is
    wrong, or None) so that the message says what was expected in words rather than as a regular expression."""

    def run(value: str) -> str:
        err = check(value)
        if err:
            raise ValueError(f"{value[:80]!r} {err}")
        return value

    extra = {"pattern": pattern} if pattern else {}
    return Annotated[str, Field(max_length=max_length, json_schema_extra=extra or None, **field), AfterValidator(run)]


def pattern_check(pattern: str, what: str):
    return lambda v: None if re.fullmatch(pattern, v) else f"must be {what}"


DNSName = checked_string(dns_subdomain_error, DNS1123_SUBDOMAIN_MAX, DNS1123_SUBDOMAIN, min_length=1)
QualifiedName = checked_string(qualified_name_error, QUALIFIED_NAME_MAX, QUALIFIED_NAME, min_length=1)
QualifiedNameKey = checked_string(qualified_name_error, QUALIFIED_NAME_MAX, min_length=1)  # a map key: no pattern in a
LabelValue = checked_string(label_value_error, LABEL_VALUE_MAX, LABEL_VALUE)  # structural schema
SecretKey = checked_string(
    pattern_check(SECRET_KEY, "a Secret key (letters, digits, '-', '_' and '.')"),
    DNS1123_SUBDOMAIN_MAX,
    SECRET_KEY,
    min_length=1,
)
AbsolutePath = checked_string(absolute_path_error, PATH_MAX, ABSOLUTE_PATH, min_length=1)
URL = checked_string(
    pattern_check(r"^https?://[^\s\x00-\x1f\x7f]+$", "an http:// or https:// URL without spaces"),
    URL_MAX,
    r"^https?://[^\s\x00-\x1f\x7f]+$",
    min_length=1,
)
Endpoint = checked_string(
    pattern_check(NO_SPACE, "an endpoint without spaces or control characters"), URL_MAX, NO_SPACE, min_length=1
)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, int) and not 0 <= value <= MAX_RESOURCE_INT:
        raise ValueError(f"{value} must be between 0 and {MAX_RESOURCE_INT}")
    parse_quantity(value)  # ValueError naming the value
    return value


def _check_resource_name(name: str) -> str:
    err = resource_name_error(name)
    if err:
        raise ValueError(f"{name[:80]!r} {err}")
    return name


IntOrString = int | str  # a Kubernetes quantity ("500m", "16Gi", 2); becomes x-kubernetes-int-or-string
Quantity = Annotated[
    IntOrString,
    AfterValidator(_check_quantity),
    Field(
        json_schema_extra={"pattern": QUANTITY, "maxLength": QUANTITY_MAX, "minimum": 0, "maximum": MAX_RESOURCE_INT}
    ),
]
ResourceName = Annotated[str, Field(max_length=QUALIFIED_NAME_MAX), AfterValidator(_check_resource_name)]


class Resources(SpecModel):
    """Container resources (the `resources` of a Kubernetes container, without `claims`). Extended resources
    (e.g. GPUs) must have requests equal to limits; GPUs come from `gpusPerPod`."""

    limits: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=MAX_RESOURCE_ENTRIES)
    requests: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=MAX_RESOURCE_ENTRIES)

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        for name, request in self.requests.items():
            limit = self.limits.get(name)
            if is_extended_resource(name) and limit is None:
                raise ValueError(f"requests[{name!r}]: an extended resource needs a limit equal to its request")
            if limit is None:
                continue
            req, lim = parse_quantity(request), parse_quantity(limit)
            if is_extended_resource(name) and req != lim:
                raise ValueError(
                    f"requests[{name!r}]={request} must equal limits[{name!r}]={limit} (an extended "
                    f"resource cannot be overcommitted)"
                )
            if req > lim:
                raise ValueError(f"requests[{name!r}]={request} exceeds limits[{name!r}]={limit}")
        return self

    def check_gpus(self, gpus: int) -> None:
        """GPUs are the workers' `gpusPerPod`: a GPU figure in resources must say the same."""
        for where, values in (("limits", self.limits), ("requests", self.requests)):
            if GPU_RESOURCE in values and parse_quantity(values[GPU_RESOURCE]) != Decimal(gpus):
                raise ValueError(
                    f"resources.{where}[{GPU_RESOURCE!r}]={values[GPU_RESOURCE]} must equal "
                    f"gpusPerPod={gpus} (GPUs are requested through gpusPerPod)"
                )
