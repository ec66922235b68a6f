"""The hostPath allow-list as pure functions (operator/pod_security.py): paths normalised, compared by whole
components; the operator's flag parsed and refused when an entry is not an absolute path; the defaults of the
spec, the operator and the chart name one directory."""

from __future__ import annotations

import argparse

import pytest
import yaml
from support.paths import REPO
from support.tiny_deployment import tiny

from expertmesh.operator import main as operator_main
from expertmesh.operator.pod_security import (
    DEFAULT_ALLOWED_HOST_PATHS,
    host_path_allowed,
    host_path_error,
    normalised,
    parse_allowed_host_paths,
)
from expertmesh.operator.spec import parse_spec
from expertmesh.operator.spec_model import CheckpointCache

ALLOWED = ("/var/cache/expertmesh", "/mnt/nvme")


@pytest.mark.parametrize(
    "path, norm",
    [
        ("/", "/"),
        ("/var/cache/expertmesh/", "/var/cache/expertmesh"),
        ("//var///cache/./expertmesh", "/var/cache/expertmesh"),
        ("/var/cache/expertmesh/../../../etc", "/etc"),
        ("/..", None),
        ("/var/../../etc", None),
        ("relative/path", None),
        ("", None),
    ],
)
def test_paths_are_normalised_lexically(path, norm):
    assert normalised(path) == norm


@pytest.mark.parametrize(
    "path, allowed",
    [
        ("/var/cache/expertmesh", True),
        ("/var/cache/expertmesh/models/kimi", True),
        ("/mnt/nvme/kv", True),
        ("/var/cache/expertmesh/../../../etc", False),  # '..' climbs out before the comparison
        ("/var/cache/expertmesh-other", False),  # a prefix of the text, not of the components
        ("/mnt/nvme0", False),
        ("/var/cache", False),  # above an allowed directory
        ("/", False),
        ("/etc", False),
        ("/run/containerd/containerd.sock", False),
        ("/var/run/docker.sock", False),
    ],
)
def test_a_path_is_allowed_only_at_or_below_an_allowed_directory(path, allowed):
    assert host_path_allowed(path, ALLOWED) is allowed


def test_the_error_names_the_field_the_path_and_what_is_allowed():
    kv = parse_spec(tiny(kv={"disk": {"sizeGiB": 1, "hostPath": "/etc/kubernetes"}}))
    err = host_path_error(kv, ALLOWED)
    assert err.startswith("spec.kv.disk.hostPath='/etc/kubernetes': not under a node directory")
    assert "/var/cache/expertmesh, /mnt/nvme" in err and "--allowed-host-paths" in err
    cache = parse_spec(
        tiny(model={"preset": "tiny", "checkpoint": {"uri": "https://x/ck", "cache": {"hostPath": "/srv"}}})
    )
    assert host_path_error(cache, ALLOWED).startswith("spec.model.checkpoint.cache.hostPath='/srv'")
    assert "none: the operator was started with an empty allow-list" in host_path_error(cache, ())
    # no node directory: nothing to refuse, whatever the list; a cache PVC or an unfetched source mounts none
    for spec in (
        tiny(),
        tiny(model={"preset": "tiny", "checkpoint": {"uri": "https://x/ck", "cache": {"claimName": "c"}}}),
        tiny(model={"preset": "tiny", "checkpoint": {"uri": "/opt/ck", "cache": {"hostPath": "/etc"}}}),
        tiny(kv={"disk": {"sizeGiB": 1}}),
    ):
        assert host_path_error(parse_spec(spec), ()) is None
    ok = parse_spec(
        tiny(
            model={"preset": "tiny", "checkpoint": {"uri": "hf://o/m"}},
            kv={"disk": {"sizeGiB": 1, "hostPath": "/mnt/nvme/kv"}},
        )
    )
    assert host_path_error(ok, ALLOWED) is None


def test_the_flag_parses_and_refuses_what_is_not_an_absolute_path():
    assert parse_allowed_host_paths("/var/cache/expertmesh") == DEFAULT_ALLOWED_HOST_PATHS
    assert parse_allowed_host_paths(" /mnt/nvme/ , /data//models,/mnt/nvme") == ("/mnt/nvme", "/data/models")
    assert parse_allowed_host_paths("") == ()
    for bad in ("relative", "/ok,nvme", "/.."):
        with pytest.raises(ValueError, match="--allowed-host-paths"):
            parse_allowed_host_paths(bad)


def test_the_operator_refuses_to_start_with_a_bad_allow_list(capsys):
    assert operator_main.main(["--allowed-host-paths", "mnt/nvme"]) == 2
    assert "--allowed-host-paths: 'mnt/nvme' is not an absolute path" in capsys.readouterr().err


def test_one_default_directory_in_the_spec_the_operator_and_the_chart():
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    flag_default = parser.parse_args([]).allowed_host_paths
    chart = yaml.safe_load((REPO / "charts" / "expertmesh" / "values.yaml").read_text())["operator"]["allowedHostPaths"]
    assert (CheckpointCache().host_path,) == DEFAULT_ALLOWED_HOST_PATHS == parse_allowed_host_paths(flag_default)
    assert tuple(chart) == DEFAULT_ALLOWED_HOST_PATHS
