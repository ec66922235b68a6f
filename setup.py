"""Map the design's top-level folders into the one `expertmesh` import namespace (see docs/architecture.md, "Layout")."""

from setuptools import find_packages, setup

FOLDERS = {
    "kernels": "expertmesh.kernels",
    "operator": "expertmesh.operator",
    "worker": "expertmesh.worker",
    "router": "expertmesh.router",
    "protos": "expertmesh.protos",
}

package_dir = {"expertmesh": "expertmesh"}
packages = ["expertmesh"] + [f"expertmesh.{p}" for p in find_packages(where="expertmesh")]
for folder, namespace in FOLDERS.items():
    package_dir[namespace] = folder
    packages.append(namespace)
    packages += [f"{namespace}.{p}" for p in find_packages(where=folder)]

setup(packages=packages, package_dir=package_dir, package_data={"expertmesh.protos": ["*.proto"]})
