"""Kubernetes' own syntax rules for what a MoEDeployment's spec puts into its children: DNS names, label keys and
values, resource names and quantities, file paths. Pure: each check returns None when the value is valid, else
what is wrong (the caller names the field).

The regular expressions are in the subset that Go's RE2 (the API server's OpenAPI `pattern`), Rust's `regex`
(pydantic) and Python's `re` read alike: no look-around, no back-references. Where a rule needs more than a pattern
(lengths of a label key's two parts, requests against limits) the operator checks it and the schema carries the
pattern and a maxLength.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# DNS-1123 label (RFC 1123): Secret keys of a pod's volume, namespaces, most object names' parts
DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL_MAX = 63
# DNS-1123 subdomain: ConfigMap, Secret, PVC names
DNS1123_SUBDOMAIN = rf"^{DNS1123_LABEL}(\.{DNS1123_LABEL})*$"
DNS1123_SUBDOMAIN_MAX = 253
# DNS-1035 label (RFC 1035): Service names (a letter first)
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# label value (also a label key's name part, without the length): empty, or alphanumerics with -_. inside
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_VALUE_MAX = 63
# qualified name (label / node-selector / toleration / topology keys): [DNS-1123 subdomain "/"] name
_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
QUALIFIED_NAME = rf"^({DNS1123_LABEL}(\.{DNS1123_LABEL})*/)?{_NAME_PART}$"
QUALIFIED_NAME_MAX = DNS1123_SUBDOMAIN_MAX + 1 + LABEL_VALUE_MAX
# a key of a Secret's data (what a secretKeyRef names)
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
# a resource quantity ("500m", "16Gi", "1e3"; never negative in a container's resources)
QUANTITY = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)))?$"
QUANTITY_MAX = 64
# an absolute path without "." or ".." components, empty components or control characters
_SEGMENT = r"([^/.\x00-\x1f\x7f][^/\x00-\x1f\x7f]*|\.[^/.\x00-\x1f\x7f][^/\x00-\x1f\x7f]*|\.\.[^/\x00-\x1f\x7f]+)"
ABSOLUTE_PATH = rf"^(/{_SEGMENT})*/?$"
VOLUME_PATH = rf"^/?({_SEGMENT}(/{_SEGMENT})*)?/?$"  # inside a volume: relative or absolute, never above its root
PATH_MAX = 1024
# a container image repository: [registry host[:port]/]path, path components lowercase (the distribution grammar)
_PATH_COMPONENT = r"[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*"
IMAGE_REPOSITORY = rf"^([A-Za-z0-9.-]+(:[0-9]+)?/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*$"
IMAGE_REPOSITORY_MAX = 255
IMAGE_TAG = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
# no whitespace or control characters (URLs, endpoints)
NO_SPACE = r"^[^\s\x00-\x1f\x7f]+$"
URL_MAX = 2048

# the resources a container may name without a domain (the rest are extended resources: DOMAIN/NAME)
NATIVE_RESOURCES = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES = re.compile(r"^hugepages-" + QUANTITY[1:])

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}


def _match(pattern: str, value: str) -> bool:
    return re.fullmatch(pattern, value) is not None


def dns_subdomain_error(value: str) -> str | None:
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        return f"must be at most {DNS1123_SUBDOMAIN_MAX} characters"
    if not _match(DNS1123_SUBDOMAIN, value):
        return "must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', alphanumeric at both ends)"
    return None


def label_value_error(value: str) -> str | None:
    if len(value) > LABEL_VALUE_MAX:
        return f"must be at most {LABEL_VALUE_MAX} characters (a label value)"
    if not _match(LABEL_VALUE, value):
        return "must be a label value (letters, digits, '-', '_' and '.', alphanumeric at both ends)"
    return None


def qualified_name_error(value: str) -> str | None:
    """A label key (also a node-selector, toleration or topology key): `[prefix/]name`, the prefix a DNS-1123
    subdomain of at most 253 characters, the name at most 63."""
    prefix, _, name = value.rpartition("/")
    if not _match(QUALIFIED_NAME, value):
        return (
            "must be a qualified name: [DNS-1123 subdomain/]name, the name alphanumeric at both ends with "
            "'-', '_' and '.' inside"
        )
    if len(name) > LABEL_VALUE_MAX:
        return f"must have a name part of at most {LABEL_VALUE_MAX} characters"
    if len(prefix) > DNS1123_SUBDOMAIN_MAX:
        return f"must have a prefix of at most {DNS1123_SUBDOMAIN_MAX} characters"
    return None


def absolute_path_error(value: str) -> str | None:
    if len(value) > PATH_MAX:
        return f"must be at most {PATH_MAX} characters"
    if not value.startswith("/"):
        return "must be an absolute path"
    if not _match(ABSOLUTE_PATH, value):
        return "must not contain '.' or '..' components, empty components ('//') or control characters"
    return None


def relative_path_error(value: str) -> str | None:
    """A path inside a volume: absolute or relative to its root, never above it."""
    return absolute_path_error("/" + value.lstrip("/")) if value.strip("/") else None


def parse_quantity(value) -> Decimal:
    """A Kubernetes quantity (int, or a string like "500m", "16Gi", "1e3") as a Decimal. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Decimal(value)
    text = str(value)
    if len(text) > QUANTITY_MAX or not _match(QUANTITY, text):
        raise ValueError(f"{text[:QUANTITY_MAX]!r} is not a quantity (e.g. 500m, 2, 16Gi, 1e3)")
    m = re.fullmatch(r"\+?([0-9.]+)(.*)", text)
    number, suffix = m.group(1), m.group(2)
    try:
        if suffix in _BINARY:
            return Decimal(number) * _BINARY[suffix]
        if suffix in _DECIMAL:
            return Decimal(number) * _DECIMAL[suffix]
        return Decimal(number + suffix)  # a decimal exponent, e.g. 1e3
    except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
        raise ValueError(f"{text!r} is not a quantity") from None


def resource_name_error(name: str) -> str | None:
    """A container resource's name: cpu, memory, ephemeral-storage, hugepages-<size>, or an extended resource
    DOMAIN/NAME outside the kubernetes.io domain."""
    if name in NATIVE_RESOURCES or HUGEPAGES.fullmatch(name):
        return None
    if "/" not in name:
        return (
            f"is not a container resource: expected one of {', '.join(NATIVE_RESOURCES)}, hugepages-<size> "
            f"or an extended resource DOMAIN/NAME (e.g. nvidia.com/gpu)"
        )
    err = qualified_name_error(name)
    if err:
        return err
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or name.startswith("requests."):
        return "is not a resource a container may request (the kubernetes.io domain is reserved)"
    return None


def is_extended_resource(name: str) -> bool:
    """Extended resources (GPUs and other devices) cannot be overcommitted: requests must equal limits."""
    return "/" in name and not name.split("/", 1)[0].endswith("kubernetes.io")
