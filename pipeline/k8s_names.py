"""The Kubernetes API server's rules for names, namespaces and labels, so that `validate` and `deploy`'s offline checks
refuse what `kubectl apply` would (the OpenAPI schemas type these fields as plain strings).

Facts (patterns and length limits) from kubernetes/kubernetes@03014f486c86dbe8a7fbe275fe14250854aab219
staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go (IsDNS1123Label, IsDNS1123Subdomain,
IsDNS1035Label, IsQualifiedName, IsValidLabelValue, IsConfigMapKey) and
kubernetes/kubernetes@61c7fad92cb749def0714b9ede24f86b16c6918e
staging/src/k8s.io/apimachinery/pkg/api/validation/path/name.go (ValidatePathSegmentName). A module of its own,
outside pipeline/k8s: the config validates with it, and the build stages, which hash the config's code, must not
hash the deployment's.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from pipeline.errors import shown


@dataclass(frozen=True)
class NameRule:
    name: str
    limit: int
    pattern: re.Pattern
    spelled: str  # the rule in words, for the fix

    def problem(self, value) -> str | None:
        """Why `value` breaks the rule, None when it keeps it."""
        if isinstance(value, str) and len(value) <= self.limit and self.pattern.fullmatch(value):
            return None
        return f"{shown(value)} is not a {self.name}: {self.spelled}"


_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_QUALIFIED = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
DNS1123_LABEL = NameRule(
    "DNS-1123 label",
    63,
    re.compile(_LABEL),
    "at most 63 lowercase letters, digits or '-', starting and ending with a letter or digit",
)
DNS1123_SUBDOMAIN = NameRule(
    "DNS-1123 subdomain",
    253,
    re.compile(rf"{_LABEL}(\.{_LABEL})*"),
    "at most 253 lowercase letters, digits, '-' or '.', each part between dots starting and ending with a letter or "
    "digit",
)
DNS1035_LABEL = NameRule(
    "DNS-1035 label",
    63,
    re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?"),
    "at most 63 lowercase letters, digits or '-', starting with a letter and ending with a letter or digit",
)
LABEL_NAME = NameRule(
    "label name",
    63,
    re.compile(_QUALIFIED),
    "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
)
LABEL_VALUE = NameRule(
    "label value",
    63,
    re.compile(f"({_QUALIFIED})?"),
    "empty, or at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
)
CONFIGMAP_KEY = NameRule(
    "ConfigMap key",
    253,
    re.compile(r"(?!\.\.)(?!\.\Z)[-._a-zA-Z0-9]+"),
    "at most 253 letters, digits, '-', '_' or '.', not '.' and not starting with '..'",
)
JOB_NAME = NameRule(
    "Job name",
    63,
    DNS1123_SUBDOMAIN.pattern,
    "a DNS-1123 subdomain of at most 63 characters (its pods carry it as a label value)",
)
PATH_SEGMENT = NameRule(
    "path segment name", 2**31, re.compile(r"(?!\.\.?\Z)[^/%]+"), "not empty, '.' or '..', and without '/' or '%'"
)


def label_key_problem(key) -> str | None:
    """Why `key` cannot be a label (or annotation, node selector, toleration) key: an optional DNS-1123 subdomain
    prefix and '/', then a label name."""
    if not isinstance(key, str):
        return LABEL_NAME.problem(key)
    prefix, slash, name = key.rpartition("/")
    why = (slash and DNS1123_SUBDOMAIN.problem(prefix)) or LABEL_NAME.problem(name)
    return f"{shown(key)} is not a label key ({why}); write [PREFIX/]NAME" if why else None


# metadata.name of each kind we write, by the rule its API server applies; other kinds are DNS-1123 subdomains.
# A LeaderWorkerSet's controller names a headless Service after it, so it needs a Service's name.
OBJECT_NAME_RULES = {
    "Service": DNS1035_LABEL,
    "LeaderWorkerSet": DNS1035_LABEL,
    "Job": JOB_NAME,
    "Role": PATH_SEGMENT,
    "RoleBinding": PATH_SEGMENT,
}


def object_name_problem(kind: str, name) -> str | None:
    return OBJECT_NAME_RULES.get(kind, DNS1123_SUBDOMAIN).problem(name)


def ascii_name(text: str, allowed: str) -> str:
    """`text` transliterated to ASCII (accents dropped: 'smöllm-ç' -> 'smollm-c'), every run of characters outside
    the character class `allowed` replaced by one '-'."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(f"[^{allowed}]+", "-", plain)
