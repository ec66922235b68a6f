"""The C++ kernels' build: the shared CPU-feature header (kernels/cpu/cpu_features.h) is the one place that probes the
CPU, and a build's name follows both its source and the shared headers it includes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from expertmesh.kernels import cpu_extension

KERNELS = Path(cpu_extension.__file__).parent
PROBING = [  # the kernels that choose an instruction set at run time
    "moe/cpu/mxfp4_moe.cpp",
    "linear/cpu/row_invariant_linear.cpp",
    "dsa/cpu/dense_attention_amx.cpp",
    "dsa/cpu/paged_attention.cpp",
]


def test_the_kernels_probe_the_cpu_only_through_the_shared_header():
    header = (cpu_extension.INCLUDE_DIR / "cpu_features.h").read_text()
    assert "__get_cpuid_count" in header and "SYS_arch_prctl" in header
    for rel in PROBING:
        text = (KERNELS / rel).read_text()
        assert '#include "cpu_features.h"' in text, rel
        for own in (
            "__builtin_cpu_supports",
            "__get_cpuid_count",
            "SYS_arch_prctl",
            "#define EM_X86",
            "#define EM_AMX",
        ):
            assert not re.search(re.escape(own) + r"\b", text), f"{rel} probes the CPU itself ({own})"
        assert cpu_extension.shared_headers(KERNELS / rel) == [cpu_extension.INCLUDE_DIR / "cpu_features.h"]


def test_build_name_follows_the_source_and_its_shared_headers(tmp_path, monkeypatch):
    include = tmp_path / "include"
    include.mkdir()
    (include / "probe.h").write_text("// v1\n")
    (include / "unused.h").write_text("// not included\n")
    monkeypatch.setattr(cpu_extension, "INCLUDE_DIR", include)
    plain = tmp_path / "plain.cpp"
    plain.write_text("int f() { return 1; }\n")
    user = tmp_path / "user.cpp"
    user.write_text('#include "probe.h"\nint g() { return 2; }\n')

    # a source without shared headers keeps the name it always had: the hash of the source alone
    assert cpu_extension.build_name("x", plain) == f"x_{hashlib.sha256(plain.read_bytes()).hexdigest()[:12]}"
    before_plain, before_user = cpu_extension.build_name("x", plain), cpu_extension.build_name("x", user)
    (include / "unused.h").write_text("// changed, still not included\n")
    assert cpu_extension.build_name("x", user) == before_user
    (include / "probe.h").write_text("// v2\n")
    assert cpu_extension.build_name("x", user) != before_user  # a header change renames (so rebuilds) its users
    assert cpu_extension.build_name("x", plain) == before_plain
